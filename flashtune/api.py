"""Public API: flashtune.attention and flashtune.attention_varlen."""
from __future__ import annotations

import torch

from .ops import attn_fwd, run_forward
from .ops_varlen import attn_varlen_fwd, run_forward_varlen
from .validate import check_qkv
from .validate_varlen import check_varlen

# `forward` stays importable from here (tests and the search use it)
forward = run_forward
__all__ = ["attention", "attention_varlen", "forward"]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              scale: float | None = None, deterministic: bool = False,
              return_lse: bool = False):
    """Exact attention softmax(q k^T * scale) v, FlashAttention-2 style, differentiable.

    q: (batch, heads, seqlen_q, head_dim); k, v: (batch, kv_heads, seqlen_k, head_dim) with
    heads a multiple of kv_heads (GQA/MQA). Any strides with a contiguous last dim, so
    (batch, seqlen, heads, head_dim) tensors passed as `.transpose(1, 2)` run without a copy.
    causal: query i sees key j iff j <= i + seqlen_k - seqlen_q (bottom-right aligned, as
    FlashAttention >= 2.1; SDPA's is_causal when seqlen_q == seqlen_k). A query row that sees
    no key returns zeros (and gets zero gradients). scale defaults to 1/sqrt(head_dim).
    Result in q's dtype. Gradients for q, k, v come back in their dtype and layout; only the
    output and a float32 log-sum-exp per query row are saved for the backward.
    deterministic: accumulate dQ without atomics (a separate dQ kernel), so that the backward
    gives bit-identical results run to run.
    return_lse: also return the row log-sum-exp, (O, LSE) with LSE float32 (batch, heads,
    seqlen_q), natural log, -inf for a row that sees no key: what flash_attn's softmax_lse gives
    ring / context-parallel attention to merge partial results. Gradients flow through O; the
    LSE is not differentiable.
    """
    check_qkv(q, k, v, causal, scale)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if (torch.compiler.is_compiling() or (torch.is_grad_enabled() and
                                          (q.requires_grad or k.requires_grad or v.requires_grad))):
        # through the registered op: autograd, torch.compile and CUDA graphs see one node
        out = attn_fwd(q, k, v, causal, scale, deterministic)
    else:
        out = run_forward(q, k, v, causal, scale)  # inference: skip the op's dispatch overhead
    return out if return_lse else out[0]


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                     scale: float | None = None, deterministic: bool = False,
                     return_lse: bool = False):
    """attention() on packed variable-length sequences, with flash_attn_varlen_func's layout and
    meaning; differentiable, a torch.library op (torch.compile traces it), no work on padding.

    q: (total_q, heads, head_dim); k, v: (total_k, kv_heads, head_dim), heads a multiple of
    kv_heads (GQA/MQA), head_dim 16..256, a contiguous last dim (any token/head strides).
    cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) on q's device, starting at 0, non-decreasing,
    ending at total_q / total_k: sequence b is q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] against
    k, v[cu_seqlens_k[b]:cu_seqlens_k[b+1]] (a length may be 0). max_seqlen_q, max_seqlen_k: ints
    >= every sequence's length (the launch grid covers them; blocks past a sequence's end exit at
    once). The offsets' values are checked before any launch, at the price of one device->host
    copy of cu_seqlens per call.
    causal: per sequence, bottom-right aligned: query i sees key j iff j <= i + len_k - len_q.
    A query row that sees no key (an empty key sequence, or causal with len_q > len_k) returns
    zeros and gets zero gradients. scale defaults to 1/sqrt(head_dim). deterministic: as
    attention() (a dQ kernel without atomics).
    return_lse: also return the row log-sum-exp, (O, LSE) with LSE float32 (heads, total_q) --
    flash_attn's varlen softmax_lse layout -- natural log, -inf for a row that sees no key; not
    differentiable.
    """
    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    scale = None if scale is None else float(scale)
    if (torch.compiler.is_compiling() or (torch.is_grad_enabled() and
                                          (q.requires_grad or k.requires_grad or v.requires_grad))):
        out = attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              causal, scale, deterministic)
    else:
        out = run_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 causal, scale)
    return out if return_lse else out[0]
