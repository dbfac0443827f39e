"""Forward benchmark on the standard grid: flashtune beside SDPA's flash and cuDNN backends.

    python bench/fwd_bench.py [--sweep] [--quick]

--sweep first times a small set of configs at N=4096 per (D, causal) -- the measurement behind
flashtune/defaults.py -- and benchmarks the best of it beside the built-in default.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch

sys.path.insert(0, __import__("os").path.dirname(__file__))
from common import Results, bench_ms, fwd_flops, sdpa_fn, standard_grid  # noqa: E402

import flashtune  # noqa: E402
from flashtune.codegen import Variant  # noqa: E402


def inputs(B, H, N, D, dtype=torch.bfloat16):
    return [torch.randn(B, H, N, D, dtype=dtype, device="cuda") for _ in range(3)]


def time_variant(variant, q, k, v, causal):
    with flashtune.force(variant):
        flashtune.attention(q, k, v, causal=causal)  # compile outside the timing
        return bench_ms(lambda: flashtune.attention(q, k, v, causal=causal))


def sweep_candidates(d):
    for bm, bn, w, s, loads in itertools.product((64, 128), (64, 128), (4, 8), (2, 3, 4),
                                                 ("pointer", "descriptor")):
        if d == 128 and bn == 128 and s == 4:
            continue  # over shared memory at D=128
        if bm == 64 and w == 8:
            continue
        yield Variant("fwd", block_m=bm, block_n=bn, num_warps=w, num_stages=s, loads=loads)


def _warm(job):
    """Compile one (variant, D, causal) in a worker process: fills Triton's on-disk cache."""
    name, d, causal = job
    cfg = dict(B=4, H=2048 // d, N=4096, D=d)
    q, k, v = inputs(cfg["B"], cfg["H"], cfg["N"], d)
    try:
        with flashtune.force(name):
            flashtune.attention(q, k, v, causal=causal)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001
        return f"{name} D={d} causal={causal}: {type(e).__name__}: {str(e)[:120]}"


def precompile(jobs, procs):
    import multiprocessing as mp
    with mp.get_context("spawn").Pool(procs) as pool:
        for err in pool.imap_unordered(_warm, jobs):
            if err:
                print("compile failed:", err)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    res = Results("fwd_bench")
    best = {}
    if args.sweep:
        precompile([(v.name, d, c) for d in (64, 128) for c in (False, True)
                    for v in sweep_candidates(d)], procs=12)
        for d in (64, 128):
            scores = {}
            for causal in (False, True):
                cfg = dict(B=4, H=2048 // d, N=4096, D=d)
                q, k, v = inputs(cfg["B"], cfg["H"], cfg["N"], d)
                for var in sweep_candidates(d):
                    try:
                        ms = time_variant(var, q, k, v, causal)
                    except Exception as e:  # noqa: BLE001 -- a failing config is a data point
                        res.write({"kind": "sweep", "variant": var.name, "D": d, "causal": causal,
                                   "error": f"{type(e).__name__}: {str(e)[:200]}"})
                        continue
                    tf = fwd_flops(**cfg, causal=causal) / ms / 1e9
                    scores.setdefault(var, []).append(tf)
                    res.write({"kind": "sweep", "variant": var.name, "D": d, "causal": causal,
                               "ms": ms, "tflops": tf})
            ranked = sorted(((min(s), v) for v, s in scores.items() if len(s) == 2),
                            key=lambda x: -x[0])
            best[d] = ranked[0][1]
            print(f"D={d}: best {best[d].name} (min over causal {ranked[0][0]:.0f} TFLOP/s); "
                  f"top5 {[(v.name, round(t)) for t, v in ranked[:5]]}")
    rows = []
    grid = list(standard_grid(seqlens=(1024, 4096, 16384) if args.quick else
                              (512, 1024, 2048, 4096, 8192, 16384)))
    for g in grid:
        q, k, v = inputs(g["B"], g["H"], g["N"], g["D"])
        fl = fwd_flops(**g)
        row = dict(g)
        with torch.no_grad():
            row["flashtune"] = fl / bench_ms(lambda: flashtune.attention(q, k, v, causal=g["causal"])) / 1e9
            if g["D"] in best:
                row["flashtune_sweep"] = fl / time_variant(best[g["D"]], q, k, v, g["causal"]) / 1e9
            for name in ("flash", "cudnn"):
                try:
                    row[name] = fl / bench_ms(sdpa_fn(name, q, k, v, g["causal"])) / 1e9
                except RuntimeError as e:
                    row[name] = None
                    print(f"{name} failed at {g}: {e}")
        res.write({"kind": "fwd", "dtype": "bfloat16", **row})
        rows.append(row)
        del q, k, v
    hdr = f"{'D':>4} {'causal':>6} {'N':>6} {'ours':>6} {'sweep':>6} {'flash':>6} {'cudnn':>6} {'vsFA2':>6}"
    print(hdr)
    for r in rows:
        f = lambda x: f"{x:6.0f}" if x else "     -"  # noqa: E731
        ours = max(r["flashtune"], r.get("flashtune_sweep") or 0)
        print(f"{r['D']:>4} {str(r['causal']):>6} {r['N']:>6} {f(r['flashtune'])} "
              f"{f(r.get('flashtune_sweep'))} {f(r['flash'])} {f(r['cudnn'])} "
              f"{ours / r['flash']:6.2f}" if r["flash"] else "")
    print("results:", res.path)


if __name__ == "__main__":
    main()
