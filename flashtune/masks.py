"""Masks beyond the dense and causal ones: local (sliding-window) attention, logit softcapping and
block-sparse attention (flashtune.BlockMask). One home for their meaning, shared by validation,
the launches, the dispatcher's buckets and the float64 reference.

window=(left, right), flash_attn's `window_size`: with diag = Nk - Nq (bottom-right alignment, as
the causal mask), query i sees key j iff i + diag - left <= j <= i + diag + right; -1 is
unbounded on that side. causal=True is the window's right edge at 0 (as flash_attn: a causal
call with a window uses (left, 0)). softcap=c: scores s = scale * q.k become c * tanh(s / c)
before the softmax (Gemma 2).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

__all__ = ["Masks", "check_window", "check_softcap", "window_range", "dense_mask", "UNBOUNDED"]

# what the kernels take for an unbounded side: beyond any index difference (int32-safe sums)
UNBOUNDED = 1 << 30


def check_window(window, causal: bool, nq: int | None = None, nk: int | None = None
                 ) -> tuple | None:
    """The window as the kernels take it, or None when it masks nothing beyond `causal`.
    Raises naming `window` for anything but a pair of ints >= -1. nq, nk: the most query and
    key positions a sequence of the call may have; a side reaching past them cuts nothing and
    becomes unbounded (-1), so a window as wide as the keys runs the dense kernels (a causal
    16k call with window (16384, 0) ran the masked kernels at 0.6x the causal ones, H100)."""
    if window is None:
        return None
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or any(isinstance(w, bool) or not isinstance(w, int) for w in window)):
        raise TypeError(f"window must be a pair of ints (left, right) or None, got {window!r}")
    left, right = window
    if left < -1 or right < -1:
        raise ValueError(f"window sizes must be >= 0, or -1 for unbounded; got window={window!r}")
    if causal:
        right = 0
    # query i sees keys [i + nk - nq - left, i + nk - nq + right]: every key from left >= nk - 1,
    # up to the last from right >= nq - 1
    if nk is not None and left >= nk - 1:
        left = -1
    if nq is not None and not causal and right >= nq - 1:
        right = -1
    if left == -1 and right == -1:
        return None
    if left == -1 and causal:
        return None  # the causal mask alone
    return (left, right)


def check_softcap(softcap) -> float | None:
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float > 0 or None, got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a finite number > 0 (None: no softcapping), got "
                         f"{softcap}")
    return float(softcap)


def kernel_window(window: tuple) -> tuple:
    """(left, right) with -1 as UNBOUNDED: the kernels' runtime ints."""
    return tuple(UNBOUNDED if w < 0 else w for w in window)


def window_range(start: int, block: int, block_o: int, diag: int, before: int, after: int,
                 n_o: int, n_even_o: int) -> tuple:
    """The templates' _window_range in Python: rows start .. start + block - 1, each seeing the
    other axis' indices [r + diag - before, r + diag + after] (UNBOUNDED for -1). Returns
    (lo, full_lo, full_hi, hi): every index any row sees lies in [lo, hi) (blocks of block_o
    from lo); [full_lo, full_hi) are blocks every row sees in full. The forward calls it per
    query block (keys: before=left, after=right); the dK/dV kernel per key block (queries:
    diag -> -diag, before=right, after=left)."""
    lo = (max(start + diag - before, 0) // block_o) * block_o
    hi = min(max(start + block + diag + after, 0), n_o)
    full_lo = -(-max(start + block - 1 + diag - before, 0) // block_o) * block_o
    full_hi = (max(start + diag + after + 1, 0) // block_o) * block_o
    full_lo = min(max(full_lo, lo), hi)
    full_hi = min(max(min(full_hi, n_even_o), full_lo), hi)
    return lo, full_lo, full_hi, hi


def dense_mask(nq: int, nk: int, causal: bool = False, window: tuple | None = None,
               device=None) -> torch.Tensor:
    """(nq, nk) bool, True where query i sees key j under causal and window (bottom-right)."""
    i = torch.arange(nq, device=device)[:, None]
    j = torch.arange(nk, device=device)[None, :]
    diag = nk - nq
    keep = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if causal:
        keep &= j <= i + diag
    if window is not None:
        left, right = window
        if left >= 0:
            keep &= j >= i + diag - left
        if right >= 0:
            keep &= j <= i + diag + right
    return keep


@lru_cache(maxsize=1024)
def window_keys(nq: int, nk: int, causal: bool, window: tuple | None) -> float:
    """Keys a query sees on average (what the FLOP count and the buckets use)."""
    if window is None:
        return nk / 2 if causal else nk  # DESIGN's convention: causal halves the FLOPs
    left, right = window
    if causal:
        right = 0
    i = torch.arange(nq, dtype=torch.int64)
    lo = torch.zeros_like(i) if left < 0 else (i + (nk - nq - left)).clamp(min=0)
    hi = torch.full_like(i, nk - 1) if right < 0 else (i + (nk - nq + right)).clamp(max=nk - 1)
    return float((hi - lo + 1).clamp(min=0).sum()) / max(nq, 1)


@dataclass(frozen=True, eq=False)
class Masks:
    """A call's masks beyond causal, validated: window (left, right) or None, softcap or None,
    block_mask (flashtune.BlockMask) or None. `structure` is what the variant must render."""
    window: tuple | None = None
    softcap: float | None = None
    block_mask: object = None

    # computed once per Masks (a call's, carried from the forward to the backward), read by
    # each memo a call consults
    @cached_property
    def any(self) -> bool:
        return self.window is not None or self.softcap is not None or self.block_mask is not None

    @property
    def structure(self) -> dict:
        return {"window": self.window is not None, "softcap": self.softcap is not None,
                "block_sparse": self.block_mask is not None}

    @property
    def kinds(self) -> tuple:
        """The mask fields the call needs rendered (Problem.mask_kinds' names)."""
        return tuple(name for name, on in self.structure.items() if on)

    @cached_property
    def key(self) -> tuple:
        """What a launch plan depends on (the block mask by identity: its tensors are args)."""
        return (self.window, self.softcap,
                None if self.block_mask is None else self.block_mask.identity)


NONE = Masks()


# -- the search: a masked Problem's representative masks ----------------------------------------
SEARCH_SOFTCAP = 50.0  # Gemma 2's attn_logit_softcapping


def problem_window(p) -> tuple | None:
    """A window whose keys per query are about p.window: (W - 1, 0) causal, centred otherwise."""
    if not p.window:
        return None
    w = p.window
    return (w - 1, 0) if p.causal else (w // 2, w - 1 - w // 2)


@lru_cache(maxsize=16)
def representative(p, device: str = "cuda") -> Masks:
    """The masks a search times a masked Problem with: problem_window's window, softcap 50, and
    a block mask of 128-blocks kept at random (seeded) at p.block_density, the diagonal always
    kept (no empty row). The same problem gives the same masks."""
    if not (p.window or p.softcap or p.block_density):
        return NONE
    bm = None
    if p.block_density:
        from .block_mask import BlockMask
        nqb, nkb = -(-p.seqlen_q // 128), -(-p.seqlen_k // 128)
        g = torch.Generator().manual_seed(12345)
        blocks = torch.rand(nqb, nkb, generator=g) < p.block_density
        blocks |= torch.eye(nqb, nkb, dtype=torch.bool)
        bm = BlockMask.from_dense(blocks.to(device), (p.seqlen_q, p.seqlen_k), 128)
    return Masks(problem_window(p), SEARCH_SOFTCAP if p.softcap else None, bm)


def parse_spec(text: str) -> dict:
    """A CLI mask spec -> Problem fields: "window=1024", "softcap", "density=0.1", joined by
    "+" ("window=4096+softcap"); "none" = no mask."""
    out: dict = {}
    for part in filter(None, str(text).strip().lower().split("+")):
        name, _, value = part.partition("=")
        try:
            if name == "none" and not value:
                continue
            if name == "window" and int(value) > 0:
                out["window"] = int(value)
            elif name == "softcap" and not value:
                out["softcap"] = True
            elif name == "density" and 0 < float(value) <= 1:
                out["block_density"] = float(value)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"mask spec {text!r}: expected none, window=<keys>, softcap or "
                             f"density=<0..1>, joined by '+'") from None
    return out
