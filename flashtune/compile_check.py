"""Compile a variant's kernels for a GPU target without a GPU (codegen.aot) with the constexprs
the launchers would pass: shared memory, registers and spills per kernel, before any GPU time.

Runs the real JIT, so it must run in a process that did not import Triton in interpreter mode
(`flashtune kernels check` is such a process)."""
from __future__ import annotations

import torch

from .codegen import Variant, load
from .codegen.aot import compile_for
from .launch import FwdPlan, block_d

_TORCH_DTYPE = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _fwd(variant: Variant, head_dim: int, dtype: str, causal: bool, tails: bool, cap: int,
         usage: bool) -> dict:
    # the launcher's own constexprs, from meta tensors: no GPU, no data
    n, group = (1000, 4) if tails else (1024, 1)
    q = torch.empty(2, 8, n, head_dim, dtype=_TORCH_DTYPE[dtype], device="meta")
    k = torch.empty(2, 8 // group, n, head_dim, dtype=_TORCH_DTYPE[dtype], device="meta")
    plan = FwdPlan(q, k, k, causal, None, variant)
    consts = {n: v for n, v in plan.kwargs.items() if n not in ("num_warps", "num_stages")}
    return {"fwd": compile_for(plan.kernel, consts, dtype, variant.num_warps, variant.num_stages,
                               capability=cap, usage=usage)}


def _bwd(variant: Variant, head_dim: int, dtype: str, causal: bool, tails: bool, cap: int,
         usage: bool) -> dict:
    from .launch_bwd import _pre_m
    mod = load(variant)
    bd = block_d(head_dim)
    common = dict(HEAD_DIM=head_dim, BLOCK_D=bd, IS_CAUSAL=causal, GROUP=4 if tails else 1,
                  EVEN_M=not tails, EVEN_N=not tails, PAD_D=bd != head_dim,
                  PRECISE=dtype == "float32",
                  DOT_PRECISION="ieee" if dtype == "float32" else "tf32")
    pre = {k: common[k] for k in ("HEAD_DIM", "BLOCK_D", "IS_CAUSAL", "GROUP", "PRECISE")}
    res = {"pre": compile_for(mod.attn_bwd_preprocess,
                              dict(pre, PRE_M=_pre_m(bd, dtype == "float32"), PRE_N=32), dtype,
                              4, 1, capability=cap, usage=usage),
           "dkdv": compile_for(mod.attn_bwd_dkdv,
                               dict(common, BLOCK_M=variant.block_m, BLOCK_N=variant.block_n,
                                    MASK_KEYS=tails and variant.dq == "atomic"),
                               dtype, variant.num_warps, variant.num_stages, capability=cap,
                               usage=usage,
                               f32_ptrs=frozenset({"DQ"}) if variant.dq == "atomic" else frozenset())}
    if variant.dq == "separate":
        res["dq"] = compile_for(mod.attn_bwd_dq,
                                dict(common, BLOCK_M=variant.block_m2, BLOCK_N=variant.block_n2),
                                dtype, variant.num_warps2, variant.num_stages2, capability=cap,
                                usage=usage)
    return res


def check_variant(variant: Variant, head_dim: int, dtype: str, *, causal: bool = True,
                  tails: bool = False, capability: int = 90, usage: bool = True) -> dict:
    """{kernel: {"smem", "regs", "spill_bytes"}} for each kernel of the variant's family.
    tails: the specialisation for ragged seqlens, GQA and head-dim padding (all masks on)."""
    fn = {"fwd": _fwd, "bwd": _bwd}[variant.family]
    res = fn(variant, head_dim, dtype, causal, tails, capability, usage)
    return {k: {key: r[key] for key in ("smem", "regs", "spill_bytes") if key in r}
            for k, r in res.items()}
