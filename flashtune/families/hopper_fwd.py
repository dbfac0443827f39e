"""hopper_fwd: the forward for Hopper (sm_90) in Gluon -- TMA loads into a shared-memory ring on
mbarriers, async wgmma, a loader warp (warp specialization), FA3's QK^T-before-softmax overlap,
optional ping-pong consumers and a persistent grid. Template attn_hopper_fwd.py.tmpl (version
shims in flashtune/gluon_compat.py); launched by flashtune/launch_hopper.py (HopperFwdPlan);
measured by flashtune/measure_hopper.py; space search_spaces/hopper_fwd.json.

It serves dense forward calls (`serves=("fwd",)`) and competes with the generic fwd family per
bucket (dispatch._compete). Where it cannot run -- not sm_90, a Triton without Gluon, Triton's
interpreter, a head dim other than 64/128/256, float32 -- the dispatcher keeps the generic family
and `flashtune.explain` says why (`cannot_serve`)."""
from __future__ import annotations

from . import Family

FAMILY = Family(
    name="hopper_fwd",
    doc="Hopper forward in Gluon: TMA ring + mbarriers, async wgmma, loader warp, ping-pong",
    template="attn_hopper_fwd.py.tmpl",
    kernels=("attn_fwd_hopper",),
    fields=("pingpong", "persistent", "loader_regs"),
    defaults="flashtune.families.hopper_fwd:default",
    measure="flashtune.measure_hopper:OPS",
    compile_check="flashtune.families.hopper_fwd:compile_check",
    feasibility="flashtune.families.hopper_fwd:resources",
    serves=("fwd",),
    serve_plan="flashtune.launch_hopper:HopperFwdPlan",
    heuristic="flashtune.families.hopper_fwd:prefer_for_dense",
    support="flashtune.families.hopper_fwd:cannot_serve",
    interpreter=False,
    min_capability=90,
    max_capability=90,
    rules=(("num_warps", (4, 8), "a consumer partition is one or two warpgroups"),
           ("block_m", (64, 128), "64 query rows per consumer warpgroup (wgmma M), at most 2"),
           ("block_n", (32, 64, 128, 256), "the wgmma N of QK^T: 32..256"),
           ("num_stages", (1, 2, 3, 4), "the K/V ring: 1..4 stages"),
           ("loader_regs", (24, 32, 40, 48, 56), "setmaxnreg of the loader: 24..56, step 8")),
)

# Provisional defaults: the fastest spill-free candidates of the H100 runs (bench/hopper_check.py,
# docs/data/hopper_fwd_h100_2026-11-23_run*.jsonl). Spill-free matters: Triton gives ptxas a
# 168-register cap for the whole kernel (65536 / 384 threads: the consumers plus a loader warp
# group) and setmaxnreg does not lift it for register allocation, so 128-key steps spill at
# D >= 128 (the S of block j+1, P of block j and the O accumulator are live together).
DEFAULTS = {
    64: dict(block_m=128, block_n=64, num_warps=8, num_stages=2),
    128: dict(block_m=128, block_n=64, num_warps=8, num_stages=2),
    256: dict(block_m=128, block_n=32, num_warps=8, num_stages=2),
}


def default(head_dim: int, dtype: str, *, arch=None):
    from ..codegen import Variant
    d = 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256
    return Variant("hopper_fwd", loader_regs=24, **DEFAULTS[d])


def cannot_serve(p) -> str:
    """Why the kernels cannot compute problem `p` ("" when they can): this Triton's Gluon, head
    dim and dtype. The GPU arch and the interpreter are Family.cannot_run's."""
    from ..gluon_compat import missing
    from ..launch_hopper import unsupported
    from ..problem import torch_dtype
    return missing() or unsupported(p.head_dim, torch_dtype(p.dtype))


def prefer_for_dense(p) -> bool:
    """Until tuned records decide: see HEURISTIC below (set by the H100 measurement)."""
    return HEURISTIC(p)


def _heuristic(p) -> bool:
    return False


HEURISTIC = _heuristic


def smem_bytes(variant, head_dim: int, elem: int = 2) -> int:
    """Q tile(s) + the K/V ring (+ 1 KB for barriers and alignment)."""
    consumers = 2 if variant.pingpong else 1
    return elem * head_dim * (consumers * variant.block_m + 2 * variant.num_stages
                              * variant.block_n) + 1024


def resources(variant, problem, target) -> tuple:
    """(kernel, Resources) for the feasibility model. Shared memory from the tiles; registers per
    consumer thread from its accumulators (S in float32, P in the input dtype, O in float32)
    over the consumer threads only -- setmaxnreg hands the loader's share to them, so the cap
    the model applies (65536 / consumer threads, at most 255) is near the real one
    (launch_hopper.consumer_regs, 240 at most)."""
    from ..feasibility import Resources, dtype_bytes
    e = dtype_bytes(problem.dtype)
    threads = 32 * variant.num_warps * (2 if variant.pingpong else 1)
    per = 32 * variant.num_warps
    s = variant.block_m * variant.block_n
    words = s + s * e // 4 + variant.block_m * problem.head_dim
    return (("attn_fwd_hopper", Resources(smem_bytes(variant, problem.head_dim, e),
                                          -(-words // per) + 32, threads)),)


def compile_check(variant, head_dim: int, dtype: str, causal: bool, tails: bool, cap: int,
                  usage: bool) -> dict:
    """The kernel compiled for `cap` without a GPU, with the launcher's constexprs (tails: GQA 4;
    the masks are run-time branches here, compiled in either way). float32 has no kernel."""
    if dtype == "float32" or cap < 90:
        return {}
    from triton.experimental.gluon import language as gl

    from ..codegen import load
    from ..codegen.aot import compile_for
    from ..launch_hopper import consumer_regs
    gdt = {"bfloat16": gl.bfloat16, "float16": gl.float16}[dtype]
    short = {"bfloat16": "bf16", "float16": "fp16"}[dtype]

    def desc(rows):
        lay = gl.NVMMASharedLayout.get_default_for([1, rows, head_dim], gdt)
        return f"tensordesc<{short}[1,{rows},{head_dim}],{lay!r}>"
    types = {"q_desc": desc(variant.block_m), "o_desc": desc(variant.block_m),
             "k_desc": desc(variant.block_n), "v_desc": desc(variant.block_n), "n_tiles": "i32"}
    consts = dict(HEAD_DIM=head_dim, BLOCK_M=variant.block_m, BLOCK_N=variant.block_n,
                  STAGES=variant.num_stages, GROUP=4 if tails else 1, IS_CAUSAL=causal,
                  LOADER_REGS=variant.loader_regs, CONSUMER_REGS=consumer_regs(variant),
                  num_warps=variant.num_warps)
    return {"fwd": compile_for(load(variant).attn_fwd_hopper, consts, dtype, variant.num_warps,
                               1, capability=cap, usage=usage, types=types)}
