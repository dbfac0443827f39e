"""hopper_bwd: the backward for Hopper (sm_90) in Gluon -- K/V loaded once by TMA per key block,
Q and dO streamed through a shared-memory ring on mbarriers, S^T, dP^T, dV, dK and dQ on async
wgmma, dQ added into a float32 buffer by atomics (dq="separate": dK/dV only here, dQ by the
generic bwd's dQ kernel; dq="gluon": by the template's own Gluon dQ kernel, no atomics, on its
own tiles block_m2 / block_n2 / num_warps2 / num_stages2). Template attn_hopper_bwd.py.tmpl
(version shims in flashtune/gluon_compat.py); launched by flashtune/launch_hopper_bwd.py
(HopperBwdPlan); measured by flashtune/measure_hopper_bwd.py; space search_spaces/hopper_bwd.json.

It serves backward calls (`serves=("bwd",)`), dense, causal, with a sliding window, softcap and/or
a block mask (`serve_masks`: its window/softcap/block_sparse renders; tiles fitted to the block
mask's block size by `fit_block_mask`), but has no heuristic: the dispatcher picks it only when
forced (flashtune.force) or when tuned records of both families for the bucket say it is faster
(dispatch._compete). Where it cannot run -- not sm_90, a Triton without Gluon, Triton's
interpreter, a head dim other than 64/128/256, float32 -- the generic bwd family serves the call
and `flashtune.explain` says why (`cannot_serve`); deterministic calls keep its dq="gluon" and
"separate" variants and take the generic bwd for the atomic ones (ops.select_bwd); block-masked
calls run a dq="gluon" variant's dq="none" twin (`mask_changes`: the dQ kernel walks no block
mask; it renders a window and softcap)."""
from __future__ import annotations

from . import Family

FAMILY = Family(
    name="hopper_bwd",
    doc="Hopper backward in Gluon: K/V once by TMA, Q/dO ring on mbarriers, async wgmma, "
        "atomic dQ (or the generic dQ kernel: dq=separate, or its own Gluon dQ kernel: "
        "dq=gluon)",
    template="attn_hopper_bwd.py.tmpl",
    kernels=("attn_bwd_hopper",),
    fields=("dq", "dq_overlap", "window", "softcap", "block_sparse", "block_m2", "block_n2",
            "num_warps2", "num_stages2", "varlen"),
    defaults="flashtune.families.hopper_bwd:default",
    measure="flashtune.measure_hopper_bwd:OPS",
    compile_check="flashtune.families.hopper_bwd:compile_check",
    feasibility="flashtune.families.hopper_bwd:resources",
    flops_factor=2.5,
    serves=("bwd",),
    serve_plan="flashtune.launch_hopper_bwd:HopperBwdPlan",
    serve_masks=("window", "softcap", "block_sparse"),
    fit_block_mask="flashtune.families.hopper_bwd:fit_block_mask",
    mask_changes="flashtune.families.hopper_bwd:mask_changes",
    support="flashtune.families.hopper_bwd:cannot_serve",
    grid="flashtune.families.hopper_bwd:grid",
    varlen_plan="flashtune.launch_hopper_bwd:varlen_plan",
    interpreter=False,
    min_capability=90,
    max_capability=90,
    rules=(("num_warps", (4, 8), "one or two warpgroups"),
           ("block_m", (64, 128), "query rows per step: dQ's wgmma takes 64 rows per warpgroup"),
           ("block_n", (64, 128), "keys per program: 64 per warpgroup on the wgmma M axis"),
           ("num_stages", (1, 2, 3, 4), "the Q/dO ring: 1..4 stages"),
           ("dq", ("none", "separate", "gluon"), "dQ by atomics from this kernel (none), by the "
            "generic bwd family's dQ kernel (separate) or by the template's Gluon dQ kernel "
            "(gluon)"),
           ("block_m2", (0, 64, 128), "dq='gluon''s query rows per program (0: block_m)"),
           ("block_n2", (0, 64, 128), "dq='gluon''s keys per step (0: block_n; 32 does not "
            "compile)"),
           ("num_warps2", (0, 4, 8), "dq='gluon''s warps (0: num_warps)"),
           ("num_stages2", (0, 1, 2, 3, 4), "dq='gluon''s K/V ring (0: num_stages)")),
    check="flashtune.families.hopper_bwd:check",
)

# Defaults: NOT measured yet (first GPU run pending: bench/device_run.sh STEPS=hopperbwd). They
# are FA3's tile shape for these head dims (128 keys per program, 64 query rows per step, two
# warpgroups) with a two-stage ring, chosen for a spill-free sm_90 compile (`flashtune kernels
# check`, triton 3.9: D=64 regs 190-220, 0 B spilled; D=128 regs 255, 0 B spilled without GQA,
# 32 B non-causal / 100 B causal with GQA 4); nothing picks them unless forced or tuned (the
# family has no heuristic).
DEFAULTS = {
    64: dict(block_m=64, block_n=128, num_warps=8, num_stages=2),
    128: dict(block_m=64, block_n=128, num_warps=8, num_stages=2),
    # D=256: the one tile whose dK / dV fit (two warpgroups on 64 keys, each with half of D); the
    # two-stage ring fills 200 KB of shared memory (s1: 136 KB). Not measured yet.
    256: dict(block_m=64, block_n=64, num_warps=8, num_stages=2),
}


def default(head_dim: int, dtype: str, *, arch=None):
    from ..codegen import Variant
    d = 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256
    return Variant("hopper_bwd", **DEFAULTS[d])


def fit_block_mask(variant, block_mask) -> tuple:
    """(tile changes, "") fitting `variant` to a block mask's block size, or ({}, why) when its
    tiles cannot: a program's BLOCK_N keys lie in one BS_KV key block and a step's BLOCK_M rows in
    one BS_Q query block (powers of two: the tile at most the block). Both are 64 or 128 (the
    wgmma shapes); where BLOCK_N drops to 64, two warpgroups would split 64 keys (32 rows each,
    below the wgmma's 64) below D=256, so one warpgroup takes them (m64-n64-w4). With an
    element mask a partial step loads a [BLOCK_N, BLOCK_M] tile of it, a pointer per element:
    BLOCK_M drops to keep that at 32 per thread (128 x 64 over 256 threads), never below 64."""
    bq, bk = block_mask.block_size
    block_m, block_n = min(variant.block_m, bq), min(variant.block_n, bk)
    if block_m < 64 or block_n < 64:
        return {}, (f"its tiles are at least 64 x 64 (wgmma), the block mask's blocks are "
                    f"{bq} x {bk}")
    tiles = {"block_m": block_m, "block_n": block_n}
    if block_mask.mask is not None:
        threads = 32 * variant.num_warps
        tiles["block_m"] = block_m = max(64, min(block_m, 32 * threads // block_n))
    if variant.num_warps == 8 and block_n == 64 and variant.block_n != 64:
        tiles["num_warps"] = 4  # an n128-w8 tile: D <= 128 (D=256's one tile is n64-w8 already)
    return tiles, ""


DQ_TILE_FIELDS = ("block_m2", "block_n2", "num_warps2", "num_stages2")


def check(variant) -> str:
    """Why `variant` is not a hopper_bwd variant beyond its fields' values ("" when it is): the
    dQ kernel's own tiles exist only beside that kernel (dq="gluon"), so one kernel has one name."""
    set_ = [f for f in DQ_TILE_FIELDS if getattr(variant, f)]
    if set_ and variant.dq != "gluon":
        return (f"{', '.join(set_)}: those fields tile dq='gluon''s dQ kernel, and this variant "
                f"has dq={variant.dq!r}")
    if variant.varlen:
        extra = [f for f in ("window", "softcap", "block_sparse", "dq_overlap")
                 if getattr(variant, f)]
        if extra:
            return (f"varlen: the packed-sequence render takes none of {', '.join(extra)} "
                    "(the dispatcher leaves such calls to the generic bwd)")
    return ""


def dq_tiles(variant) -> tuple:
    """(block_m, block_n, num_warps, num_stages) of dq="gluon"'s dQ kernel: its own fields
    (block_m2 query rows per program, block_n2 keys per step, num_warps2, num_stages2: the K/V
    ring), each 0 taking the dK/dV kernel's."""
    return (variant.block_m2 or variant.block_m, variant.block_n2 or variant.block_n,
            variant.num_warps2 or variant.num_warps, variant.num_stages2 or variant.num_stages)


def mask_changes(variant, kinds: tuple) -> dict:
    """A block-masked call's twin of a dq="gluon" variant adds dQ by atomics from the dK/dV
    kernel (dq="none", the plain schedule: dq_overlap's D=256 softcap render spills): the dQ
    kernel walks no block mask. A window / softcap keeps dq="gluon": its dQ kernel renders them
    (GPU-tested on the H100, session 24: tests/test_hopper_bwd_masks.py -k gluon_dq_kernel)."""
    if variant.dq != "gluon" or "block_sparse" not in kinds:
        return {}
    return {"dq": "none", "dq_overlap": False, **{f: 0 for f in DQ_TILE_FIELDS}}


def cannot_serve(p) -> str:
    """Why the kernel cannot compute problem `p` ("" when it can): this Triton's Gluon, head dim,
    dtype. The GPU arch and the interpreter are Family.cannot_run's."""
    from ..gluon_compat import missing
    from ..launch_hopper_bwd import unsupported
    from ..problem import torch_dtype
    return missing() or unsupported(p.head_dim, torch_dtype(p.dtype))


def grid(family: str, dtype: str, head_dim: int, causal: bool, seqlens=(), batches=()) -> list:
    """The standard grid, less what the kernel cannot compute (float32): a search would
    otherwise time the generic bwd the launcher falls back to under this family's name."""
    from ..search_plan import standard_grid
    return [p for p in standard_grid(family, dtype, head_dim, causal, seqlens, batches)
            if not cannot_serve(p)]


def smem_bytes(variant, head_dim: int, elem: int = 2) -> int:
    """K and V tiles, the Q/dO ring, dS^T, with dq_overlap at D=256 P^T (+ 1 KB for barriers and
    alignment)."""
    tiles_t = 2 if variant.dq_overlap and head_dim > 128 else 1
    return elem * (2 * variant.block_n * head_dim + 2 * variant.num_stages * variant.block_m
                   * head_dim + tiles_t * variant.block_n * variant.block_m) + 1024


def dq_smem_bytes(variant, head_dim: int, elem: int = 2) -> int:
    """dq="gluon"'s dQ kernel: Q and dO of its query block, the K/V ring, dS (+ 1 KB)."""
    bm, bn, _, stages = dq_tiles(variant)
    return elem * (2 * bm * head_dim + 2 * stages * bn * head_dim + bm * bn) + 1024


def resources(variant, problem, target) -> tuple:
    """(kernel, Resources) for the feasibility model: shared memory from the tiles; registers per
    thread from the float32 accumulators live together (dK, dV, S^T, dP^T, dQ; dq="gluon"'s dQ
    kernel: dQ, S, dP)."""
    from ..feasibility import Resources, dtype_bytes
    e = dtype_bytes(problem.dtype)
    threads = 32 * variant.num_warps
    d = problem.head_dim
    words = 2 * variant.block_n * d + 2 * variant.block_n * variant.block_m + variant.block_m * d
    out = (("attn_bwd_hopper", Resources(smem_bytes(variant, d, e), -(-words // threads) + 32,
                                         threads)),)
    if variant.dq == "gluon":
        bm, bn, warps, _ = dq_tiles(variant)
        words = bm * d + 2 * bm * bn
        out += (("attn_bwd_dq_hopper", Resources(dq_smem_bytes(variant, d, e),
                                                 -(-words // (32 * warps)) + 32, 32 * warps)),)
    return out


def compile_check(variant, head_dim: int, dtype: str, causal: bool, tails: bool, cap: int,
                  usage: bool) -> dict:
    """The kernel compiled for `cap` without a GPU, with the launcher's constexprs (tails: GQA 4;
    the causal/tail masks are run-time branches, compiled in either way; a window/softcap
    variant's bounds and cap are run-time arguments too; a block_sparse one takes
    launch.example_masks' block sizes, with an element mask). float32 and head dims other than
    64/128/256 have no kernel (the generic bwd serves them)."""
    from ..launch_hopper_bwd import HEAD_DIMS
    if dtype == "float32" or cap < 90 or head_dim not in HEAD_DIMS:
        return {}
    from ..codegen import load
    from ..codegen.aot import compile_for, tma_tile_type
    from ..launch import example_masks

    def desc(rows):
        return tma_tile_type(dtype, rows, head_dim)
    types = {"q_desc": desc(variant.block_m), "do_desc": desc(variant.block_m),
             "k_desc": desc(variant.block_n), "v_desc": desc(variant.block_n),
             "dk_desc": desc(variant.block_n), "dv_desc": desc(variant.block_n),
             "DQ": "*fp32", "LSE2": "*fp32", "Delta": "*fp32"}
    consts = dict(HEAD_DIM=head_dim, BLOCK_M=variant.block_m, BLOCK_N=variant.block_n,
                  STAGES=variant.num_stages, GROUP=4 if tails else 1, IS_CAUSAL=causal,
                  num_warps=variant.num_warps, **example_masks(variant, causal))
    out = {"bwd": compile_for(load(variant).attn_bwd_hopper, consts, dtype, variant.num_warps,
                              1, capability=cap, usage=usage, types=types)}
    if variant.dq == "gluon":  # the template's own dQ kernel, on its own tiles (dq_tiles)
        from ..launch_hopper_bwd import dq_kernel_consts
        bm, bn, warps, _ = dq_tiles(variant)
        dq_types = {"q_desc": desc(bm), "do_desc": desc(bm), "dq_desc": desc(bm),
                    "k_desc": desc(bn), "v_desc": desc(bn), "LSE2": "*fp32", "Delta": "*fp32"}
        out["dq"] = compile_for(load(variant).attn_bwd_dq_hopper,
                                dq_kernel_consts(variant, consts), dtype, warps, 1,
                                capability=cap, usage=usage, types=dq_types)
    return out
