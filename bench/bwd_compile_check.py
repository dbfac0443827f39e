"""Compile the bwd kernels of some variants for Hopper (sm_90) without a GPU: shared memory per
block and, with ptxas -v, registers and spills. Catches configs that cannot launch on an H100
before GPU time is spent on them.

    python3 bench/bwd_compile_check.py                      # the built-in defaults
    python3 bench/bwd_compile_check.py bwd-m64-n128-w8-s2-dq=atomic --head-dims 64 128
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # real JIT functions, not the interpreter's
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashtune.codegen import Variant  # noqa: E402
from flashtune.compile_check import check_variant  # noqa: E402
from flashtune.defaults import default_variant  # noqa: E402

H100_SMEM = 232448
def check(variant: Variant, head_dim: int, dtype: str, causal: bool = True,
          tails: bool = False) -> dict:
    res = check_variant(variant, head_dim, dtype, causal=causal, tails=tails)
    return {k: dict(r, fits=r["smem"] <= H100_SMEM) for k, r in res.items()}


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
                  [default_variant("bwd", d, dtype, dq=s, arch="sm_90")
                   for s in ("atomic", "separate")])
            for v in vs:
                for kernel, r in check(v, d, dtype, tails=args.tails).items():
                    ok &= r["fits"] and not r.get("spill_bytes")
                    print(f"{dtype:9} D={d:<4} {v.name:58} {kernel:5} smem {r['smem']:>6} B "
                          f"{'fits' if r['fits'] else 'TOO BIG'}  regs {r.get('regs')}  "
                          f"spills {r.get('spill_bytes')} B")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
