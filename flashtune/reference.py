"""Float64 reference attention (and a same-dtype PyTorch version to calibrate tolerances)."""
from __future__ import annotations

import math

# torch is imported where it is used: `import flashtune` binds reference() without importing
# torch, so that `flashtune search` can start its workers' server first (cli.py)


def causal_mask(nq: int, nk: int, device=None) -> "torch.Tensor":  # noqa: F821
    """True where query i may see key j: j <= i + nk - nq (bottom-right aligned, as FA >= 2.1)."""
    import torch
    i = torch.arange(nq, device=device)[:, None]
    j = torch.arange(nk, device=device)[None, :]
    return j <= i + (nk - nq)


def _attention(q, k, v, causal, scale, dtype, window=None, softcap=None, mask=None):
    import torch

    from .masks import dense_mask
    b, h, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if h != hk:  # GQA/MQA: each k/v head serves h // hk query heads
        k = k.repeat_interleave(h // hk, dim=1)
        v = v.repeat_interleave(h // hk, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        s = s.masked_fill(~causal_mask(nq, nk, q.device), float("-inf"))
    if window is not None:
        s = s.masked_fill(~dense_mask(nq, nk, causal, window, q.device), float("-inf"))
    if mask is not None:  # bool, broadcastable to (B, H, Nq, Nk): a BlockMask's to_dense_mask()
        s = s.masked_fill(~mask.to(q.device), float("-inf"))
    lse = torch.logsumexp(s.float() if dtype != torch.float64 else s, dim=-1)
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # rows that see no key: zeros (documented behaviour)
    return torch.matmul(p, v), lse


def reference(q, k, v, *, causal=False, scale=None, return_lse=False, window=None, softcap=None,
              mask=None):
    """Attention in float64 with flashtune's semantics; returns float64 (and the row LSE).
    window, softcap: as flashtune.attention (flashtune/masks.py); mask: bool broadcastable to
    (B, H, Nq, Nk), True = keep (a BlockMask's to_dense_mask())."""
    import torch
    o, lse = _attention(q, k, v, causal, scale, torch.float64, window, softcap, mask)
    return (o, lse) if return_lse else o


def same_dtype_math(q, k, v, *, causal=False, scale=None, window=None, softcap=None, mask=None):
    """PyTorch's plain math in the inputs' dtype: the error budget DESIGN.md's tolerance uses."""
    return _attention(q, k, v, causal, scale, q.dtype, window, softcap, mask)[0]
