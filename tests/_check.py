"""Shared assertion: flashtune's result against the float64 reference, DESIGN.md's tolerance;
the Hopper families' GPU marker."""
import pytest
import torch

import flashtune
from flashtune.accuracy import compare
from flashtune.reference import reference, same_dtype_math

# the Gluon families' kernels run on sm_90 only
ON_H100 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper_gpu = pytest.mark.skipif(not ON_H100, reason="needs an sm_90 GPU")



def qkv(b, h, hk, nq, nk, d, dtype, device, layout="bhnd"):
    """Fresh random q, k, v; layout "bnhd" makes (B, N, H, D) tensors viewed as (B, H, N, D)."""
    def make(heads, n):
        if layout == "bnhd":
            return torch.randn(b, n, heads, d, dtype=dtype, device=device).transpose(1, 2)
        return torch.randn(b, heads, n, d, dtype=dtype, device=device)
    return make(h, nq), make(hk, nk), make(hk, nk)


def assert_matches_reference(q, k, v, causal=False, scale=None, out=None):
    if out is None:
        out = flashtune.attention(q, k, v, causal=causal, scale=scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    ref = reference(q, k, v, causal=causal, scale=scale)
    report = compare(out, ref, same_dtype_math(q, k, v, causal=causal, scale=scale))
    assert report.ok, str(report)
    return out


def code_lines(src: str) -> str:
    """A rendered kernel module's code without its first line and comment-only lines: what a
    "renders no mask code" test searches."""
    return "\n".join(line for line in src.splitlines()[1:]
                     if line.strip() and not line.lstrip().startswith("#"))
