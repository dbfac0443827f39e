"""Compile the bwd kernels of some variants for Hopper (sm_90) without a GPU: shared memory per
block and, with ptxas -v, registers and spills. Catches configs that cannot launch on an H100
before GPU time is spent on them.

    python3 bench/bwd_compile_check.py                      # the built-in defaults
    python3 bench/bwd_compile_check.py bwd-m64-n128-w8-s2-dq=atomic --head-dims 64 128
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # real JIT functions, not the interpreter's
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flashtune.codegen import Variant, load  # noqa: E402
from flashtune.defaults import default_variant  # noqa: E402
from flashtune.launch import block_d  # noqa: E402
from flashtune.launch_bwd import _pre_m  # noqa: E402

H100_SMEM = 232448
_PTR = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}
_F32_PTRS = {"LSE", "LSE2", "Delta", "R"}


def _ptxas_candidates() -> list[str]:
    # the PTX version Triton emits may be newer than one ptxas reads: try each until one does
    here = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    found = [str(here / n) for n in ("ptxas-blackwell", "ptxas") if (here / n).exists()]
    return found + ([shutil.which("ptxas")] if shutil.which("ptxas") else [])


def _ptxas_usage(ptx: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "k.ptx"
        p.write_text(ptx)
        for exe in _ptxas_candidates():
            r = subprocess.run([exe, "-arch=sm_90a", "-v", str(p), "-o", str(Path(d) / "k.o")],
                               capture_output=True, text=True)
            if r.returncode == 0:
                log = r.stdout + r.stderr
                m = re.search(r"Used (\d+) registers", log)
                s = re.search(r"(\d+) bytes spill stores", log)
                return {"regs": int(m.group(1)) if m else None,
                        "spill_bytes": int(s.group(1)) if s else None}
    return {}


def _compile(fn, constexprs: dict, dtype: str, num_warps: int, num_stages: int,
             dq_f32: bool = False) -> dict:
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name[0].isupper() and name not in ("H", "Nq", "Nk"):  # tensors: UPPER-case
            f32 = name in _F32_PTRS or (name == "DQ" and dq_f32)
            sig[name] = "*fp32" if f32 else _PTR[dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "sm_scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride"):  # row/head/batch strides of D >= 16 tensors
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    out = {"smem": k.metadata.shared, "fits": k.metadata.shared <= H100_SMEM}
    out.update(_ptxas_usage(k.asm["ptx"]))
    return out


def check(variant: Variant, head_dim: int, dtype: str, causal: bool = True,
          tails: bool = False) -> dict:
    """tails: the specialisation for ragged seqlens, GQA and head-dim padding (all masks on)."""
    mod = load(variant)
    bd = block_d(head_dim)
    common = dict(HEAD_DIM=head_dim, BLOCK_D=bd, IS_CAUSAL=causal, GROUP=4 if tails else 1,
                  EVEN_M=not tails, EVEN_N=not tails, PAD_D=bd != head_dim,
                  PRECISE=dtype == "float32",
                  DOT_PRECISION="ieee" if dtype == "float32" else "tf32")
    pre = {k: common[k] for k in ("HEAD_DIM", "BLOCK_D", "IS_CAUSAL", "GROUP", "PRECISE")}
    res = {"pre": _compile(mod.attn_bwd_preprocess,
                           dict(pre, PRE_M=_pre_m(bd, dtype == "float32"), PRE_N=32), dtype, 4, 1),
           "dkdv": _compile(mod.attn_bwd_dkdv,
                            dict(common, BLOCK_M=variant.block_m, BLOCK_N=variant.block_n,
                                 MASK_KEYS=tails and variant.dq == "atomic"),
                            dtype, variant.num_warps, variant.num_stages,
                            dq_f32=variant.dq == "atomic")}
    if variant.dq == "separate":
        res["dq"] = _compile(mod.attn_bwd_dq,
                             dict(common, BLOCK_M=variant.block_m2, BLOCK_N=variant.block_n2),
                             dtype, variant.num_warps2, variant.num_stages2)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="*", help="variant names (default: the built-in defaults)")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16"])
    ap.add_argument("--tails", action="store_true",
                    help="compile the masked specialisation (ragged seqlens, GQA) instead")
    args = ap.parse_args(argv)
    ok = True
    for dtype in args.dtypes:
        for d in args.head_dims:
            vs = ([Variant.parse(v) for v in args.variants] if args.variants else
                  [default_variant("bwd", d, dtype, dq=s) for s in ("atomic", "separate")])
            for v in vs:
                for kernel, r in check(v, d, dtype, tails=args.tails).items():
                    ok &= r["fits"] and not r.get("spill_bytes")
                    print(f"{dtype:9} D={d:<4} {v.name:58} {kernel:5} smem {r['smem']:>6} B "
                          f"{'fits' if r['fits'] else 'TOO BIG'}  regs {r.get('regs')}  "
                          f"spills {r.get('spill_bytes')} B")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
