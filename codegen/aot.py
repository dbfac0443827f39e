"""Compile a generated kernel for a GPU target without a GPU: Triton's wheel carries ptxas, so
shared memory per block (and, with ptxas -v, registers and spills) are known before any GPU
time is spent. Used by the compile tests in CI and by bench/bwd_compile_check.py."""
from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

_PTR = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}
_F32_PTRS = {"LSE", "LSE2", "Delta", "R"}   # float32 whatever the inputs' dtype
_I32_PTRS = {"CU_SEQLENS_Q", "CU_SEQLENS_K"}  # varlen renders' sequence offsets
_SCALARS_I32 = ("H", "Nq", "Nk")
# the mask arguments of masked variants (flashtune/masks.py, launch.mask_args): the block mask's
# int32 lists, int8 block states and uint8 element mask; the softcap a float; the element
# mask's strides may be 0 or 1 (broadcast, bool rows), so no divisibility is assumed for them
_MASK_TYPES = {"softcap": "fp32", "BM_NUM": "*i32", "BM_IDX": "*i32", "BM_FULL_NUM": "*i32",
               "BM_FULL_IDX": "*i32", "BM_STATE": "*i8", "EM": "*u8",
               # bwd dq="fused": the dQ programs' per-query-block key lists
               "BMQ_NUM": "*i32", "BMQ_IDX": "*i32", "BMQ_FULL_NUM": "*i32",
               "BMQ_FULL_IDX": "*i32"}
_NO_DIV = {"stride_emb", "stride_emh", "stride_emq", "stride_emk"}


def _ptxas_candidates() -> list[str]:
    import triton
    # the PTX version Triton emits may be newer than one ptxas reads: try each until one does
    here = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    found = [str(here / n) for n in ("ptxas-blackwell", "ptxas") if (here / n).exists()]
    return found + ([shutil.which("ptxas")] if shutil.which("ptxas") else [])


# ptxas's own performance notes that make a kernel slower than its source says: on sm_90 a
# wgmma whose accumulator registers are touched while it is in flight (kept live across a loop's
# back edge, say) makes ptxas serialize every wgmma of the function (C7512) or wait for it where
# the source does not (C7517). tile_overlap's S_0 carried across the tile loop did both and ran
# 24-47% slower on the H100 (session 21) although it compiled spill-free.
_SERIALIZED = re.compile(r"\((C75\d\d)\) (?:Potential Performance Loss: )?(wgmma[^\n]*?)"
                         r" (?:in|for) (?:the )?function")


def _wgmma_notes(log: str) -> list[str]:
    """ptxas's wgmma notes in `log`, one per kind ("C7517 wgmma.wait_group is injected ...")."""
    return sorted({code + " " + re.sub(r" in around line \d+", "", text)
                   for code, text in _SERIALIZED.findall(log)})


def ptxas_usage(ptx: str, arch: str = "sm_90a") -> dict:
    """Registers and spill bytes that ptxas -v reports, and its wgmma serialization notes
    ("wgmma": ["C7512 wgmma.mma_async instructions are serialized due to ...", ...], empty when
    none) ({} when no ptxas reads this PTX)."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "k.ptx"
        p.write_text(ptx)
        for exe in _ptxas_candidates():
            r = subprocess.run([exe, f"-arch={arch}", "-v", str(p), "-o", str(Path(d) / "k.o")],
                               capture_output=True, text=True)
            if r.returncode == 0:
                log = r.stdout + r.stderr
                m = re.search(r"Used (\d+) registers", log)
                s = re.search(r"(\d+) bytes spill stores", log)
                return {"regs": int(m.group(1)) if m else None,
                        "spill_bytes": int(s.group(1)) if s else None,
                        "wgmma": _wgmma_notes(log)}
    return {}


def _launch_fp_fusion() -> bool:
    """The FP fusion a launch of the kernel gets (the launchers leave it to Triton's knobs).
    Passing it explicitly compiles the same code and keeps Triton 3.9 from warning, once per
    process, that the unset TRITON_DEFAULT_FP_FUSION default will change in 3.10."""
    from triton import knobs
    lang = knobs.language
    return (getattr(lang, "default_fp_fusion", True)
            and not getattr(lang, "force_disable_fp_fusion", False))


def _source_class(fn):
    """Gluon kernels (explicit layouts: the Hopper family) compile from GluonASTSource, the rest
    from Triton's ASTSource; both take the same signature, constexprs and attributes."""
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource
        return GluonASTSource
    from triton.compiler import ASTSource
    return ASTSource


def tma_tile_type(dtype: str, rows: int, head_dim: int) -> str:
    """compile_for's type of a Gluon kernel's host-side TMA descriptor over (1, rows, head_dim)
    tiles of a "bfloat16" / "float16" tensor, in the NVMMA shared layout the launchers build."""
    from triton.experimental.gluon import language as gl
    gdt = {"bfloat16": gl.bfloat16, "float16": gl.float16}[dtype]
    short = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    lay = gl.NVMMASharedLayout.get_default_for([1, rows, head_dim], gdt)
    return f"tensordesc<{short}[1,{rows},{head_dim}],{lay!r}>"


def compile_for(fn, constexprs: dict, dtype: str, num_warps: int, num_stages: int, *,
                capability: int = 90, f32_ptrs: frozenset = frozenset(), usage: bool = False,
                types: dict | None = None) -> dict:
    """Compile a @triton.jit kernel of a generated module for compute capability `capability`.

    Arguments named in UPPER case are tensors (of `dtype`, or float32 for LSE-like buffers and
    `f32_ptrs`), `sm_scale` is a float, the rest int32 -- the generated templates' convention;
    `types` names the arguments that break it ({"SEQLENS": "*i32", "HK": "i32", ...}; a Gluon
    kernel's TMA descriptors as "tensordesc<bf16[1,128,128],NVMMASharedLayout(...)>").
    Returns {"smem": bytes, "ptx": text} (+ regs/spill_bytes with usage=True); raises what
    Triton raises (CompilationError, out of resources) for a config that cannot build."""
    import triton
    from triton.backends.compiler import GPUTarget

    sig, attrs = {}, {}
    types = {**_MASK_TYPES, **(types or {})}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in types:
            sig[name] = types[name]
            if types[name].startswith("*") or (name.startswith("stride")
                                                 and name not in _NO_DIV):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif name[0].isupper() and name not in _SCALARS_I32:
            sig[name] = ("*i32" if name in _I32_PTRS else
                         "*fp32" if name in _F32_PTRS | f32_ptrs else _PTR[dtype])
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "sm_scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride") and name not in _NO_DIV:  # of D >= 16 tensors
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = _source_class(fn)(fn, sig, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", capability, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages,
                                    enable_fp_fusion=_launch_fp_fusion()))
    out = {"smem": k.metadata.shared, "ptx": k.asm["ptx"]}
    if usage:
        out.update(ptxas_usage(k.asm["ptx"], f"sm_{capability}a" if capability == 90 else
                               f"sm_{capability}"))
    return out
