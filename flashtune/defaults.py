"""Built-in default launch configs, used when no tuned table covers a problem.

Keyed by (architecture, head-dim class, dtype). Entries use only features their architecture
has (no descriptor loads before Hopper's TMA) and compile without register spills -- except
float32 at D=256, and the tails specialisation noted at the backward tables;
`flashtune kernels check --gpu A100|H100` re-checks that (tests/test_compile_defaults.py).
The numbers quote the measurement or compile report that chose them; compile reports come
from bench/defaults_sweep.py (worst over causal/non-causal; r = registers, sp = spill bytes,
K = shared memory).
"""
from __future__ import annotations

import dataclasses
import functools

from .codegen import Variant

SM90, SM80 = "sm_90", "sm_80"

# --- forward ---------------------------------------------------------------------------------
# sm_90: chosen by bench/fwd_bench.py --sweep (66 configs x causal/non-causal, bf16, B=4, N=4096,
# hidden 2048; ranked by the worse of causal and non-causal), NVIDIA H200, torch 2.11,
# triton 3.6, 2026-11-21 (docs/data/fwd_bench_h200_2026-11-21_run1.jsonl):
#   D=64:  m128-n64-w8-s4 -> 447 / 384 TFLOP/s (non-causal / causal); runner-up m128-n64-w8-s3 377
#   D=128: m128-n64-w4-s2 with tensor descriptors (TMA) -> 501 / 437; runner-up m128-n128-w8-s3
#          descriptor 502 / 432
# D=256 was not swept. m64-n32-w4-s2 (half the D=128 tile) spills 4 B non-causal in fp16;
# m64-n64-w8-s2, the largest 8-warp neighbour, compiles at 251r 0sp 160K (bf16 and fp16,
# causal and not; m64-n32-w8-s2 199r 96K), triton 3.9, sm_90, 2026-11-23.
# sm_80 (no TMA, so pointer loads; not measured on an A100 yet): the sm_90 tile where it compiles
# without spills, else the largest spill-free neighbour. Compile reports, bf16 (fp16 the same),
# triton 3.9, 2026-11-23:
#   D=64:  m128-n64-w8-s4 153r 0sp 64K.
#   D=128: m128-n64-w8-s3 227r 0sp 96K  (pointer m128-n64-w4-s2 spills 348 B, m64-n64-w4-s2 8 B;
#          the descriptor default lowered to plain loads spills 260 B).
#   D=256: m64-n32-w8-s2 184r 0sp 68K  (w4 spills 60 B; m128-n32-w8 144 B).
# <= 99 KB shared memory each, so sm_86/sm_89 (which get this table) launch them too.
_FWD = {
    SM90: {64: Variant("fwd", block_m=128, block_n=64, num_warps=8, num_stages=4),
           128: Variant("fwd", block_m=128, block_n=64, num_warps=4, num_stages=2,
                        loads="descriptor"),
           256: Variant("fwd", block_m=64, block_n=64, num_warps=8, num_stages=2)},
    SM80: {64: Variant("fwd", block_m=128, block_n=64, num_warps=8, num_stages=4),
           128: Variant("fwd", block_m=128, block_n=64, num_warps=8, num_stages=3),
           256: Variant("fwd", block_m=64, block_n=32, num_warps=8, num_stages=2)},
}
# float32 (tests, mostly; ieee dots, not tensor cores, so one table serves every arch): 8 warps
# over small tiles -- the former w4 tiles spilled 140-1936 B on both archs. triton 3.9,
# 2026-11-23, sm_80:
#   D=64:  m64-n32-w8-s2 244r 0sp 48K  (m32-n32-w4-s2 168r; w2 spills 20 B)
#   D=128: m32-n32-w8-s2 173r 0sp 72K  (w4 spills 24 B)
#   D=256: m32-n32-w8-s1 still spills 12 B (m16-n32-w4-s1 88 B); the fewest spills found.
_FWD_F32 = {
    64: Variant("fwd", block_m=64, block_n=32, num_warps=8, num_stages=2),
    128: Variant("fwd", block_m=32, block_n=32, num_warps=8, num_stages=2),
    256: Variant("fwd", block_m=32, block_n=32, num_warps=8, num_stages=1),
}

# --- backward --------------------------------------------------------------------------------
# bwd: BLOCK_N keys per dK/dV program (large: K, V, dK, dV stay on chip), BLOCK_M query rows
# per inner step; block_m2/block_n2 the dQ kernel's (dq="separate") tiles.
# sm_90: provisional, chosen from what compiles for sm_90 (bench/bwd_compile_check.py, triton 3.9,
# bf16, causal) within shared memory and without register spills:
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
# sm_80: sm_80's register allocation is tighter (the sm_90 D=128 tiles spill 28-92 B there, the
# D=256 atomic dK/dV 36 B), so the largest spill-free neighbours, triton 3.9, bf16, 2026-11-23:
#   D=64  the sm_90 tiles: dK/dV 252r (atomic) / 177r (separate) 0sp, 57 / 49K; dQ 187r 48K.
#   D=128 m32-n64-w8-s2: dK/dV 250r (atomic) / 204r 0sp, 64 / 52K; dQ m64-n64-w8-s2 159r 72K.
#         (m16-n128-w8-s2 fits at 254 / 234r but its separate dK/dV spills 12 B with tails;
#         every w4 config spills.)
#   D=256 m16-n32-w8-s2: dK/dV 202r (atomic) / 221r 0sp, 64 / 49K; dQ m64-n32-w8-s1 224r 96K
#         (the sm_90 dQ at 2 stages needs 100K: more than sm_86/89 have; w4 dK/dV spills 24-36 B).
# With the tails specialisation (ragged seqlens, GQA) the atomic dK/dV still spills at D >= 128
# on sm_80 (44-60 B; every tile tried) as do the sm_90 D >= 128 tiles (116-216 B): the
# separate (default) scheme is spill-free there on sm_80, not yet on sm_90.
def _bwd(m, n, w, s, m2, n2, w2, s2):
    return {"atomic": Variant("bwd", block_m=m, block_n=n, num_warps=w, num_stages=s, dq="atomic"),
            "separate": Variant("bwd", block_m=m, block_n=n, num_warps=w, num_stages=s,
                                dq="separate", block_m2=m2, block_n2=n2, num_warps2=w2,
                                num_stages2=s2)}


# sm_90, measured against FlexAttention's backward (compiled) in one run on the H100 (torch 2.11,
# triton 3.6, 2026-11-23, bench/bwd_cands_bench.py, docs/data/bwd_cands_h100_2026-11-23*.jsonl;
# backward only, bf16, dense N=1k/4k/16k causal or not, and N=16k with a 1024-key window):
#   D=128 the dK/dV kernel's own launch also runs the dQ programs (dq="fused", FlexAttention's
#         schedule) with m32-n128-w8-s3, dQ m128-n64: 0.92-1.01x Flex, 1.09-1.36x what ran before
#         (the separate m32-n128-w8-s2 default and the 2026-11-21 records: 0.69-0.92x Flex).
#         Spill-free (225 regs causal, triton 3.9). The m64-n128 fused tiles ran 0.99-1.06x Flex
#         but sit at 255 registers (28 B spilled, causal, triton 3.9): left to the search.
#   D=64  separate with m64-n128-w8-s3 and dQ m128-n64-w8-s3 (Flex's tiles): 1.10x Flex geomean,
#         1.11x the m32 default; the atomic scheme keeps the m32 tiles.
# D=128 fused, since 2026-11-25: those m64-n128 tiles with loads="descriptor" (Q and dO through
#   TMA) compile spill-free (252 registers causal, triton 3.9) and ran faster than the m32 fused
#   default in all 7 cells of the same bench (H100, docs/data/bwd_cands_h100_2026-11-25_tma.jsonl):
#   0.696-12.61 ms against 0.701-13.84, 1.01-1.12x; vs Flex 1.023x geomean (the old default 0.964x).
#   Its pointer twin (inputs TMA cannot address) is the 28 B spiller above. With the tails
#   specialisation (ragged lengths, GQA) it spills 60-100 B, the m32 default 136 B.
_BWD = {
    SM90: {64: {**_bwd(32, 128, 8, 3, 128, 64, 8, 2),
                "separate": _bwd(64, 128, 8, 3, 128, 64, 8, 3)["separate"]},
           128: {**_bwd(32, 128, 8, 2, 128, 64, 8, 2),
                 "fused": Variant("bwd", block_m=64, block_n=128, num_warps=8, num_stages=3,
                                  dq="fused", block_m2=128, block_n2=64, loads="descriptor")},
           256: _bwd(16, 32, 4, 2, 64, 32, 8, 2)},
    SM80: {64: _bwd(32, 128, 8, 3, 128, 64, 8, 2),
           128: _bwd(32, 64, 8, 2, 64, 64, 8, 2),
           256: _bwd(16, 32, 8, 2, 64, 32, 8, 1)},
}
# float32 (tests, mostly; one table for every arch, as for the forward): 8 warps over 16-row
# steps (the former tiles spilled 836-37620 B). triton 3.9, 2026-11-23, sm_80:
#   D=64  m16-n64-w8-s1: dK/dV 172r (atomic) / 169r 0sp, 92 / 76K; dQ m32-n32-w8-s1 166r 44K.
#   D=128 m16-n32-w8-s1: dK/dV 254r (atomic) / 192r 0sp, 100 / 84K; dQ m32-n16-w8-s1 168r 76K
#         (m32-n32 spills 312 B).
#   D=256 spills whatever the tile (the PRECISE preprocess alone needs 256K of shared memory,
#         more than any target has: flashtune/launch_bwd.py _pre_m); kept small.
_BWD_F32 = {
    64: _bwd(16, 64, 8, 1, 32, 32, 8, 1),
    128: _bwd(16, 32, 8, 1, 32, 16, 8, 1),
    256: _bwd(16, 32, 8, 1, 16, 32, 8, 1),
}
# the scheme a bwd call gets by default (measured above), per table and head dim where it is not
# "separate"; deterministic=True gets a deterministic one ("separate" or "fused")
BWD_DQ_DEFAULT = "separate"
_BWD_DQ = {(SM90, 128): "fused"}


def head_dim_class(d: int) -> int:
    return 64 if d <= 64 else 128 if d <= 128 else 256


def table_arch(arch: str) -> str:
    """The table that serves `arch` ("sm_90a" -> "sm_90"). Only Hopper gets the sm_90 table;
    every other arch gets sm_80's, the portable one: pointer loads and <= 99 KB of shared memory,
    which sm_86/sm_89 and the Blackwells (no table measured there yet) all run."""
    return SM90 if arch.startswith(SM90) else SM80


@functools.cache
def present_arch() -> str:
    """The arch of the GPU present, detected once. Without one (CPU, Triton's interpreter) the
    portable sm_80 table: it runs anywhere, and interpreted kernels have no registers to fit."""
    from . import targets
    try:
        t = targets.detect()
    except Exception:  # noqa: BLE001 -- a broken driver must not fail attention
        return SM80
    return t.arch if t else SM80


def default_variant(family: str, head_dim: int, dtype: str, *, dq: str | None = None,
                    arch: str | None = None) -> Variant:
    """Built-in default of any family for `arch` ("sm_80", "sm_90", ...; None: the GPU present),
    from the family's own defaults (its flashtune/families/ entry names them).
    bwd: `dq` picks the scheme ("atomic" | "separate"; None: default)."""
    from .families import get
    return get(family).default(head_dim, dtype, arch=arch, **({"dq": dq} if dq else {}))


def fwd_default(head_dim: int, dtype: str, *, arch: str | None = None) -> Variant:
    a = table_arch(arch or present_arch())
    return (_FWD_F32 if dtype == "float32" else _FWD[a])[head_dim_class(head_dim)]


def bwd_default(head_dim: int, dtype: str, *, arch: str | None = None,
                dq: str | None = None) -> Variant:
    a, d = table_arch(arch or present_arch()), head_dim_class(head_dim)
    table = _BWD_F32 if dtype == "float32" else _BWD[a]
    if dq is None:
        dq = BWD_DQ_DEFAULT if dtype == "float32" else _BWD_DQ.get((a, d), BWD_DQ_DEFAULT)
    return table[d][dq]


def bwd_seeds(head_dim: int, dtype: str, *, arch: str | None = None) -> list:
    """Every dQ scheme's default (the fused one where a table has it): a bwd search has them
    all in its study from the start. On sm_90 also the fused default with its dQ programs' K/V
    through descriptors (dq_loads): 40 TPE trials did not find it in the space it doubles, where
    forced it ran +2-10% on half of session 17's cells."""
    a = table_arch(arch or present_arch())
    table = _BWD_F32 if dtype == "float32" else _BWD[a]
    schemes = table[head_dim_class(head_dim)]
    seeds = [schemes[s] for s in ("separate", "atomic", "fused") if s in schemes]
    if a == "sm_90" and dtype != "float32" and "fused" in schemes:
        seeds.append(dataclasses.replace(schemes["fused"], dq_loads="descriptor"))
    return seeds
