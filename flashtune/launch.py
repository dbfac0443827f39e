"""Launch a generated kernel for one problem: grid, strides, constexprs. No policy here."""
from __future__ import annotations

import math

import torch
import triton

from .codegen import Variant, load

_DOT_PRECISION = {torch.float32: "ieee"}  # float32 stays float32; fp16/bf16 ignore the setting


def _alloc(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


_allocator_set = False


def _need_allocator() -> None:
    """Tensor descriptors built inside a kernel need a global scratch allocator (set once)."""
    global _allocator_set
    if not _allocator_set:
        triton.set_allocator(_alloc)
        _allocator_set = True


def descriptor_ok(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need 16-byte aligned bases and strides (all but the last dim)."""
    for t in tensors:
        s = t.stride()
        # element sizes are powers of two, so OR-ing the strides keeps the low bits that matter
        if t.data_ptr() & 15 or ((s[0] | s[1] | s[2]) * t.element_size()) & 15:
            return False
    return True


def precise_exp(q) -> bool:
    """float32 on the GPU: libdevice exp instead of ex2.approx (the interpreter has no libdevice,
    and its exp2 is numpy's, already exact to rounding)."""
    return q.dtype == torch.float32 and q.is_cuda


def block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def forward_args(q, k, v, o, lse, causal: bool, scale: float | None, variant: Variant):
    """(grid, positional args, keyword args) of the fwd kernel for one call: the one place that
    knows its signature (launch and the overhead benchmark both use it)."""
    b, h, nq, d = q.shape
    nk = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    grid = (triton.cdiv(nq, variant.block_m) * b * h,)
    args = (q, k, v, o, lse, scale,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            o.stride(0), o.stride(1), o.stride(2),
            h, nq, nk)
    kwargs = dict(
        HEAD_DIM=d, BLOCK_D=block_d(d), BLOCK_M=variant.block_m, BLOCK_N=variant.block_n,
        IS_CAUSAL=causal, GROUP=h // k.shape[1], EVEN_N=nk % variant.block_n == 0,
        DOT_PRECISION=_DOT_PRECISION.get(q.dtype, "tf32"), PRECISE=precise_exp(q),
        num_warps=variant.num_warps, num_stages=variant.num_stages)
    return grid, args, kwargs


def forward(q, k, v, causal: bool, scale: float | None, variant: Variant):
    """Run the fwd variant: returns O (q's dtype, (B, H, Nq, D)) and LSE (float32, (B, H, Nq))."""
    o = torch.empty_like(q)  # keeps q's layout when dense: (B, N, H, D) views stay so
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    if variant.loads == "descriptor":
        _need_allocator()
    grid, args, kwargs = forward_args(q, k, v, o, lse, causal, scale, variant)
    load(variant).attn_fwd[grid](*args, **kwargs)
    return o, lse
