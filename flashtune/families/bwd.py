"""bwd: FlashAttention-2's backward (preprocess; dK/dV over key blocks with GQA summed in
registers; dQ by a separate deterministic kernel, float32 atomics, or the separate scheme's
query-block programs fused into the dK/dV launch). Template
attn_bwd.py.tmpl; launched by flashtune/launch_bwd.py; measured by flashtune/measure_bwd.py;
defaults in flashtune/defaults.py; resource model in flashtune/feasibility.py; space
search_spaces/bwd.json."""
from __future__ import annotations

from . import Family

FAMILY = Family(
    name="bwd",
    doc="FlashAttention-2 backward: dK/dV over key blocks, dQ separate, atomic or fused",
    template="attn_bwd.py.tmpl",
    kernels=("attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"),
    fields=("causal_split", "loads", "dq", "block_m2", "block_n2", "num_warps2", "num_stages2",
            "dq_loads", "varlen", "window", "softcap", "block_sparse"),
    rules=(("dq", ("separate", "atomic", "fused"),
            "bwd accumulates dQ 'separate', 'atomic' or 'fused'"),),
    defaults="flashtune.defaults:bwd_default",
    seeds="flashtune.defaults:bwd_seeds",
    measure="flashtune.measure_bwd:OPS",
    compile_check="flashtune.families.bwd:compile_check",
    feasibility="flashtune.feasibility:bwd_kernels_all",
    feasibility_version=1,
    flops_factor=2.5,
    varlen_plan="flashtune.launch_bwd:varlen_plan",
)


def compile_check(variant, head_dim: int, dtype: str, causal: bool, tails: bool, cap: int,
                  usage: bool) -> dict:
    """Compile every kernel the variant launches for `cap` without a GPU (tails: ragged
    seqlens and GQA, so every mask is compiled in)."""
    from ..codegen import load
    from ..codegen.aot import compile_for
    from ..launch_bwd import kernel_params
    from ..problem import torch_dtype
    mod = load(variant)
    n, group = (1000, 4) if tails else (1024, 1)
    params = kernel_params(variant, torch_dtype(dtype), head_dim, causal, group, n, n,
                           varlen=variant.varlen)
    from ..launch import example_masks
    extra = example_masks(variant, causal)
    params = {k: ({**c, **extra}, w, s) for k, (c, w, s) in params.items()}
    # dq="fused": "dkdv" is the one kernel of both (its dQ programs call attn_bwd_dq)
    fns = {"pre": "attn_bwd_preprocess", "dkdv": "attn_bwd_dkdv", "dq": "attn_bwd_dq"}
    dq_f32 = frozenset({"DQ"}) if variant.dq == "atomic" else frozenset()
    return {k: compile_for(getattr(mod, fns[k]), consts, dtype, warps, stages, capability=cap,
                           usage=usage, f32_ptrs=dq_f32 if k == "dkdv" else frozenset())
            for k, (consts, warps, stages) in params.items()}
