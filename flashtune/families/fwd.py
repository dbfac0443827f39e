"""fwd: FlashAttention-2's forward, split over queries (one program per BLOCK_M queries of one
(batch, head), looping over key blocks with the online softmax). Template attn_fwd.py.tmpl;
launched by flashtune/launch.py (FwdPlan); measured by flashtune/measure_fwd.py; defaults in
flashtune/defaults.py; resource model in flashtune/feasibility.py; space search_spaces/fwd.json."""
from __future__ import annotations

from . import Family

FAMILY = Family(
    name="fwd",
    doc="FlashAttention-2 forward, split over queries",
    template="attn_fwd.py.tmpl",
    kernels=("attn_fwd",),
    fields=("causal_split", "loads", "varlen", "window", "softcap", "block_sparse"),
    defaults="flashtune.defaults:fwd_default",
    measure="flashtune.measure_fwd:OPS",
    compile_check="flashtune.families.fwd:compile_check",
    feasibility="flashtune.feasibility:fwd_kernels",
    feasibility_version=2,
)


def compile_check(variant, head_dim: int, dtype: str, causal: bool, tails: bool, cap: int,
                  usage: bool) -> dict:
    """Compile for compute capability `cap` without a GPU, with the launcher's own constexprs
    (from meta tensors: no data). tails: ragged seqlens and GQA, so every mask is compiled in."""
    import torch

    from ..codegen import load
    from ..codegen.aot import compile_for
    from ..launch import FwdPlan, example_masks, fwd_params
    from ..problem import torch_dtype
    n, group = (1000, 4) if tails else (1024, 1)
    q = torch.empty(2, 8, n, head_dim, dtype=torch_dtype(dtype), device="meta")
    k = torch.empty(2, 8 // group, n, head_dim, dtype=torch_dtype(dtype), device="meta")
    if variant.varlen or variant.masks:  # what launch.VarlenFwdPlan passes, or a masked launch
        kwargs = fwd_params(variant, torch_dtype(dtype), head_dim, causal, group,
                            even_n=not variant.varlen and n % 128 == 0)
        kwargs.update(example_masks(variant, causal))
    else:
        kwargs = FwdPlan(q, k, k, causal, None, variant).kwargs
    consts = {n: v for n, v in kwargs.items() if n not in ("num_warps", "num_stages")}
    return {"fwd": compile_for(load(variant).attn_fwd, consts, dtype, variant.num_warps,
                               variant.num_stages, capability=cap, usage=usage)}
