"""`Problem` (what one call needs) and `Bucket` (problems that share one tuned config)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ._keys import stable_key

DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class Problem:
    family: str      # kernel family: "fwd", "bwd"
    dtype: str       # "float16" | "bfloat16" | "float32"
    head_dim: int
    causal: bool
    group: int       # q heads per k/v head (1: MHA; heads: MQA)
    batch: int
    heads: int       # q heads
    seqlen_q: int
    seqlen_k: int

    @property
    def key(self) -> str:
        return stable_key(self)

    def flops(self) -> float:
        """FlashAttention convention: fwd = 4*B*H*Nq*Nk*D, halved for causal; bwd = 2.5x fwd."""
        f = 4.0 * self.batch * self.heads * self.seqlen_q * self.seqlen_k * self.head_dim
        if self.causal:
            f /= 2
        return f * (2.5 if self.family == "bwd" else 1.0)


def _log2_bucket(n: int) -> int:
    """Round up to a power of two (>= 1): seqlens 1000 and 1024 share one bucket."""
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


@dataclass(frozen=True)
class Bucket:
    family: str
    dtype: str
    head_dim: int
    causal: bool
    gqa: bool        # group > 1: K/V are shared between q heads (changes L2 reuse, not the code)
    seqlen_q: int    # power-of-two buckets
    seqlen_k: int
    batch_heads: int  # batch*heads, power-of-two buckets: small grids leave SMs idle

    @property
    def key(self) -> str:
        return stable_key(self)

    @classmethod
    def of(cls, p: Problem) -> "Bucket":
        return cls(p.family, p.dtype, p.head_dim, p.causal, p.group > 1,
                   _log2_bucket(p.seqlen_q), _log2_bucket(p.seqlen_k),
                   _log2_bucket(p.batch * p.heads))
