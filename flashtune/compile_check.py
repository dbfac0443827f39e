"""Compile a variant's kernels for a GPU target without a GPU (codegen.aot) with the constexprs
the launchers would pass: shared memory, registers and spills per kernel, before any GPU time.

Runs the real JIT, so it must run in a process that did not import Triton in interpreter mode
(`flashtune kernels check` is such a process)."""
from __future__ import annotations



def check_variant(variant, head_dim: int, dtype: str, *, causal: bool = True,
                  tails: bool = False, capability: int = 90, usage: bool = True) -> dict:
    """{kernel: {"smem", "regs", "spill_bytes", "wgmma"}} for each kernel of the variant's family (its
    flashtune/families/ entry knows how the launcher calls them).
    tails: the specialisation for ragged seqlens, GQA and head-dim padding (all masks on)."""
    from .families import get
    res = get(variant.family).check_compile(variant, head_dim, dtype, causal, tails, capability,
                                            usage)
    return {k: {key: r[key] for key in ("smem", "regs", "spill_bytes", "wgmma") if key in r}
            for k, r in res.items()}
