"""Input validation for attention_varlen: packed (total_tokens, heads, head_dim) tensors and the
int32 cu_seqlens that cut them into sequences. The tensor checks are validate.py's; each message
here names the argument and what was expected.

Two stages: check_varlen (shapes, dtypes, devices: no device->host sync, so torch.compile traces
it) runs in the public function; check_cu_seqlens_values (the offsets' values, one sync) runs
in the op's real implementation, before any launch -- the kernels trust those offsets for every
address they compute, so a bad one would be an out-of-bounds access.
"""
from __future__ import annotations

import torch

from .validate import check_causal_scale, check_device, check_heads, check_tensors

__all__ = ["check_varlen", "check_cu_seqlens_values"]

_DIMS = "(total_tokens, heads, head_dim)"


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                 scale) -> None:
    """Everything that shapes, dtypes and devices decide (no sync)."""
    check_tensors(q, k, v, _DIMS)
    check_causal_scale(causal, scale)
    check_heads(q, k, v, head_axis=1)
    check_device(q)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of int32 offsets, got "
                            f"{type(cu).__name__}")
        if cu.dim() != 1:
            raise ValueError(f"{name} must be 1-D (batch + 1 offsets), got shape "
                             f"{tuple(cu.shape)}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name}.dtype must be torch.int32, got {cu.dtype}")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}: the offsets must "
                             "be on the device of q, k and v")
        if cu.shape[0] < 1:
            raise ValueError(f"{name} must hold batch + 1 >= 1 offsets, got none")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries but cu_seqlens_k has "
                         f"{cu_seqlens_k.shape[0]}: both must be batch + 1 long")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, (int, torch.SymInt)):
            raise TypeError(f"{name} must be an int, got {type(m).__name__}")
        if isinstance(m, int) and m < 0:
            raise ValueError(f"{name} must be >= 0, got {m}")


def check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                            total_q: int, total_k: int) -> None:
    """The offsets' values: start at 0, non-decreasing, end at the packed length, and no sequence
    longer than its max_seqlen (the grid covers max_seqlen: a longer sequence would lose rows).
    Costs one device->host copy of the two small offset tensors per call (a sync on the GPU),
    the price of never launching on offsets that point outside q, k, v."""
    both = torch.cat((cu_seqlens_q, cu_seqlens_k)).tolist()  # one sync for both
    n = cu_seqlens_q.shape[0]
    for name, cu, total, tensor, max_name, m in (
            ("cu_seqlens_q", both[:n], total_q, "q", "max_seqlen_q", max_seqlen_q),
            ("cu_seqlens_k", both[n:], total_k, "k and v", "max_seqlen_k", max_seqlen_k)):
        if cu[0] != 0:
            raise ValueError(f"{name} must start at 0, got {cu[0]}")
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        bad = next((i for i, n in enumerate(lengths) if n < 0), None)
        if bad is not None:
            raise ValueError(f"{name} must be non-decreasing, but entry {bad + 1} ({cu[bad + 1]}) "
                             f"< entry {bad} ({cu[bad]})")
        if cu[-1] != total:
            raise ValueError(f"{name}[-1] is {cu[-1]} but {tensor} hold {total} tokens: the last "
                             "offset must equal the packed length")
        longest = max(lengths, default=0)
        if longest > m:
            raise ValueError(f"{max_name} is {m} but sequence {lengths.index(longest)} of "
                             f"{name} has {longest} tokens: {max_name} must be >= every length")
