"""Probe: one forced hopper_fwd launch on a small shape (for compute-sanitizer)."""
import sys

import torch

import flashtune
from flashtune.reference import reference

name = sys.argv[1]
for (b, h, n, causal) in [(1, 2, 64, False), (1, 2, 200, True)]:
    q, k, v = (torch.randn(b, h, n, 64, dtype=torch.float16, device="cuda") for _ in range(3))
    with flashtune.force(name):
        o = flashtune.attention(q, k, v, causal=causal)
    torch.cuda.synchronize()
    print(n, causal, float((o.double() - reference(q, k, v, causal=causal).double()).abs().max()))
