"""Tensor values already checked on the host, so that calls sharing the same small index tensors
(the layers of one decoding step share cache_seqlens and block_table; of one training step,
cu_seqlens) pay for one device->host copy, not one each.

Keyed by the tensors themselves (weak references: a memo never keeps a tensor alive) and their
version counters, which every in-place PyTorch op bumps, plus the bounds the values were checked
against. A write PyTorch cannot see (a raw-pointer kernel) is not detected: the kernels clamp
every index they read from these tensors, so such a write can make an answer wrong but never an
access out of bounds.
"""
from __future__ import annotations

import weakref

__all__ = ["CheckedValues"]


class CheckedValues:
    """get(tensors, bounds) -> the value put for the same tensors, unchanged, and bounds; else
    None. `tensors` may hold None (an absent optional tensor)."""

    def __init__(self, size: int = 64):
        self._size = size
        self._seen: dict = {}

    def get(self, tensors: tuple, bounds):
        hit = self._seen.get(tuple(id(t) for t in tensors))
        if hit is None:
            return None
        refs, versions, seen_bounds, value = hit
        if seen_bounds != bounds:
            return None
        for t, ref, version in zip(tensors, refs, versions):
            if t is not None and (ref() is not t or t._version != version):
                return None
        return value

    def put(self, tensors: tuple, bounds, value) -> None:
        if len(self._seen) >= self._size:
            self._seen.clear()
        self._seen[tuple(id(t) for t in tensors)] = (
            tuple(None if t is None else weakref.ref(t) for t in tensors),
            tuple(None if t is None else t._version for t in tensors), bounds, value)

    def clear(self) -> None:
        self._seen.clear()
