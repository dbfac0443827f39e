"""Public API: flashtune.attention and flashtune.attention_varlen."""
from __future__ import annotations

import torch

from .block_mask import BlockMask
from .masks import NONE, Masks, check_softcap, check_window
from .ops import attn_fwd, attn_fwd_eager, attn_masked_eager, attn_sparse_fwd, run_forward
from .ops_varlen import attn_varlen_fwd, attn_varlen_fwd_eager, run_forward_varlen
from .validate import check_qkv
from .validate_varlen import check_varlen

# `forward` stays importable from here (tests and the search use it)
forward = run_forward
__all__ = ["attention", "attention_varlen", "forward"]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              scale: float | None = None, deterministic: bool = False,
              return_lse: bool = False, window: tuple[int, int] | None = None,
              softcap: float | None = None, block_mask: BlockMask | None = None):
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
    window: (left, right), flash_attn's window_size: query i sees key j iff
    i + Nk - Nq - left <= j <= i + Nk - Nq + right (bottom-right aligned, as causal); -1 leaves
    a side unbounded; with causal=True the right side is 0. Key blocks wholly outside the window
    are never loaded; a side reaching past every key is unbounded, and a window that cuts
    nothing runs the unmasked kernels. softcap: scores s = scale * q.k become
    softcap * tanh(s / softcap) before the softmax (Gemma 2's attn_logit_softcapping;
    flash_attn's softcap > 0).
    block_mask: a flashtune.BlockMask (from_dense, from_mask, or from_flex of a FlexAttention
    BlockMask): only its kept blocks are loaded and computed, forward and backward; composes
    with causal, window and softcap (a registered op too: torch.compile traces it).
    """
    check_qkv(q, k, v, causal, scale)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    masks = NONE
    if window is not None or softcap is not None or block_mask is not None:
        masks = check_masks(q, k, causal, window, softcap, block_mask)
    compiling = torch.compiler.is_compiling()
    if compiling or (torch.is_grad_enabled() and
                     (q.requires_grad or k.requires_grad or v.requires_grad)):
        # torch.compile traces the registered op (one node for it and CUDA graphs); eager
        # autograd runs the op's own formula without the torch.library dispatch (ops.py), a
        # masked call's Masks as one object
        wl, wr = masks.window or (-1, -1)
        if not compiling:
            out = (attn_masked_eager(q, k, v, causal, scale, deterministic, masks) if masks.any
                   else attn_fwd_eager(q, k, v, causal, scale, deterministic))
        elif masks.block_mask is not None:
            out = attn_sparse_fwd(q, k, v, *masks.block_mask.op_args(), causal, scale,
                                  deterministic, wl, wr, masks.softcap)
        else:
            out = attn_fwd(q, k, v, causal, scale, deterministic, wl, wr, masks.softcap)
    else:
        # inference: skip the op's dispatch overhead
        out = run_forward(q, k, v, causal, scale, masks=masks)
    return out if return_lse else out[0]


def check_masks(q, k, causal, window, softcap, block_mask) -> Masks:
    """Validated masks of a dense call (errors name the argument), before any launch."""
    window = check_window(window, causal, q.shape[-2], k.shape[-2])
    softcap = check_softcap(softcap)
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            if hasattr(block_mask, "kv_num_blocks"):
                raise TypeError("block_mask is a FlexAttention BlockMask: convert it with "
                                "flashtune.BlockMask.from_flex(block_mask)")
            raise TypeError(f"block_mask must be a flashtune.BlockMask, got "
                            f"{type(block_mask).__name__}")
        block_mask.check(q, k)
    return Masks(window, softcap, block_mask)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                     scale: float | None = None, deterministic: bool = False,
                     return_lse: bool = False, window: tuple[int, int] | None = None,
                     softcap: float | None = None):
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
    window, softcap: as attention(), per sequence (the window bottom-right aligned to each
    sequence's own lengths).
    """
    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale)
    window = check_window(window, causal, max_seqlen_q, max_seqlen_k)
    softcap = check_softcap(softcap)
    masks = Masks(window, softcap) if window is not None or softcap is not None else NONE
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    scale = None if scale is None else float(scale)
    compiling = torch.compiler.is_compiling()
    if compiling or (torch.is_grad_enabled() and
                     (q.requires_grad or k.requires_grad or v.requires_grad)):
        wl, wr = window or (-1, -1)
        op = attn_varlen_fwd if compiling else attn_varlen_fwd_eager
        out = op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                 deterministic, wl, wr, softcap)
    else:
        out = run_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 causal, scale, masks)
    return out if return_lse else out[0]
