"""Compile a variant's kernels for a GPU target without a GPU (codegen.aot) with the constexprs
the launchers would pass: shared memory, registers and spills per kernel, before any GPU time.

Runs the real JIT, so it must run in a process that did not import Triton in interpreter mode
(`flashtune kernels check` is such a process)."""
from __future__ import annotations

import torch

from .codegen import Variant, load
from .codegen.aot import compile_for
from .launch import FwdPlan, fwd_params
from .problem import torch_dtype



def _fwd(variant: Variant, head_dim: int, dtype: str, causal: bool, tails: bool, cap: int,
         usage: bool) -> dict:
    # the launcher's own constexprs, from meta tensors: no GPU, no data
    n, group = (1000, 4) if tails else (1024, 1)
    q = torch.empty(2, 8, n, head_dim, dtype=torch_dtype(dtype), device="meta")
    k = torch.empty(2, 8 // group, n, head_dim, dtype=torch_dtype(dtype), device="meta")
    if variant.varlen:  # what launch.forward_varlen passes
        kwargs = fwd_params(variant, torch_dtype(dtype), head_dim, causal, group, even_n=False)
    else:
        kwargs = FwdPlan(q, k, k, causal, None, variant).kwargs
    consts = {n: v for n, v in kwargs.items() if n not in ("num_warps", "num_stages")}
    return {"fwd": compile_for(load(variant).attn_fwd, consts, dtype, variant.num_warps,
                               variant.num_stages, capability=cap, usage=usage)}


def _bwd(variant: Variant, head_dim: int, dtype: str, causal: bool, tails: bool, cap: int,
         usage: bool) -> dict:
    from .launch_bwd import kernel_params
    mod = load(variant)
    # tails: ragged seqlens and GQA, so every mask is compiled in
    n, group = (1000, 4) if tails else (1024, 1)
    params = kernel_params(variant, torch_dtype(dtype), head_dim, causal, group, n, n,
                           varlen=variant.varlen)
    fns = {"pre": "attn_bwd_preprocess", "dkdv": "attn_bwd_dkdv", "dq": "attn_bwd_dq"}
    dq_f32 = frozenset({"DQ"}) if variant.dq == "atomic" else frozenset()
    return {k: compile_for(getattr(mod, fns[k]), consts, dtype, warps, stages, capability=cap, usage=usage,
                           f32_ptrs=dq_f32 if k == "dkdv" else frozenset())
            for k, (consts, warps, stages) in params.items()}


def check_variant(variant: Variant, head_dim: int, dtype: str, *, causal: bool = True,
                  tails: bool = False, capability: int = 90, usage: bool = True) -> dict:
    """{kernel: {"smem", "regs", "spill_bytes"}} for each kernel of the variant's family.
    tails: the specialisation for ragged seqlens, GQA and head-dim padding (all masks on)."""
    fn = {"fwd": _fwd, "bwd": _bwd}[variant.family]
    res = fn(variant, head_dim, dtype, causal, tails, capability, usage)
    return {k: {key: r[key] for key in ("smem", "regs", "spill_bytes") if key in r}
            for k, r in res.items()}
