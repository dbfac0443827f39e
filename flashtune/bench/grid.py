"""What `flashtune bench` measures: one Case per problem, in sections (dense, decode, varlen,
masks, memory; bnhd on request), each with its work in the family's unit (flashtune/families).

Conventions (DESIGN.md): TFLOP/s counts 4*B*H*Nq*Nk*D per forward, halved for causal, 2.5x for
the backward (3.5x forward+backward); masked cases count the (query, key) pairs they keep.
Decoding is judged in GB/s of K and V read once.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from ..families import get as family
from ..problem import Problem

# the FlashAttention papers' grid: B*N = 16k tokens, hidden 2048 (H = 2048 / D)
TOKENS, HIDDEN = 16384, 2048
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128, 256)
MODES = ("fwd", "bwd", "fwd+bwd")
SECTIONS = ("dense", "decode", "varlen", "masks", "memory", "bnhd")
# what a run without --section covers: bnhd (the dense grid again, q, k, v in (B, N, H, D) memory)
# only when asked for
DEFAULT_SECTIONS = SECTIONS[:-1]
# forward FLOPs -> the mode's (the bwd family's flops_factor, plus the forward for fwd+bwd)
_MODE_FAMILY = {"fwd": "fwd", "bwd": "bwd", "fwd+bwd": "bwd"}


def mode_factor(mode: str) -> float:
    f = family(_MODE_FAMILY[mode]).flops_factor
    return f + 1.0 if mode == "fwd+bwd" else f


@dataclass(frozen=True)
class Case:
    section: str          # one of SECTIONS (bnhd: dense, q/k/v in (B, N, H, D) memory)
    mode: str             # "fwd" | "bwd" | "fwd+bwd"
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    dtype: str = "bfloat16"
    lengths: tuple = ()   # varlen: the sequences' lengths (self-attention), packed
    mask: str = ""        # masks: a MASKS key

    @property
    def unit(self) -> str:
        return "GB/s" if self.section == "decode" else "TFLOP/s"

    def work(self) -> float:
        """FLOPs (TFLOP/s) or bytes (GB/s) of one call, by the families' own rules."""
        if self.section == "decode":
            return family("splitkv").work_of(Problem("splitkv", self.dtype, self.head_dim,
                                                     self.causal, self.heads // self.kv_heads,
                                                     self.batch, self.heads, self.seqlen_q,
                                                     self.seqlen_k))
        pairs = self.pairs()
        return 4.0 * self.heads * self.head_dim * pairs * mode_factor(self.mode)

    def pairs(self) -> float:
        """(query, key) pairs computed, summed over the batch: N*N per sequence, half of it for
        causal (the convention, not the exact triangle), a mask's kept pairs."""
        if self.mask:
            return self.batch * MASKS[self.mask].kept(self)
        lens = self.lengths or (self.seqlen_q,) * self.batch
        keys = self.lengths or (self.seqlen_k,) * self.batch
        return sum(a * b for a, b in zip(lens, keys)) / (2 if self.causal else 1)

    @property
    def label(self) -> str:
        c = " causal" if self.causal else ""
        if self.section == "decode":
            return (f"decode B={self.batch} H={self.heads}/{self.kv_heads} Nk={self.seqlen_k} "
                    f"D={self.head_dim}")
        if self.section == "varlen":
            return (f"varlen {self.mode} {len(self.lengths)} seqs {sum(self.lengths)} tokens "
                    f"D={self.head_dim}{c}")
        if self.section == "masks":
            return f"mask {self.mask} {self.mode} N={self.seqlen_q} D={self.head_dim}{c}"
        return f"{self.section} {self.mode} D={self.head_dim} N={self.seqlen_q}{c}"

    def to_dict(self) -> dict:
        return {"section": self.section, "mode": self.mode, "batch": self.batch,
                "heads": self.heads, "kv_heads": self.kv_heads, "seqlen_q": self.seqlen_q,
                "seqlen_k": self.seqlen_k, "head_dim": self.head_dim, "causal": self.causal,
                "dtype": self.dtype, "lengths": list(self.lengths), "mask": self.mask,
                "unit": self.unit, "work": self.work()}


# -- masks: each is one entry; flashtune's side lights up when attention() takes the argument ---
WINDOW = 256          # keys each query sees: itself and the 255 before it (causal sliding window)
SOFTCAP = 30.0        # Gemma-2's attention logit softcap
MASK_BLOCK = 128      # block_mask: every query block sees its own and every 4th key block


@dataclass(frozen=True)
class Mask:
    argument: str     # the flashtune.attention keyword it needs (absent: not benchmarked)
    doc: str

    def kept(self, c: Case) -> float:
        """(query, key) pairs of one sequence the mask keeps."""
        raise NotImplementedError

    def flashtune_kwargs(self, c: Case) -> dict:
        raise NotImplementedError


@dataclass(frozen=True)
class WindowMask(Mask):
    left: int = WINDOW

    def kept(self, c):
        n, w = c.seqlen_q, self.left
        return max(0, n - w) * w + min(n, w) * (min(n, w) + 1) / 2

    def flashtune_kwargs(self, c):
        return {"window": (self.left - 1, 0)}  # flash_attn's window_size=(left, right)


@dataclass(frozen=True)
class SoftcapMask(Mask):
    cap: float = SOFTCAP

    def kept(self, c):
        return c.seqlen_q * c.seqlen_k / (2 if c.causal else 1)

    def flashtune_kwargs(self, c):
        return {"softcap": self.cap}


@dataclass(frozen=True)
class BlockSparseMask(Mask):
    block: int = MASK_BLOCK
    stride: int = 4

    def visible(self, qb, kb):
        """Ints or broadcasting tensors of block indices."""
        return (qb == kb) | (kb % self.stride == 0)

    def blocks(self, c):
        """bool (query blocks, key blocks): the blocks computed."""
        import torch
        qb = torch.arange(-(-c.seqlen_q // self.block))[:, None]
        kb = torch.arange(-(-c.seqlen_k // self.block))[None, :]
        return self.visible(qb, kb)

    def kept(self, c):
        b = self.block
        total = 0.0
        for qb in range(-(-c.seqlen_q // b)):
            rows = min(b, c.seqlen_q - qb * b)
            for kb in range(-(-c.seqlen_k // b)):
                if self.visible(qb, kb):
                    total += rows * min(b, c.seqlen_k - kb * b)
        return total

    def flashtune_kwargs(self, c):
        return {}  # the BlockMask is built on the case's device by the peer (peers.py)


MASKS = {
    "window": WindowMask("window", f"causal sliding window of {WINDOW} keys"),
    "softcap": SoftcapMask("softcap", f"causal, logits soft-capped at {SOFTCAP:g} (tanh)"),
    "block_mask": BlockSparseMask("block_mask", f"{MASK_BLOCK}-token blocks: each query block "
                                                "sees its own and every 4th key block"),
}


# -- the grids ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shapes:
    """What a run covers; `quick()` and `tiny()` are the smoke runs (GPU, CPU interpreter)."""
    head_dims: tuple = HEAD_DIMS
    seqlens: tuple = SEQLENS
    tokens: int = TOKENS
    hidden: int = HIDDEN
    modes: tuple = MODES
    causals: tuple = (False, True)
    decode_batches: tuple = (1, 8, 32, 64)
    decode_seqlens: tuple = (2048, 8192, 32768, 131072)
    decode_heads: tuple = ((32, 8), (8, 1))
    decode_dim: int = 128
    varlen_tokens: int = TOKENS
    varlen_lengths: tuple = (256, 4096)
    varlen_dim: int = 128
    mask_seqlens: tuple = (4096, 16384)
    mask_dim: int = 128
    memory_seqlens: tuple = (2048, 4096, 8192, 16384)
    memory_heads: int = 16
    memory_dim: int = 128

    @classmethod
    def quick(cls) -> "Shapes":
        return cls(head_dims=(64, 128), seqlens=(1024, 4096), decode_batches=(1, 32),
                   decode_seqlens=(8192, 65536), decode_heads=((32, 8),), varlen_tokens=4096,
                   varlen_lengths=(128, 1024), mask_seqlens=(4096,), memory_seqlens=(4096, 16384))

    @classmethod
    def tiny(cls) -> "Shapes":
        """Interpreter-sized (a CPU smoke run, seconds per kernel)."""
        return cls(head_dims=(16,), seqlens=(32, 64), tokens=64, hidden=32, modes=("fwd", "bwd"),
                   causals=(False, True), decode_batches=(2,), decode_seqlens=(64,),
                   decode_heads=((4, 2),), decode_dim=16, varlen_tokens=64,
                   varlen_lengths=(8, 40), varlen_dim=16, mask_seqlens=(64,), mask_dim=16,
                   memory_seqlens=(32,), memory_heads=2, memory_dim=16)


def dense(s: Shapes) -> list[Case]:
    return [Case("dense", m, max(1, s.tokens // n), s.hidden // d, s.hidden // d, n, n, d, c)
            for m in s.modes for d in s.head_dims for c in s.causals for n in s.seqlens]


def decode(s: Shapes) -> list[Case]:
    return [Case("decode", "fwd", b, h, hk, 1, n, s.decode_dim, False)
            for h, hk in s.decode_heads for b in s.decode_batches for n in s.decode_seqlens]


def draw_lengths(tokens: int, lo: int, hi: int, seed: int = 0) -> tuple:
    """Lengths uniform in [lo, hi] (seeded) summing to ~tokens (the last clipped, >= lo)."""
    rng = random.Random(seed)
    lens: list[int] = []
    while sum(lens) < tokens:
        lens.append(rng.randint(lo, hi))
    over = sum(lens) - tokens
    if lens[-1] - over >= lo:
        lens[-1] -= over
    return tuple(lens)


def varlen(s: Shapes) -> list[Case]:
    lens = draw_lengths(s.varlen_tokens, *s.varlen_lengths)
    h, n = s.hidden // s.varlen_dim, max(lens)
    return [Case("varlen", m, len(lens), h, h, n, n, s.varlen_dim, c, lengths=lens)
            for m in s.modes for c in s.causals]


def masks(s: Shapes) -> list[Case]:
    h = s.hidden // s.mask_dim
    out = []
    for name in MASKS:
        for n in s.mask_seqlens:
            causal = name != "block_mask"
            out += [Case("masks", m, max(1, s.tokens // n), h, h, n, n, s.mask_dim, causal,
                         mask=name) for m in s.modes]
    return out


def memory(s: Shapes) -> list[Case]:
    """Peak memory of forward+backward at one sequence, growing N: the math backend's N x N
    scores against the flash kernels' linear memory."""
    h = s.memory_heads
    return [Case("memory", "fwd+bwd", 1, h, h, n, n, s.memory_dim, False)
            for n in s.memory_seqlens]


def bnhd(s: Shapes) -> list[Case]:
    """The dense grid with q, k, v (and dO) in (B, N, H, D) memory, passed as (B, H, N, D) views:
    what a transformers model's projections hand attention."""
    return [dataclasses.replace(c, section="bnhd") for c in dense(s)]


BUILDERS = {"dense": dense, "decode": decode, "varlen": varlen, "masks": masks, "memory": memory,
            "bnhd": bnhd}


def cases(s: Shapes, sections=SECTIONS) -> list[Case]:
    return [c for name in sections for c in BUILDERS[name](s)]
