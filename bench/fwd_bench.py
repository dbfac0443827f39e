"""Forward benchmark with the defaults sweep: the measurement behind flashtune/defaults.py.

    python bench/fwd_bench.py [--sweep] [--quick]

--sweep first times a set of configs at N=4096 per (D, causal) and then benchmarks the best of
them (peer "flashtune-sweep") beside flashtune as dispatched and SDPA's flash and cuDNN on the
standard grid. Without --sweep this is `flashtune bench --section dense --mode fwd` (which
covers more peers; use it). Output: $OUT/fwd_bench.json (a `flashtune bench` result, plus the
sweep's rows; render with `flashtune bench --from`) and the tables on stdout.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch

import flashtune
from flashtune.bench import grid, report, runner
from flashtune.bench.peers import Flashtune, Forced, Sdpa
from flashtune.bench.timing import measure
from flashtune.codegen import Variant


def inputs(B, H, N, D, dtype=torch.bfloat16):
    return [torch.randn(B, H, N, D, dtype=dtype, device="cuda") for _ in range(3)]


def time_variant(variant, q, k, v, causal):
    with flashtune.force(variant), torch.no_grad():
        return measure(lambda: flashtune.attention(q, k, v, causal=causal), "cuda")[0]


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
    q, k, v = inputs(4, 2048 // d, 4096, d)
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


def sweep(dims, rows) -> dict:
    """{D: the config with the best worse-of-causal/non-causal TFLOP/s at N=4096}."""
    precompile([(v.name, d, c) for d in dims for c in (False, True)
                for v in sweep_candidates(d)], procs=12)
    best = {}
    for d in dims:
        scores = {}
        for causal in (False, True):
            case = grid.Case("dense", "fwd", 4, 2048 // d, 2048 // d, 4096, 4096, d, causal)
            q, k, v = inputs(4, 2048 // d, 4096, d)
            for var in sweep_candidates(d):
                row = {"variant": var.name, "D": d, "causal": causal}
                try:
                    ms = time_variant(var, q, k, v, causal)
                except Exception as e:  # noqa: BLE001 -- a failing config is a data point
                    rows.append({**row, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                    continue
                tf = case.work() / ms / 1e9
                scores.setdefault(var, []).append(tf)
                rows.append({**row, "ms": ms, "tflops": tf})
        ranked = sorted(((min(s), v) for v, s in scores.items() if len(s) == 2),
                        key=lambda x: -x[0])
        best[d] = ranked[0][1]
        print(f"D={d}: best {best[d].name} (min over causal {ranked[0][0]:.0f} TFLOP/s); "
              f"top5 {[(v.name, round(t)) for t, v in ranked[:5]]}")
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fwd_bench.py needs a CUDA GPU")
    out = Path(os.environ.get("OUT") or "bench_out")
    out.mkdir(parents=True, exist_ok=True)
    dims = (64, 128)
    sweep_rows = []
    peers = [Flashtune(True), Sdpa("flash"), Sdpa("cudnn")]
    if args.sweep:
        peers.insert(1, Forced("flashtune-sweep", sweep(dims, sweep_rows),
                               "the sweep's best config per head dim"))
    shapes = grid.Shapes(head_dims=dims, modes=("fwd",),
                         seqlens=(1024, 4096, 16384) if args.quick else grid.SEQLENS)
    doc = runner.run(shapes, ("dense",), peers, "cuda", checkpoint=out / "fwd_bench.json",
                     command="python bench/fwd_bench.py " + " ".join(sys.argv[1:]))
    doc["sweep"] = sweep_rows
    report.write_json(doc, out / "fwd_bench.json")
    print(report.markdown(doc, title="bench/fwd_bench.py"))
    print("results:", out / "fwd_bench.json")


if __name__ == "__main__":
    main()
