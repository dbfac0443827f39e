"""Outputs in their input's layout, as `torch.empty_like` allocates them, without torch's meta
reference for it: `torch.empty_like` of a meta tensor (the search's compile-ahead builds every
plan on meta tensors; a plan reads the layout forward() will allocate off one) runs
`torch._refs.empty_like`, whose stride logic imports torch's symbolic shapes and sympy (0.3 s
here, more in a fresh process on the device: each of a search's ~14 compile workers per GPU paid
it at start-up, and a user's first call once)."""
from __future__ import annotations

import torch


def dense(shape, strides) -> bool:
    """Whether a layout's elements are dense and do not overlap (ATen's
    is_non_overlapping_and_dense): ordered by stride, each dimension longer than 1 steps over
    exactly the elements of the ones before it."""
    expect = 1
    for stride, size in sorted((st, s) for s, st in zip(shape, strides) if s != 1):
        if stride != expect:
            return False
        expect *= size
    return True


def like_strides(t: torch.Tensor) -> tuple:
    """The strides `torch.empty_like(t)` gives (preserve_format): t's own where t is dense and
    non-overlapping, else what torch infers (through the meta path: a layout with gaps or
    overlaps is rare here)."""
    if dense(t.shape, t.stride()):
        return tuple(t.stride())
    return tuple(torch.empty_like(t, device="meta").stride())


def empty_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`torch.empty_like(t)` (its layout), for meta tensors without the meta reference."""
    if t.device.type != "meta":
        return torch.empty_like(t, dtype=dtype)
    return torch.empty_strided(t.shape, like_strides(t), dtype=dtype or t.dtype, device=t.device)


def zeros_like(t: torch.Tensor) -> torch.Tensor:
    """`torch.zeros_like(t)`; a meta tensor holds no values, so its is `empty_like`'s."""
    return empty_like(t) if t.device.type == "meta" else torch.zeros_like(t)


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor in the layout `torch.empty_like(t)` allocates."""
    return torch.empty_strided(t.shape, like_strides(t), dtype=t.dtype, device="meta")
