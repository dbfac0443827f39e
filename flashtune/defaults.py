"""Built-in default launch configs, used when no tuned table covers a problem.

Keyed by (head-dim class, dtype). The numbers quote the measurement that chose them.
"""
from __future__ import annotations

from .codegen import Variant

# Chosen by bench/fwd_bench.py --sweep (66 configs x causal/non-causal, bf16, B=4, N=4096,
# hidden 2048; ranked by the worse of causal and non-causal), NVIDIA H200, torch 2.11, triton 3.6,
# 2026-11-21 (docs/data/fwd_bench_h200_2026-11-21_run1.jsonl):
#   D=64:  m128-n64-w8-s4 -> 447 / 384 TFLOP/s (non-causal / causal); runner-up m128-n64-w8-s3 377
#   D=128: m128-n64-w4-s2 with tensor descriptors (TMA) -> 501 / 437; runner-up m128-n128-w8-s3
#          descriptor 502 / 432
# D=256 was not swept: half the D=128 tile keeps Q + 2 K/V stages inside shared memory.
_FWD = {
    64: Variant("fwd", block_m=128, block_n=64, num_warps=8, num_stages=4),
    128: Variant("fwd", block_m=128, block_n=64, num_warps=4, num_stages=2, loads="descriptor"),
    256: Variant("fwd", block_m=64, block_n=32, num_warps=4, num_stages=2),
}
# float32 tiles are twice the bytes: halve BLOCK_N to stay inside shared memory
_FWD_F32 = {
    64: Variant("fwd", block_m=64, block_n=32, num_warps=4, num_stages=2),
    128: Variant("fwd", block_m=64, block_n=32, num_warps=4, num_stages=2),
    256: Variant("fwd", block_m=32, block_n=32, num_warps=4, num_stages=1),
}


# bwd: BLOCK_N keys per dK/dV program (large: K, V, dK, dV stay in registers), BLOCK_M query
# rows per inner step; block_m2/block_n2 the dQ kernel's (dq="separate") tiles.
# Provisional (checked to compile for sm_90 within shared memory and without register spills
# by ptxas): the first H100 run of bench/bwd_bench.py replaces these.
_BWD = {
    64: {"atomic": Variant("bwd", block_m=64, block_n=128, num_warps=8, num_stages=2,
                           dq="atomic"),
         "separate": Variant("bwd", block_m=64, block_n=128, num_warps=8, num_stages=2,
                             dq="separate", block_m2=128, block_n2=64, num_warps2=8,
                             num_stages2=2)},
    128: {"atomic": Variant("bwd", block_m=64, block_n=128, num_warps=8, num_stages=2,
                            dq="atomic"),
          "separate": Variant("bwd", block_m=64, block_n=128, num_warps=8, num_stages=2,
                              dq="separate", block_m2=128, block_n2=64, num_warps2=8,
                              num_stages2=2)},
    256: {"atomic": Variant("bwd", block_m=32, block_n=64, num_warps=8, num_stages=1,
                            dq="atomic"),
          "separate": Variant("bwd", block_m=32, block_n=64, num_warps=8, num_stages=1,
                              dq="separate", block_m2=64, block_n2=32, num_warps2=8,
                              num_stages2=1)},
}
_BWD_F32 = {
    64: {"atomic": Variant("bwd", block_m=32, block_n=64, num_warps=4, num_stages=1,
                           dq="atomic"),
         "separate": Variant("bwd", block_m=32, block_n=64, num_warps=4, num_stages=1,
                             dq="separate", block_m2=64, block_n2=32, num_warps2=4,
                             num_stages2=1)},
    128: {"atomic": Variant("bwd", block_m=32, block_n=64, num_warps=8, num_stages=1,
                            dq="atomic"),
          "separate": Variant("bwd", block_m=32, block_n=64, num_warps=8, num_stages=1,
                              dq="separate", block_m2=64, block_n2=32, num_warps2=8,
                              num_stages2=1)},
    256: {"atomic": Variant("bwd", block_m=16, block_n=32, num_warps=8, num_stages=1,
                            dq="atomic"),
          "separate": Variant("bwd", block_m=16, block_n=32, num_warps=8, num_stages=1,
                              dq="separate", block_m2=32, block_n2=16, num_warps2=8,
                              num_stages2=1)},
}
# the scheme a bwd call gets unless deterministic=True asks for "separate"
BWD_DQ_DEFAULT = "atomic"


def head_dim_class(d: int) -> int:
    return 64 if d <= 64 else 128 if d <= 128 else 256


def default_variant(family: str, head_dim: int, dtype: str, *, dq: str | None = None) -> Variant:
    """Built-in default. bwd: `dq` picks the scheme ("atomic" | "separate"; None: BWD_DQ_DEFAULT)."""
    if family == "fwd":
        table = _FWD_F32 if dtype == "float32" else _FWD
        return table[head_dim_class(head_dim)]
    if family == "bwd":
        table = _BWD_F32 if dtype == "float32" else _BWD
        return table[head_dim_class(head_dim)][dq or BWD_DQ_DEFAULT]
    raise KeyError(f"no built-in default for kernel family {family!r}")
