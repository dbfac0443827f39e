"""Copies of (B, H, N, D) tensors between memory layouts, for the Hopper plans' mixed-layout calls
(launch_hopper.kv_rows_copy: K and V into q's (B, N, H, D) memory, dK and dV back). PyTorch's
copy of a transposed tensor runs its generic strided loop: 104 us for the four copies of a GQA
4:1 backward at N=1k, B=16, D=128 on the H100 (1.3 TB/s; docs/benchmarks.md, session 28),
which made that backward slower than the generic family's without copies. One program here
copies a (BLOCK_N, D) tile of one (batch, head), each row D contiguous elements in both
layouts."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import alloc
from .env import interpreting
from .launcher import Launcher

BLOCK_N = 64


@triton.jit
def _copy_bhnd(src, dst, H, N, s_b, s_h, s_n, d_b, d_h, d_n, D: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    ok = (rows[:, None] < N) & (cols[None, :] < D)
    x = tl.load(src + b.to(tl.int64) * s_b + h.to(tl.int64) * s_h
                + rows[:, None].to(tl.int64) * s_n + cols[None, :], mask=ok)
    tl.store(dst + b.to(tl.int64) * d_b + h.to(tl.int64) * d_h
             + rows[:, None].to(tl.int64) * d_n + cols[None, :], x, mask=ok)


_launchers: dict = {}


def copy_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst.copy_(src) for (B, H, N, D) tensors of one shape and dtype whose last dims are
    contiguous; a Triton kernel on the GPU (and in the interpreter), torch's copy elsewhere."""
    if dst.shape != src.shape or dst.dtype != src.dtype or dst.dim() != 4:
        raise ValueError(f"copy_: (B, H, N, D) tensors of one shape and dtype, got "
                         f"{tuple(dst.shape)} {dst.dtype} and {tuple(src.shape)} {src.dtype}")
    kernel = dst.device.type == "cuda" or (dst.device.type == "cpu" and interpreting())
    if not kernel or dst.stride(3) != 1 or src.stride(3) != 1:
        return dst.copy_(src)
    b, h, n, d = src.shape
    if src.numel() == 0:
        return dst
    launch = _launchers.get(d)
    if launch is None:
        launch = _launchers[d] = Launcher(_copy_bhnd, D=d, BLOCK_D=triton.next_power_of_2(d),
                                          BLOCK_N=BLOCK_N, num_warps=4)
    launch((triton.cdiv(n, BLOCK_N), b * h), src, dst, h, n, *src.stride()[:3],
           *dst.stride()[:3])
    return dst


def rows_copy(t: torch.Tensor) -> torch.Tensor:
    """t's values in (B, N, H, D) memory, as a (B, H, N, D) view of it."""
    b, h, n, d = t.shape
    out = torch.empty((b, n, h, d), dtype=t.dtype, device=t.device).transpose(1, 2)
    return copy_(out, t)


def like_copy(like: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """t's values in `like`'s layout (alloc.empty_like keeps it)."""
    return copy_(alloc.empty_like(like), t)
