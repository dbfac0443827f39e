"""hopper_fwd: the forward for Hopper (sm_90) in Gluon -- TMA loads into a shared-memory ring on
mbarriers, async wgmma, a loader warp (warp specialization), FA3's QK^T-before-softmax overlap,
optional ping-pong consumers and a persistent grid. Template attn_hopper_fwd.py.tmpl (version
shims in flashtune/gluon_compat.py); launched by flashtune/launch_hopper.py (HopperFwdPlan);
measured by flashtune/measure_hopper.py; space search_spaces/hopper_fwd.json.

It serves forward calls (`serves=("fwd",)`), dense, causal, with a sliding window, softcap and/or
a block mask (`serve_masks`: its window/softcap/block_sparse renders), and competes with the
generic fwd family per bucket (dispatch._compete). Where it cannot run -- not sm_90, a Triton
without Gluon, Triton's interpreter, a head dim other than 64/128/256, float32 -- the dispatcher
keeps the generic family and `flashtune.explain` says why (`cannot_serve`, Family.mask_fields);
where its tiles cannot fit a block mask's block size (`fit_block_mask`), dispatch.mask_twin
runs the generic fwd default with the masks, and explain says why."""
from __future__ import annotations

from . import Family

FAMILY = Family(
    name="hopper_fwd",
    doc="Hopper forward in Gluon: TMA ring + mbarriers, async wgmma, loader warp, ping-pong",
    template="attn_hopper_fwd.py.tmpl",
    kernels=("attn_fwd_hopper",),
    fields=("pingpong", "three_consumers", "persistent", "loader_regs", "q_buffers", "l2_order",
            "head_order", "causal_split",
            "release_barrier", "early_rescale", "early_k_release", "async_o_store", "window",
            "softcap", "block_sparse", "bnhd"),
    defaults="flashtune.families.hopper_fwd:default",
    seeds="flashtune.families.hopper_fwd:seeds",
    measure="flashtune.measure_hopper:OPS",
    compile_check="flashtune.families.hopper_fwd:compile_check",
    feasibility="flashtune.families.hopper_fwd:resources",
    serves=("fwd",),
    serve_plan="flashtune.launch_hopper:HopperFwdPlan",
    serve_masks=("window", "softcap", "block_sparse"),
    fit_block_mask="flashtune.families.hopper_fwd:fit_block_mask",
    heuristic="flashtune.families.hopper_fwd:prefer_for_dense",
    support="flashtune.families.hopper_fwd:cannot_serve",
    interpreter=False,
    min_capability=90,
    max_capability=90,
    rules=(("num_warps", (4, 8), "a consumer partition is one or two warpgroups"),
           ("block_m", (64, 128), "64 query rows per consumer warpgroup (wgmma M), at most 2"),
           ("block_n", (32, 64, 128, 256), "the wgmma N of QK^T: 32..256"),
           ("num_stages", (2, 3, 4), "the K/V ring: 2..4 stages (a consumer holds block j-1's "
            "V stage while it waits for block j's K in the next one: one stage waits on itself)"),
           ("loader_regs", (0, 24, 32, 40, 48, 56),
            "setmaxnreg of the loader: 24..56, step 8; 0: no loader partition"),
           ("q_buffers", (1, 2), "Q tiles per consumer: 1, or 2 for the loader to run a tile "
            "ahead")),
    check="flashtune.families.hopper_fwd:check",
    winner_twins="flashtune.families.hopper_fwd:winner_twins",
)


def winner_twins(variant) -> list:
    """A table winner measured first with head_order as its causal tile order: in l2_order's
    place (session 24: the short causal D=128 records went 0.76/0.81x -> 0.96/0.97x cuDNN so,
    forced on the H100), or beside one with no order of its own (session 25: on 128-row tiles
    head_order moved cuDNN's DRAM bytes where every head's longest tile first moved 25% more;
    the D=64 causal 1k record, m128 with neither order, stayed at 0.88x cuDNN). A non-causal
    bucket's space holds no head_order, so there the search drops the twin. A 64-row, 4-warp
    ping-pong winner with a loader is also measured with a third consumer (persistent, two Q
    buffers, async_o_store, the loader at 32 registers: FA3's 192-row D=64 tile; on 128-key steps
    with causal_split, the render that compiles spill-free non-causal and spills least causal,
    28-76 B against the one-loop render's 228-352 B), which the space keeps at D=64 (session 32:
    the D=64 records predate that space; non-causal it ran 1.09-1.16x cuDNN)."""
    import dataclasses
    out = [] if variant.head_order else [
        dataclasses.replace(variant, l2_order=False, head_order=True)]
    if (variant.pingpong and not variant.three_consumers and variant.block_m == 64
            and variant.num_warps == 4 and variant.loader_regs):
        out.append(dataclasses.replace(
            variant, three_consumers=True, persistent=True, q_buffers=2, async_o_store=True,
            loader_regs=32, causal_split=variant.causal_split or variant.block_n > 64))
    return out


def consumers(variant) -> int:
    """Consumer partitions of a program, each with its own block_m rows of every tile."""
    return 3 if variant.three_consumers else 2 if variant.pingpong else 1


def check(variant) -> str:
    """Why `variant` is not a hopper_fwd variant beyond its fields' values ("" when it is): one
    causal tile order per kernel (the template's _tile_coords), so one kernel has one name; three
    consumers are ping-pong's turns going round three 4-warp, 64-row consumers beside a loader
    warp, in the dense render (their registers: 160 each next to the loader's warpgroup)."""
    if variant.l2_order and variant.head_order:
        return "l2_order and head_order are two causal tile orders: take one"
    if variant.three_consumers:
        if not variant.pingpong:
            return "three_consumers takes turns as ping-pong does: it needs pingpong"
        if variant.num_warps != 4 or variant.block_m != 64:
            return "three_consumers are one warpgroup of 64 rows each (num_warps 4, block_m 64)"
        if not variant.loader_regs:
            return "three_consumers needs a loader partition (loader_regs > 0)"
        if variant.masks:
            return "three_consumers has a dense render only (no window, softcap or block mask)"
    return ""

# Defaults: the fastest spill-free candidates measured on the H100 (bench/hopper_check.py, bf16,
# standard grid, torch 2.11, triton 3.6, 2026-11-23; docs/data/hopper_fwd_h100_2026-11-23.jsonl
# runs 3-4; TFLOP/s at N=512..16k non-causal / causal, geomean vs SDPA's cuDNN backend in the
# same run, non-causal / causal; docs/benchmarks.md has the table):
#   D=64:  ping-pong m64-n64-w4-s4      247-393 / 148-367  0.74x / 0.70x (the generic fwd is
#          faster here: 0.91x / 0.87x). m64-n128-w4-s3 was faster (0.85x / 0.73x) but spills
#          16 B causal; s2 0.65x / 0.55x.
#   D=128: ping-pong m64-n64-w4-s3, persistent  393-542 / 199-477  0.81x / 0.70x (not
#          persistent 0.79x / 0.70x, s4 0.79x / 0.70x, s2 0.65x / 0.60x; one consumer partition of
#          8 warps m128-n64-w8-s3 0.66x / 0.65x; generic fwd 0.74x / 0.75x)
#   D=256: ping-pong m64-n32-w4-s3      374-525 / 193-503  0.73x / 0.83x (generic fwd 0.35x / 0.40x)
# Spill-free matters. The 128-key steps at D=128 that spilled before were not held back by the
# 168-register entry cap (`ptxas -v`'s number; setmaxnreg lets the consumers' code use up to 240)
# but by P kept in float32 across the loop's back edge; with P converted to the PV operand right
# after the softmax and causal_split's unmasked loop, m64-n128 ping-pong (s2/s3, persistent or
# not) and m128-n128-w8-s2 compile spill-free at D=128, causal or not, and m64-n128-s3/s4
# ping-pong at D=64 (template header: registers per candidate); measured below.
# The window/softcap renders (window=true, softcap=true, both) compile for sm_90 without spills for
# every default above and for the no-loader m64-n128-s3 ping-pong / m128-n128-w8-s2 at D=64/128,
# causal or not, bf16 and fp16 (`flashtune kernels check`, triton 3.9, 2026-11-24: the loader
# schedules at the 168-register cap, no-loader ping-pong at 255, m128-n128-w8-s2 at 199-252);
# only the no-loader D=256 m64-n64-s2 spills (8 B, softcap causal).
# The block_sparse renders (128-blocks, element mask on and off) compile spill-free at the
# 168-register cap for the D=64/128 defaults, causal or not, bf16 and fp16, with window + softcap
# too, and for m128-n64-w8-s3 / m64-n32 at D=128; the no-loader 128-key steps spill 24 B (ping-pong
# m64-n128) / 32 B (m128-n128-w8) with an element mask, none without, which fit_block_mask's
# step limit avoids (`kernels check`, triton 3.9, 2026-11-23).
# D=64 and D=128: the 128-key ping-pong, 3 stages, measured best of the tiles set on the H100
# (STEPS=hopperfwdtiles, docs/data/hopper_fwd_tiles_h100_2026-11-23.jsonl, cuDNN in the same run):
# D=128 0.75-0.98x cuDNN non-causal (the 64-key persistent default before: 0.78-0.88x), causal
# 0.60-0.96x (0.61-0.85x); D=64 0.69-0.90x non-causal (m64-n64-s4: 0.64-0.79x), causal 0.56-0.91x
# (0.57-0.79x). D=256: the 32-key steps stay (the 64-key s2 within +-5%).
DEFAULTS = {
    64: dict(block_m=64, block_n=128, num_warps=4, num_stages=3, pingpong=True),
    128: dict(block_m=64, block_n=128, num_warps=4, num_stages=3, pingpong=True),
    # one 8-warp consumer, 64-key steps, two stages whose K goes back after S = Q K^T: spill-free
    # (bf16/fp16, causal or not, tails; `kernels check`) and faster in every cell of the D=256 grid
    # than the ping-pong m64-n32-s3 it replaced (0.81x cuDNN against 0.73x, H100, session 18,
    # docs/data/session18_h100_2026-11-26/hopper_krelease.jsonl; its forced GPU tests: session 20).
    # Its window/softcap renders are spill-free too; its block_sparse render spills (prefer_for_dense)
    256: dict(block_m=128, block_n=64, num_warps=8, num_stages=2, early_k_release=True),
}


def default(head_dim: int, dtype: str, *, arch=None):
    from ..codegen import Variant
    d = 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256
    return Variant("hopper_fwd", loader_regs=24, **DEFAULTS[d])


def seeds(head_dim: int, dtype: str, *, arch=None) -> list:
    """Measured first by a search beside the default: the default with early_k_release (at D=256
    the default has it), and at D=256 the two-stage 64-key ping-pong with it (with and without
    early_rescale). Forced on the
    H100 (session 18, cuDNN 1.0x) that ping-pong went 0.72x -> 0.91-0.92x with early_k_release,
    where the default ran 0.73x, a point the space's 40 TPE trials may not reach. At D=64 the
    64-key persistent ping-pong in head order (session 25, forced beside cuDNN, `hopper_check`):
    causal N=512 0.90x cuDNN, where the record (256-row tiles, longest first) ran 0.88x -- ncu
    read 25% more DRAM bytes than cuDNN there (L2 hit 21% against 46%). The seeds
    compile spill-free (as every default must: tests/test_compile_defaults.py): at D=256 without a
    loader partition and with causal_split off (the loader renders spill 4-20 B causal)."""
    import dataclasses

    from ..codegen import Variant
    base = default(head_dim, dtype, arch=arch)
    out = [] if base.early_k_release else [dataclasses.replace(base, early_k_release=True)]
    if head_dim > 128:  # spelled out, not derived from the default: it stays when that changes
        pp = Variant("hopper_fwd", block_m=64, block_n=64, num_warps=4, num_stages=2,
                     pingpong=True, causal_split=False, early_k_release=True)
        out += [pp, dataclasses.replace(pp, early_rescale=True)]
    elif head_dim <= 64:
        out.append(Variant("hopper_fwd", block_m=64, block_n=64, num_warps=4, num_stages=3,
                           pingpong=True, persistent=True, loader_regs=40, q_buffers=2,
                           causal_split=False, head_order=True, early_k_release=True,
                           async_o_store=True))
        # the same with a third consumer (FA3's 192-row tile at D=64), its loader at 32 (session
        # 30, forced beside cuDNN on the H100: causal 2k 402 TFLOP/s against the shipped record's
        # 372 and cuDNN's 397; non-causal 16k 463 against 488; causal 512 153 against 235), and
        # with l2_order in head_order's place (causal 1k: 310-314 against the record's 300-305
        # and cuDNN's 334, same run; a non-causal bucket times them as one point without the order:
        # search._first_points)
        trio = Variant("hopper_fwd", block_m=64, block_n=64, num_warps=4, num_stages=3,
                       pingpong=True, three_consumers=True, persistent=True, loader_regs=32,
                       q_buffers=2, causal_split=False, head_order=True, early_k_release=True,
                       async_o_store=True)
        out += [trio, dataclasses.replace(trio, head_order=False, l2_order=True)]
    return out


def cannot_serve(p) -> str:
    """Why the kernels cannot compute problem `p` ("" when they can): this Triton's Gluon, head
    dim and dtype. The GPU arch and the interpreter are Family.cannot_run's."""
    from ..gluon_compat import missing
    from ..launch_hopper import unsupported
    from ..problem import torch_dtype
    return missing() or unsupported(p.head_dim, torch_dtype(p.dtype))


def fit_block_mask(variant, block_mask) -> tuple:
    """(tile changes, "") fitting `variant` to a block mask's block size, or ({}, why) when its
    tiles cannot: a tile's query rows (both ping-pong consumers' BLOCK_M) walk one query block's
    lists, so they must lie in one (TILE_M | BS_Q, powers of two: TILE_M <= BS_Q); the key step
    divides BS_KV, and is at least 32 (the family's smallest wgmma N). With an element mask a
    step loads a [BLOCK_M, BLOCK_N] tile of it (a pointer per element): at most 32 elements per
    consumer thread, BLOCK_N <= 1024 * warps / BLOCK_M (sm_90, D=128 bf16, `kernels check`,
    triton 3.9, 2026-11-23: the no-loader m64-n128 ping-pong and m128-n128-w8 block_sparse
    renders spill 24 / 32 B with it, none without; every 64-key step is spill-free)."""
    bq, bk = block_mask.block_size
    rows = variant.block_m * consumers(variant)
    if rows > bq:
        who = (f"two ping-pong consumers of {variant.block_m}" if consumers(variant) == 2
               else "one consumer")
        return {}, (f"a tile's {rows} query rows ({who}) span more than one of the block mask's "
                    f"{bq}-row query blocks")
    if bk < 32:
        return {}, f"its key step is at least 32 keys, the block mask's key blocks are {bk}"
    block_n = min(variant.block_n, bk)
    if block_mask.mask is not None:
        block_n = max(32, min(block_n, 1024 * variant.num_warps // variant.block_m))
    return {"block_n": block_n}, ""


def prefer_for_dense(p) -> bool:
    """Until tuned records decide: hopper_fwd where it beat the generic fwd family on the H100's
    standard grid (run 3 of DEFAULTS' data: both timed in one run, plans built once): D=256
    (1.4-1.5x the generic kernel, causal or not; the defaults since, 2x) and D=128 without a causal
    mask (1.07x geomean: 363-548 vs 326-524 TFLOP/s). The generic kernel stays ahead at D=64 and
    at causal D=128 (0.92x: short causal tiles, where the per-tile prologue, the ping-pong's turns
    and the O epilogue cost more than they hide: 188-502 vs 197-508). Only the measured range:
    N >= 512 queries and keys (shorter calls, decoding, stay with fwd/splitkv).
    Since the 128-key default (STEPS=hopperdefaults, docs/data/hopper_defaults_h100_2026-11-23.jsonl,
    the generic fwd's default in the same run): D=128 non-causal 1.20-1.25x the generic kernel
    (390-634 vs 324-525 TFLOP/s), causal from 4k queries 1.13-1.21x (511-617 vs 449-510), causal
    below that 0.69-0.99x; D=64 still below it (0.80-1.00x non-causal).
    Block masks alone (no window or softcap) follow the dense rule: searched for both families
    at D=128 non-causal N=4k (`STEPS=masksearch`, H100, 2026-11-25, BH 64), hopper_fwd's block
    render ran 457 vs 394 TFLOP/s at 30% density and 598 vs 504 at 100%; at 16k a 50% mask on the
    generic kernel ran 0.6x the Hopper one (session 12). The bench's B=1 calls sit two octaves
    of BH from those records, too far for the records to compete (dispatch._same_shape), so this
    rule decides there. D=256 by extension, not timed with a block mask: the generic fwd runs
    D=256 at 0.35-0.40x cuDNN, hopper_fwd at 0.7-0.9x, and its block render (the default tile)
    spills 84-88 B (sm_90 compile, triton 3.9, bf16/fp16, causal or not; the m64-n32 ping-pong
    default before it 36-40 B, the same tile with 32-key steps 16 B; not timed). Windows and
    softcap: tuned records decide."""
    if p.seqlen_q < 512 or p.seqlen_k < 512 or cannot_serve(p):
        return False
    if set(p.mask_kinds) - {"block_sparse"}:
        return False  # windows and softcap: tuned records decide
    return p.head_dim == 256 or (p.head_dim == 128 and (not p.causal or p.seqlen_q >= 4096))


def smem_bytes(variant, head_dim: int, elem: int = 2) -> int:
    """Q tiles (q_buffers per consumer) + the K/V ring (+ 1 KB for barriers and alignment)."""
    return elem * head_dim * (consumers(variant) * variant.q_buffers * variant.block_m
                              + 2 * variant.num_stages * variant.block_n) + 1024


def resources(variant, problem, target) -> tuple:
    """(kernel, Resources) for the feasibility model. Shared memory from the tiles; registers per
    consumer thread from its accumulators (S in float32, P in the input dtype, O in float32)
    over the consumer threads only -- setmaxnreg hands the loader's share to them, so the cap
    the model applies (65536 / consumer threads, at most 255) is near the real one
    (launch_hopper.consumer_regs, 240 at most)."""
    from ..feasibility import Resources, dtype_bytes
    e = dtype_bytes(problem.dtype)
    threads = 32 * variant.num_warps * consumers(variant)
    per = 32 * variant.num_warps
    s = variant.block_m * variant.block_n
    words = s + s * e // 4 + variant.block_m * problem.head_dim
    return (("attn_fwd_hopper", Resources(smem_bytes(variant, problem.head_dim, e),
                                          -(-words // per) + 32, threads)),)


def compile_check(variant, head_dim: int, dtype: str, causal: bool, tails: bool, cap: int,
                  usage: bool) -> dict:
    """The kernel compiled for `cap` without a GPU, with the launcher's constexprs (tails: GQA 4;
    the causal/tail masks are run-time branches here, compiled in either way; a window/softcap
    variant's bounds and cap are run-time arguments too; a block_sparse one takes
    launch.example_masks' block sizes, at least a tile's rows, with an element mask). float32 has
    no kernel."""
    if dtype == "float32" or cap < 90:
        return {}
    from ..codegen import load
    from ..codegen.aot import compile_for, tma_tile_type
    from ..launch import example_masks
    from ..launch_hopper import consumer_regs

    def desc(rows):
        return tma_tile_type(dtype, rows, head_dim)
    types = {"q_desc": desc(variant.block_m), "o_desc": desc(variant.block_m),
             "k_desc": desc(variant.block_n), "v_desc": desc(variant.block_n), "n_tiles": "i32"}
    consts = dict(HEAD_DIM=head_dim, BLOCK_M=variant.block_m, BLOCK_N=variant.block_n,
                  STAGES=variant.num_stages, GROUP=4 if tails else 1, IS_CAUSAL=causal,
                  LOADER_REGS=variant.loader_regs, CONSUMER_REGS=consumer_regs(variant),
                  Q_BUFS=variant.q_buffers, num_warps=variant.num_warps)
    consts.update(example_masks(variant, causal))
    if variant.block_sparse:
        consts["BS_Q"] = max(consts["BS_Q"], variant.block_m * consumers(variant))
    return {"fwd": compile_for(load(variant).attn_fwd_hopper, consts, dtype, variant.num_warps,
                               1, capability=cap, usage=usage, types=types)}
