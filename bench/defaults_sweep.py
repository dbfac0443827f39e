"""Compile candidate default variants for one GPU target without a GPU and report, per variant,
the worst registers / spills / shared memory over causal x non-causal x (tails) -- how the
per-architecture tables in flashtune/defaults.py were chosen.

    python3 bench/defaults_sweep.py --gpu A100 --head-dim 128 --dtype bf16 \\
        fwd-m128-n64-w8-s2 fwd-m128-n64-w8-s3 fwd-m64-n64-w4-s2
"""
from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # real JIT functions, not the interpreter's
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # what the launcher gets; no warning
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashtune import targets  # noqa: E402
from flashtune.codegen import Variant  # noqa: E402
from flashtune.problem import DTYPE_ALIASES  # noqa: E402


def _one(job):
    from flashtune.compile_check import check_variant
    name, d, dtype, causal, tails, cap = job
    try:
        return job, check_variant(Variant.parse(name), d, dtype, causal=causal, tails=tails,
                                  capability=cap)
    except Exception as e:  # noqa: BLE001 -- a config that cannot build is a result
        return job, {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--gpu", default="A100")
    ap.add_argument("--head-dim", type=int, required=True)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--no-tails", action="store_true", help="skip the tails specialisation")
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    args = ap.parse_args(argv)
    t = targets.get(args.gpu)
    cap = t.capability[0] * 10 + t.capability[1]
    dtype = DTYPE_ALIASES[args.dtype]
    modes = [(c, tl) for c in (True, False) for tl in ((False,) if args.no_tails else (False, True))]
    jobs = [(v, args.head_dim, dtype, c, tl, cap) for v in args.variants for c, tl in modes]
    worst: dict = {}
    with ProcessPoolExecutor(args.workers) as ex:
        for (v, *_), res in ex.map(_one, jobs):
            w = worst.setdefault(v, {})
            if "error" in res:
                w["error"] = res["error"]
                continue
            for k, r in res.items():
                o = w.setdefault(k, {"regs": 0, "spill_bytes": 0, "smem": 0})
                for key in o:
                    o[key] = max(o[key], r.get(key) or 0)
    print(f"{t.short} ({t.arch}) D={args.head_dim} {dtype}; worst over "
          f"{'causal/non-causal' + ('' if args.no_tails else ' x tails/no tails')}")
    for v, w in worst.items():
        if "error" in w:
            print(f"{v:56} ERROR {w['error']}")
            continue
        cells = "  ".join(f"{k}: {r['regs']}r {r['spill_bytes']}sp {r['smem'] // 1024}K"
                          for k, r in w.items())
        bad = any(r["spill_bytes"] or r["smem"] > t.smem_per_block for r in w.values())
        print(f"{v:56} {'BAD' if bad else 'ok '} {cells}")


if __name__ == "__main__":
    main()
