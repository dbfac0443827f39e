"""Public API: flashtune.attention."""
from __future__ import annotations

import torch

from . import dispatch, launch
from .problem import Problem
from .validate import check_qkv


def problem_of(family: str, q, k, causal: bool) -> Problem:
    b, h, nq, d = q.shape
    return Problem(family, str(q.dtype).removeprefix("torch."), d, causal, h // k.shape[1],
                   b, h, nq, k.shape[2])


def forward(q, k, v, causal: bool, scale, variant=None):
    """Validated inputs -> (O, LSE). Handles the empty cases the kernel never sees."""
    b, h, nq, d = q.shape
    nk = k.shape[2]
    if q.numel() == 0 or nk == 0:
        # nothing to attend to: zeros (a row that sees no key returns zeros), LSE = -inf
        return (torch.zeros_like(q),
                torch.full((b, h, nq), float("-inf"), dtype=torch.float32, device=q.device))
    if variant is None:
        variant = dispatch.select(problem_of("fwd", q, k, causal))
    variant = dispatch.fit_to_inputs(variant, launch.descriptor_ok(q, k, v))
    return launch.forward(q, k, v, causal, scale, variant)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              scale: float | None = None) -> torch.Tensor:
    """Exact attention softmax(q k^T * scale) v, FlashAttention-2 style.

    q: (batch, heads, seqlen_q, head_dim); k, v: (batch, kv_heads, seqlen_k, head_dim) with
    heads a multiple of kv_heads (GQA/MQA). Any strides with a contiguous last dim, so
    (batch, seqlen, heads, head_dim) tensors passed as `.transpose(1, 2)` run without a copy.
    causal: query i sees key j iff j <= i + seqlen_k - seqlen_q (bottom-right aligned, as
    FlashAttention >= 2.1; SDPA's is_causal when seqlen_q == seqlen_k). A query row that sees
    no key returns zeros. scale defaults to 1/sqrt(head_dim). Result in q's dtype.
    """
    check_qkv(q, k, v, causal, scale)
    return forward(q, k, v, causal, scale)[0]
