"""`Problem` (what one call needs) and `Bucket` (problems that share one tuned config)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ._keys import OMIT_DEFAULT, stable_key

DTYPES = ("float16", "bfloat16", "float32")
# what the CLI's --dtype options accept, to the names above
DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                 "half": "float16", "fp32": "float32", "float32": "float32"}


def parse_dtype(text: str) -> str:
    """A dtype as a user spells it ("bf16", "BFloat16", "half") -> its name ("bfloat16").
    Raises ValueError listing the accepted spellings: every CLI --dtype goes through here."""
    name = DTYPE_ALIASES.get(str(text).strip().lower())
    if name is None:
        raise ValueError(f"unknown dtype {text!r}; expected one of {', '.join(DTYPE_ALIASES)}")
    return name


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16": the spelling Problem, Bucket and the tuned DB use."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """"bfloat16" -> torch.bfloat16."""
    return getattr(torch, name)


@dataclass(frozen=True)
class Problem:
    family: str      # kernel family (flashtune/families/): "fwd", "bwd", ...
    dtype: str       # "float16" | "bfloat16" | "float32"
    head_dim: int
    causal: bool
    group: int       # q heads per k/v head (1: MHA; heads: MQA)
    batch: int
    heads: int       # q heads
    seqlen_q: int
    seqlen_k: int
    # masks beyond causal (flashtune/masks.py); left out of the key at their defaults.
    # window: the keys a query sees on average under a sliding window (0: no window);
    # softcap: tanh softcapping; block_density: the fraction of blocks a BlockMask keeps (0: none)
    window: int = field(default=0, metadata=OMIT_DEFAULT)
    softcap: bool = field(default=False, metadata=OMIT_DEFAULT)
    block_density: float = field(default=0.0, metadata=OMIT_DEFAULT)

    @property
    def key(self) -> str:
        return stable_key(self)

    @classmethod
    def of_call(cls, family: str, q, k, causal: bool, masks=None) -> "Problem":
        """The problem of a call with q (B, H, Nq, D) and k (B, Hk, Nk, D) (and its Masks)."""
        b, h, nq, d = q.shape
        if masks is None or not masks.any:
            return cls(family, dtype_name(q.dtype), d, causal, h // k.shape[1],
                       b, h, nq, k.shape[2])
        from .masks import window_keys
        nk = k.shape[2]
        return cls(family, dtype_name(q.dtype), d, causal, h // k.shape[1], b, h, nq, nk,
                   window=0 if masks.window is None else
                   max(1, round(window_keys(nq, nk, causal, masks.window))),
                   softcap=masks.softcap is not None,
                   block_density=0.0 if masks.block_mask is None else
                   round(masks.block_mask.density(), 4))

    @property
    def mask_kinds(self) -> tuple:
        return tuple(n for n, on in (("window", self.window), ("softcap", self.softcap),
                                     ("block_sparse", self.block_density)) if on)

    def flops(self) -> float:
        """FlashAttention convention: fwd = 4*B*H*Nq*Nk*D, halved for causal; bwd = 2.5x fwd.
        A window counts the keys a query sees (causal included), a block mask its density."""
        keys = self.window or (self.seqlen_k / 2 if self.causal else self.seqlen_k)
        f = 4.0 * self.batch * self.heads * self.seqlen_q * keys * self.head_dim
        if self.block_density:
            f *= self.block_density
        from .families import get
        return f * get(self.family).flops_factor


def log2_bucket(n: int) -> int:
    """Nearest power of two on a log scale (>= 1): 1000, 1024 and 1400 share 1024; 1500 -> 2048.
    The boundary is the geometric midpoint 2**(k + 0.5), so a bucket holds the sizes whose
    tile counts are closest to its own."""
    n = max(1, int(n))
    lo = 1 << (n.bit_length() - 1)   # largest power of two <= n
    return lo if n * n < 2 * lo * lo else lo << 1  # n < lo*sqrt(2), in integers


def head_dim_bucket(d: int) -> int:
    """The padded head dim the kernel computes with (BLOCK_D = next power of two, >= 16): it sets
    the shared memory and registers of a tile, so head dims 80, 96 and 128 share one config."""
    return max(16, 1 << (max(1, int(d)) - 1).bit_length())


# Past this many query rows (batch*heads*seqlen_q) the launch grid is many waves deep on any
# GPU flashtune targets (2**18 rows / BLOCK_M 128 = 2048 programs = 15 waves on 132 SMs), so
# batch*heads stops mattering for the choice of tiles and is clamped. Arithmetic, not a
# measurement: revisit when the search has timed the standard grid.
_ROWS_SATURATE = 1 << 18


@dataclass(frozen=True)
class Bucket:
    family: str
    dtype: str
    head_dim: int     # padded to the kernel's BLOCK_D: 16, 32, 64, 128, 256
    causal: bool
    gqa: bool         # group > 1: K/V are shared between q heads (changes L2 reuse, not the code)
    seqlen_q: int     # nearest power of two (log scale)
    seqlen_k: int
    batch_heads: int  # batch*heads, nearest power of two, clamped where the grid saturates the
    #                   GPU (_ROWS_SATURATE): small grids leave SMs idle, large ones do not
    # masks beyond causal, "" for none (left out of the key then): "+"-joined "window<keys per
    # query, power of two>", "softcap", "block<kept blocks in 64ths, power of two>" -- a window
    # or a density changes which tiles win (mask_of below)
    mask: str = field(default="", metadata=OMIT_DEFAULT)

    @property
    def key(self) -> str:
        return stable_key(self)

    @classmethod
    def of(cls, p: Problem) -> "Bucket":
        """The bucket of `p` by its family's rule (flashtune/families/)."""
        from .families import get
        return get(p.family).bucket_of(p)

    def same_kernel_class(self, other: "Bucket") -> bool:
        """Whether a config tuned for `other` may serve `self`: the fields that decide which
        tiles fit (family, dtype, padded head dim) and the masking (causal, softcap) must agree;
        a record without a window or a block mask may serve a bucket with one (the mask
        rendered in: a window as wide as the keys, a block mask kept whole, is the dense
        problem), never the reverse."""
        if not (self.family == other.family and self.dtype == other.dtype
                and self.head_dim == other.head_dim and self.causal == other.causal):
            return False
        mine, theirs = _mask_parts(self.mask).keys(), _mask_parts(other.mask).keys()
        return theirs <= mine and mine - theirs <= _DENSE_EQUIVALENT.keys()

    def log_distance(self, other: "Bucket") -> float:
        """How far apart two buckets are: octaves of seqlen_q + seqlen_k + batch*heads, plus half
        an octave if one shares K/V heads and the other does not; a window's keys per query and
        a block mask's density add their octaves too (a record without that mask counts as all
        the keys a query sees, as every block kept: a 256-key window's record serves a
        1024-key window before the dense causal one does, a 4096-key window's after). inf if
        `other` cannot serve."""
        if not self.same_kernel_class(other):
            return math.inf
        d = sum(abs(math.log2(a) - math.log2(b)) for a, b in (
            (self.seqlen_q, other.seqlen_q), (self.seqlen_k, other.seqlen_k),
            (self.batch_heads, other.batch_heads)))
        if self.mask:
            a, b = _mask_parts(self.mask), _mask_parts(other.mask)
            for n in a:
                if not a[n]:  # softcap: no size
                    continue
                theirs = b[n] if n in b else _DENSE_EQUIVALENT[n](other)
                d += abs(math.log2(a[n]) - math.log2(theirs))
        return d + (0.5 if self.gqa != other.gqa else 0.0)


# a mask part's value for a record without that mask: a window of every key a query sees (half
# the keys when causal: DESIGN's FLOP convention, as Problem.window counts them), every one of
# the 64ths of blocks kept
_DENSE_EQUIVALENT = {
    "window": lambda b: max(1, b.seqlen_k // 2 if b.causal else b.seqlen_k),
    "block": lambda b: 64,
}


def mask_of(p: Problem) -> str:
    """Bucket.mask of a problem: its mask kinds, a window's keys per query and a block mask's
    density on a log scale."""
    parts = []
    if p.window:
        parts.append(f"window{log2_bucket(p.window)}")
    if p.softcap:
        parts.append("softcap")
    if p.block_density:
        parts.append(f"block{min(64, log2_bucket(round(p.block_density * 64)))}")
    return "+".join(parts)


def _mask_parts(mask: str) -> dict:
    """"window1024+softcap" -> {"window": 1024, "softcap": 0}."""
    out = {}
    for part in filter(None, mask.split("+")):
        name = part.rstrip("0123456789")
        out[name] = int(part[len(name):] or 0)
    return out


def dense_bucket(p: Problem) -> Bucket:
    """The dense families' bucket rule (fwd, bwd): seqlens on a log scale, batch*heads clamped
    where the grid saturates the GPU."""
    sq = log2_bucket(p.seqlen_q)
    bh = min(log2_bucket(p.batch * p.heads), max(1, _ROWS_SATURATE // sq))
    return Bucket(p.family, p.dtype, head_dim_bucket(p.head_dim), p.causal, p.group > 1,
                  sq, log2_bucket(p.seqlen_k), bh, mask_of(p))
