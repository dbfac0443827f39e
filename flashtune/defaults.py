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


# bwd: BLOCK_N keys per dK/dV program (large: K, V, dK, dV stay on chip), BLOCK_M query rows
# per inner step; block_m2/block_n2 the dQ kernel's (dq="separate") tiles. Provisional, chosen
# from what compiles for sm_90 (bench/bwd_compile_check.py, triton 3.9, bf16, causal) within
# shared memory and without register spills:
#   D=64  m32-n128-w8-s3: dK/dV 183 regs (atomic) / 142 (separate), 82 / 58 KB; dQ m128-n64-w8-s2
#         128 regs, 64 KB.  (w4 at n128 spills; m64-n128-w8 fits at 237-243 regs.)
#   D=128 m32-n128-w8-s2: 228 / 230 regs, 140 / 99 KB; dQ m128-n64-w8-s2 191 regs, 128 KB.
#         (m64-n128-w8 and every w4 config at n64+ spill.)
#   D=256 m16-n32-w4-s2: 254 / 244 regs, 64 / 49 KB (all w8 configs tried spill); dQ m64-n32-w8-s2
#         208 regs, 128 KB.
# bench/bwd_bench.py, NVIDIA H200, torch 2.11, triton 3.6, 2026-11-21 (standard grid, bf16;
# docs/data/bwd_bench_h200_2026-11-21_run3.json): with these tiles the separate dQ kernel beat the
# atomic scheme at every point, 1.07-1.35x (e.g. D=128 N=8192 non-causal 324 vs 240 TFLOP/s):
# float32 atomics on one dQ row from every key block serialise. So "separate" is the default,
# which also makes the backward deterministic by default.
def _bwd(m, n, w, s, m2, n2, w2, s2):
    return {"atomic": Variant("bwd", block_m=m, block_n=n, num_warps=w, num_stages=s, dq="atomic"),
            "separate": Variant("bwd", block_m=m, block_n=n, num_warps=w, num_stages=s,
                                dq="separate", block_m2=m2, block_n2=n2, num_warps2=w2,
                                num_stages2=s2)}


_BWD = {
    64: _bwd(32, 128, 8, 3, 128, 64, 8, 2),
    128: _bwd(32, 128, 8, 2, 128, 64, 8, 2),
    256: _bwd(16, 32, 4, 2, 64, 32, 8, 2),
}
# float32 tiles are twice the bytes (tests, mostly): smaller tiles, fewer stages
_BWD_F32 = {
    64: _bwd(32, 64, 4, 2, 64, 32, 4, 2),
    128: _bwd(32, 64, 8, 1, 64, 32, 8, 1),
    256: _bwd(16, 32, 4, 1, 32, 16, 4, 1),
}
# the scheme a bwd call gets by default (measured above); deterministic=True always gets "separate"
BWD_DQ_DEFAULT = "separate"


def head_dim_class(d: int) -> int:
    return 64 if d <= 64 else 128 if d <= 128 else 256


def default_variant(family: str, head_dim: int, dtype: str, *, dq: str | None = None) -> Variant:
    """Built-in default. bwd: `dq` picks the scheme ("atomic" | "separate"; None: default)."""
    if family == "fwd":
        table = _FWD_F32 if dtype == "float32" else _FWD
        return table[head_dim_class(head_dim)]
    if family == "bwd":
        table = _BWD_F32 if dtype == "float32" else _BWD
        return table[head_dim_class(head_dim)][dq or BWD_DQ_DEFAULT]
    from .families import get  # the other families keep their defaults in their own home
    return get(family).default(head_dim, dtype)
