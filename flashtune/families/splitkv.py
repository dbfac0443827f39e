"""splitkv: Flash-Decoding over a KV cache. The keys of one (sequence, kv head) are split over
num_splits programs that write partial O and LSE in float32, merged exactly by a combine kernel;
the GROUP q heads of a kv head and the few query tokens of a step share one tile's rows, so each
K/V element is read once per group. Template attn_splitkv.py.tmpl; launched by
flashtune/launch_splitkv.py (SplitKVPlan, the auto num_splits rule, provisional defaults);
measured by flashtune/measure_splitkv.py; space search_spaces/splitkv.json. Judged in GB/s of
K and V read (DESIGN's decode convention). The `gluon` render (sm_90) is the partial kernel in
Gluon, a TMA ring and wgmma over a contiguous or paged cache (check, mask_changes,
launch_splitkv.gluon_blocker, kvcache.fit_pages say where it runs)."""
from __future__ import annotations

from . import Family

FAMILY = Family(
    name="splitkv",
    head_dims=(64, 128),
    doc="Flash-Decoding: keys split over programs, exact combine; GQA heads share tile rows",
    template="attn_splitkv.py.tmpl",
    kernels=("attn_splitkv_partial", "attn_splitkv_combine"),
    fields=("loads", "num_splits", "early_start", "paged", "window", "softcap", "block_sparse",
            "gluon"),
    check="flashtune.families.splitkv:check",
    mask_changes="flashtune.families.splitkv:mask_changes",
    defaults="flashtune.families.splitkv:default",
    measure="flashtune.measure_splitkv:OPS",
    compile_check="flashtune.families.splitkv:compile_check",
    feasibility="flashtune.feasibility:splitkv_kernels",
    feasibility_version=2,  # 2: the gluon render's model
    unit="GB/s",
    work="flashtune.families.splitkv:kv_bytes",
    bucket="flashtune.families.splitkv:bucket",
    grid="flashtune.families.splitkv:decode_grid",
    serves=("fwd",),
    serve_plan="flashtune.launch_splitkv:DensePlan",
    # a decode-shaped dense forward with masks (block masks: launch_splitkv.block_mask_blocker)
    serve_masks=("window", "softcap", "block_sparse"),
    serve_only=("block_sparse",),
    block_mask_blocker="flashtune.launch_splitkv:block_mask_blocker",
    heuristic="flashtune.families.splitkv:prefer_for_dense",
    adapt="flashtune.families.splitkv:adapt",
    seeds="flashtune.families.splitkv:seeds",
)


def check(variant) -> str:
    """The gluon render's limits (its kernel: one warpgroup's wgmma tile, its rows in M (block_m
    64) or in N (16, 32: swap_ab, the keys and D in M, so 64 or 128 keys a step), pointer-free
    TMA loads of a contiguous or paged cache)."""
    if not variant.gluon:
        return ""
    if variant.masks or variant.loads != "pointer":
        return "gluon renders no masks beyond causal, and its loads are TMA's: loads=pointer"
    if variant.num_warps != 4 or variant.block_m not in (16, 32, 64):
        return "gluon's tile is one warpgroup's (num_warps 4) of block_m 16, 32 or 64 rows"
    if variant.block_n not in (32, 64, 128) or not 2 <= variant.num_stages <= 4:
        return "gluon takes block_n 32, 64 or 128 and 2-4 stages"
    if variant.block_m < 64 and variant.block_n == 32:
        return "gluon's block_m 16/32 tile puts the keys in wgmma's 64-row M: block_n 64 or 128"
    return ""


def mask_changes(variant, kinds: tuple) -> dict:
    """A masked call runs the Triton render: the gluon one has no mask code."""
    return {"gluon": False} if variant.gluon and kinds else {}


def seeds(head_dim: int, dtype: str, *, arch=None) -> list:
    """Measured first in every splitkv study, after the default: the tiles the H100 decode sweep
    found best where the default trails cuDNN (docs/data/decode_sweep_h100_2026-11-23.jsonl:
    GQA B=64 8k-32k 3,086-3,113 GB/s with 32- and 64-key steps at 2 stages, against 2,900 for
    the default's 3 stages; 8 trials of TPE had not reached them). 16-row tiles: a decode step's
    rows (GROUP x Nq) are at most 16 on that grid, and the launch narrows wider tiles to that.
    Not the 64-key steps in float32: at D=128 they spill 32-44 B (sm_80 and sm_90, triton 3.9,
    tests/test_compile_defaults.py). On sm_90 the gluon render at 64 and 128 keys a step, 2
    stages (session 36: +4.5-11% over the dispatched variant on MQA B=1 32k-128k steps), and its
    16-row tile (swap_ab, session 45: MQA B=1 32k 2,037 GB/s and GQA B=1 32k 3,002 where the
    64-row one read 2,015 and 2,927); a bucket it cannot serve leaves it out (its space's
    `when`)."""
    from ..codegen import Variant
    base = default(head_dim, dtype, arch=arch)
    names = ("splitkv-m16-n32-w4-s2", "splitkv-m16-n32-w4-s3") + (
        () if dtype == "float32" else ("splitkv-m16-n64-w4-s2",))
    if arch == "sm_90" and dtype != "float32" and head_dim in (64, 128):
        names += ("splitkv-m64-n64-w4-s2-gluon=true", "splitkv-m64-n128-w4-s2-gluon=true",
                  "splitkv-m16-n128-w4-s2-gluon=true")
    return [Variant.parse(n) for n in names if Variant.parse(n) != base]


def adapt(variant, measured_on, asked):
    """A record serving another bucket keeps its tile and the parallelism it was tuned with, not
    its literal split count: the same programs in all (num_splits x the record's batch x kv
    heads) spread over the asked batch, and never fewer splits than the launch's one-wave rule
    gives there (then 0: that rule, exact at launch). Measured on the H100: a 2k-key record's 32
    splits ran at 0.56x cuDNN at 16k keys (the wave rule gives 132), and a record's 8 splits
    dropped to the rule's 2 ran its one-stage tile at 0.60x (B=8, GQA, 16k keys)."""
    if not variant.num_splits or (measured_on.seqlen_k, measured_on.batch_heads) == (
            asked.seqlen_k, asked.batch_heads):
        return variant, ""
    import dataclasses

    from ..launch_splitkv import auto_num_splits, row_block, sm_count
    scaled = max(1, round(variant.num_splits * measured_on.batch_heads / asked.batch_heads))
    tiles = -(-asked.seqlen_q // row_block(variant, asked.seqlen_q, 1))
    device = _device()
    wave = auto_num_splits(asked.batch_heads * tiles, asked.seqlen_k, variant.block_n,
                           sm_count(device))
    splits = scaled if scaled > wave else 0
    if splits == variant.num_splits:
        return variant, ""
    return (dataclasses.replace(variant, num_splits=splits),
            f"num_splits {variant.num_splits} -> {splits or '0 (auto)'}: tuned for another key "
            f"count or batch ({variant.num_splits} x {measured_on.batch_heads} programs there)")


def _device():
    import torch
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def prefer_for_dense(p) -> bool:
    """Until tuned records decide: a dense forward with a few query rows per kv head (decoding,
    speculative steps) goes to split-KV, whose tile holds the whole GQA group and whose splits
    fill the GPU; the split-Q kernel runs one program per (query block, q head) there.
    Provisional: set by the H100 decode measurement in docs/benchmarks.md."""
    return p.seqlen_q <= 16 and p.group * p.seqlen_q <= 64 and p.seqlen_k >= 4 * p.seqlen_q

# the decode grid (issue 9's benchmark grid): one query token, keys 2k..128k, batch 1..64,
# GQA 32 q / 8 kv heads and MQA 8 / 1
DECODE_SEQLENS = (2048, 8192, 32768, 131072)
DECODE_BATCHES = (1, 8, 32, 64)
DECODE_HEADS = ((32, 8), (8, 1))


def decode_grid(family, dtype: str, head_dim: int, causal: bool, seqlens=(), batches=()):
    from ..problem import Problem
    return [Problem(family, dtype, head_dim, causal, h // hk, b, h, 1, n)
            for h, hk in DECODE_HEADS for n in (seqlens or DECODE_SEQLENS)
            for b in (batches or DECODE_BATCHES)]


def default(head_dim: int, dtype: str, *, arch=None):
    from ..launch_splitkv import default_variant
    return default_variant(head_dim, dtype)


def kv_bytes(p) -> float:
    """K and V read once: 2 * B * Hk * Nk * D * element size."""
    from ..feasibility import dtype_bytes
    return 2.0 * p.batch * (p.heads // p.group) * p.seqlen_k * p.head_dim * dtype_bytes(p.dtype)


def bucket(p):
    """What decides the best split-KV config: the rows of one tile (GROUP q heads x Nq tokens),
    the keys per sequence, and the programs before splitting (batch x kv heads). They go into
    Bucket's seqlen_q, seqlen_k and batch_heads fields, on the same log scale."""
    from ..problem import Bucket, head_dim_bucket, log2_bucket, mask_of
    causal = p.causal and p.seqlen_q > 1  # one query token sees every key either way
    return Bucket(p.family, p.dtype, head_dim_bucket(p.head_dim), causal, p.group > 1,
                  log2_bucket(p.group * p.seqlen_q), log2_bucket(p.seqlen_k),
                  log2_bucket(p.batch * (p.heads // p.group)), mask_of(p))


def compile_check(variant, head_dim: int, dtype: str, causal: bool, tails: bool, cap: int,
                  usage: bool) -> dict:
    """Both kernels compiled for `cap` without a GPU, with the launcher's constexprs (tails: GQA
    4 and 3 query tokens, so the row masks are compiled in; a block_sparse render with
    launch.example_masks' block sizes and an element mask). The gluon render: sm_90, bf16/fp16,
    D 64/128 only (nothing elsewhere)."""
    if variant.gluon and (dtype == "float32" or cap != 90 or head_dim not in (64, 128)):
        return {}  # the gluon render has no kernel there (launch_splitkv.gluon_blocker)
    import dataclasses

    import torch

    from ..codegen import load
    from ..codegen.aot import compile_for
    from ..launch import block_d
    from ..launch_splitkv import SplitKVPlan, combine_tile, early_consts, gluon_rows
    from ..problem import torch_dtype
    dt = torch_dtype(dtype)
    nq, group = (3, 4) if tails else (1, 8)
    q = torch.empty(2, nq, 8, head_dim, dtype=dt, device="meta")
    k = torch.empty(2, 4096, 8 // group, head_dim, dtype=dt, device="meta")
    from ..launch import example_masks
    from ..masks import Masks
    # the plan of the render without the block mask gives the other constexprs
    plan = SplitKVPlan(q, k, causal, None, dataclasses.replace(variant, block_sparse=False),
                       Masks((64, 0) if variant.window else None, 30.0 if variant.softcap else None))
    consts = {n: v for n, v in plan.kwargs.items() if n not in ("num_warps", "num_stages")}
    consts.update(example_masks(variant, causal))
    consts["USE_PDL"] = cap >= 90  # as launched on that target
    if variant.early_start:
        consts.update(early_consts(consts["BLOCK_D"], dt.itemsize))
    mod = load(variant)
    # the partial kernel writes float32 scratch (O, LSE) when the keys are split
    ints = {"BLOCK_TABLE": "*i32", "SEQLENS": "*i32", "HK": "i32", "O": "*fp32"}
    if variant.gluon:  # its own arguments: K/V descriptors (launch_splitkv.GluonPartial)
        from ..codegen.aot import _PTR
        from ..launch_splitkv import _gluon_layout
        desc = (f"tensordesc<{_PTR[dtype][1:]}[{variant.block_n},{head_dim}],"
                f"{_gluon_layout(variant.block_n, head_dim, dt)!r}>")
        consts = {"GROUP": plan.kwargs["GROUP"], "STAGES": variant.num_stages,
                  "IS_CAUSAL": causal, "UNIFORM": False}
        if variant.paged:
            consts["PAGE"] = plan.kwargs["PAGE"]
        consts.update(gluon_rows(plan))
        if variant.early_start:  # the render that loads the ring's first tiles before its wait
            # and shares the rest (STEAL); one K / V half in flight at a time
            consts.update(PRELOAD=variant.num_stages, PACE=1, STEAL=True)
            ints["CNT"] = "*i32"
        ints.update(k_desc=desc, v_desc=desc)
    out = {"partial": compile_for(mod.attn_splitkv_partial, consts, dtype, variant.num_warps,
                                  variant.num_stages, capability=cap, usage=usage, types=ints)}
    block_s, chunk_d = combine_tile(64, block_d(head_dim))
    out["combine"] = compile_for(mod.attn_splitkv_combine,
                                 dict(HEAD_DIM=head_dim, BLOCK_S=block_s, CHUNK_D=chunk_d,
                                      USE_PDL=cap >= 90,
                                      **({"TRIGGER_FIRST": False} if variant.early_start
                                         else {})),
                                 dtype, 4, 3, capability=cap,
                                 usage=usage, types={"O_PART": "*fp32", "LSE_PART": "*fp32",
                                                     "H": "i32"})
    return out
