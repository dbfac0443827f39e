"""Input validation for the public API: every message names the argument and what was expected."""
from __future__ import annotations

import math

import torch

from . import env

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


def _cpu_ok() -> bool:
    return env.interpreting() and env.triton_interprets()


def check_head_dim(d: int) -> int:
    """Raise ValueError unless the kernels support head dim `d` (the API and the CLI's
    --head-dim share this check and its message); return d."""
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {d} is not supported: expected {MIN_HEAD_DIM}..{MAX_HEAD_DIM}")
    return d


def check_qkv(q, k, v, causal, scale) -> None:
    """Raise a clear error for bad input. The common all-good case is one cheap expression
    (this runs on every call); the detailed checks below run only when it fails."""
    try:
        qs, ks = q.shape, k.shape
        if (len(qs) == 4 and ks == v.shape and len(ks) == 4 and qs[0] == ks[0]
                and qs[3] == ks[3] and MIN_HEAD_DIM <= qs[3] <= MAX_HEAD_DIM
                and ks[1] and not qs[1] % ks[1]
                and q.dtype in SUPPORTED_DTYPES and q.dtype == k.dtype == v.dtype
                and q.get_device() == k.get_device() == v.get_device()
                and (q.is_cuda or (q.device.type == "cpu" and _cpu_ok()))
                and q.stride(3) == k.stride(3) == v.stride(3) == 1
                and (causal is True or causal is False)
                and (scale is None or (type(scale) is float and 0 < scale < math.inf))
                and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
                and isinstance(v, torch.Tensor)):
            return
    except (AttributeError, TypeError, IndexError, RuntimeError):
        pass
    _check_qkv_in_detail(q, k, v, causal, scale)


def _check_qkv_in_detail(q, k, v, causal, scale) -> None:
    check_tensors(q, k, v, "(batch, heads, seqlen, head_dim)")
    check_causal_scale(causal, scale)
    b = q.shape[0]
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {b}, k {k.shape[0]}, v {v.shape[0]}")
    check_heads(q, k, v, head_axis=1)
    check_device(q)


# The pieces below are shared with validate_varlen (packed (total, heads, head_dim) tensors).
def check_tensors(q, k, v, dims: str) -> None:
    """Type, number of dims (`dims` names them), dtype and device of q, k, v."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        ndim = dims.count(",") + 1
        if t.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dims {dims}, got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}.dtype must be float16, bfloat16 or float32, got {t.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}.dtype ({t.dtype}) must match q.dtype ({q.dtype})")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}: "
                             "q, k and v must be on one device")


def check_causal_scale(causal, scale) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a finite positive number, got {scale}")


def check_heads(q, k, v, head_axis: int, names=("q", "k", "v")) -> None:
    """k and v alike, one head_dim in 16..256, q heads a multiple of k/v heads, head_dim last
    and contiguous. `names`: what the caller calls the three tensors (k_cache, ...)."""
    nq_, nk, nv = names
    d = q.shape[-1]
    if k.shape != v.shape:
        raise ValueError(f"{nk} and {nv} must have the same shape, got {nk} {tuple(k.shape)} "
                         f"and {nv} {tuple(v.shape)}")
    if k.shape[-1] != d:
        raise ValueError(f"head_dim differs: {nq_} has {d}, {nk} and {nv} have {k.shape[-1]}")
    check_head_dim(d)
    h, hk = q.shape[head_axis], k.shape[head_axis]
    if hk == 0 or h % hk:
        raise ValueError(f"{nq_} heads ({h}) must be a positive multiple of {nk}/{nv} heads "
                         f"({hk}) (grouped-query attention)")
    for name, t in zip(names, (q, k, v)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides "
                             f"{tuple(t.stride())}: call {name}.contiguous() or keep head_dim last")


def check_device(q) -> None:
    """q's device can run the kernels (CUDA, or the CPU in Triton's interpreter)."""
    if q.device.type == "cpu" and not env.interpreting():
        raise ValueError("q, k, v are CPU tensors: flashtune's kernels run on CUDA GPUs. To run on "
                         "the CPU (slowly, for tests), set TRITON_INTERPRET=1 in the environment "
                         "before importing flashtune")
    if q.device.type == "cpu" and not env.triton_interprets():
        raise RuntimeError("q, k, v are CPU tensors and TRITON_INTERPRET=1 is set, but it was set "
                           "after Triton was imported, so Triton's interpreter is off in this "
                           "process: set TRITON_INTERPRET=1 before importing flashtune or triton "
                           "(e.g. in the shell: TRITON_INTERPRET=1 python ...)")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q is on {q.device}: expected a CUDA device")
