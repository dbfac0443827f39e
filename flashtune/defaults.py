"""Built-in default launch configs, used when no tuned table covers a problem.

Keyed by (head-dim class, dtype). The numbers quote the measurement that chose them.
"""
from __future__ import annotations

from .codegen import Variant

# Provisional: the first H100 measurement (bench/fwd_bench.py) replaces these.
_FWD = {
    64: Variant("fwd", block_m=128, block_n=64, num_warps=4, num_stages=3),
    128: Variant("fwd", block_m=128, block_n=64, num_warps=8, num_stages=3),
    256: Variant("fwd", block_m=64, block_n=32, num_warps=4, num_stages=2),
}
# float32 tiles are twice the bytes: halve BLOCK_N to stay inside shared memory
_FWD_F32 = {
    64: Variant("fwd", block_m=64, block_n=32, num_warps=4, num_stages=2),
    128: Variant("fwd", block_m=64, block_n=32, num_warps=4, num_stages=2),
    256: Variant("fwd", block_m=32, block_n=32, num_warps=4, num_stages=1),
}


def head_dim_class(d: int) -> int:
    return 64 if d <= 64 else 128 if d <= 128 else 256


def default_variant(family: str, head_dim: int, dtype: str) -> Variant:
    if family != "fwd":
        raise KeyError(f"no built-in default for kernel family {family!r}")
    table = _FWD_F32 if dtype == "float32" else _FWD
    return table[head_dim_class(head_dim)]
