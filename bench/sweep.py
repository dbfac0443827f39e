"""Exhaustive sweep: time every feasible variant of a few buckets on the GPU present, and
record it for the replay backend (flashtune/replay.py) and the sampler comparison
(bench/compare_samplers.py).

    python3 bench/sweep.py                       # H100: 3 buckets, about 4 minutes
    python3 bench/sweep.py --budget 240 --bucket 64:1024:causal
    python3 bench/sweep.py --budget 540 --bucket bwd:128:4096:causal   # a backward bucket

Candidates compile in parallel (one process per spare core) while one timing worker gates
and times them (median of ~30 ms of runs, L2 flushed). Writes $OUT/sweep-<gpu>.jsonl (or
--out) line by line, so a sweep stopped by --budget keeps what it measured; a bucket that
did not finish is marked incomplete and the comparison skips it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, wait
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# [family:]head dim:seqlen:full|causal (family fwd when left out): the buckets the issue
# names, most useful first
BUCKETS = ["128:4096:full", "128:4096:causal", "64:2048:full", "64:1024:causal"]


def parse_bucket(spec: str) -> tuple[str, int, int, bool]:
    """"[fwd|bwd:]D:N:full|causal" -> (family, head dim, seqlen, causal)."""
    parts = spec.split(":")
    if len(parts) == 3:
        parts = ["fwd", *parts]
    if len(parts) != 4 or parts[3] not in ("full", "causal") or not (
            parts[1].isdigit() and parts[2].isdigit()):
        raise ValueError(f"--bucket {spec!r}: expected [family:]D:N:full|causal, "
                         "e.g. 128:4096:causal or bwd:128:4096:causal")
    return parts[0], int(parts[1]), int(parts[2]), parts[3] == "causal"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bucket", action="append", help="[fwd|bwd:]D:N:full|causal (repeat); "
                    "default: " + " ".join(BUCKETS[:3]))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds of sweeping in all")
    ap.add_argument("--bench-ms", type=float, default=30.0, help="timing budget per variant")
    ap.add_argument("--compile-workers", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    try:
        specs = [parse_bucket(b) for b in a.bucket or BUCKETS[:3]]
    except ValueError as e:
        ap.error(str(e))

    from flashtune import targets
    from flashtune.defaults import default_variant
    from flashtune.measure_gpu import GpuBackend
    from flashtune.pipeline import Pipeline
    from flashtune.problem import Bucket
    from flashtune.replay import bucket_line, trial_line
    from flashtune.search_plan import standard_problem
    from flashtune.search_space import Space
    from flashtune.search_study import bucket_label

    t0 = time.monotonic()
    target = targets.detect()
    if target is None:
        print("sweep.py needs a CUDA GPU", file=sys.stderr)
        return 2
    out_dir = Path(os.environ.get("OUT") or ".")
    out = Path(a.out) if a.out else out_dir / f"sweep-{target.short.lower()}.jsonl"
    backend = GpuBackend(smem_limit=target.smem_per_block, bench_ms=a.bench_ms,
                         flush_bytes=max(2 * target.l2_bytes, 256 << 20))
    cw = a.compile_workers or max(1, min(16, (os.cpu_count() or 2) - 1))
    pipe = Pipeline(backend, devices=(0,), compile_workers=cw, trial_timeout=60).start()
    info = pipe.info
    meta = {"kind": "meta", "gpu": target.short, **info, "bench_ms": a.bench_ms,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "note": "bench/sweep.py: every feasible variant, gate then median time"}
    summary = []
    with open(out, "w") as f:
        f.write(json.dumps(meta, sort_keys=True) + "\n")
        for fam, d, n, causal in specs:
            p = standard_problem(fam, a.dtype, d, causal, n)
            space = Space.build(fam, target, p)
            b = Bucket.of(p)
            variants = list(space.feasible)
            dv = default_variant(fam, p.head_dim, p.dtype)
            f.write(bucket_line(p, feasible=len(variants), space_hash=space.hash) + "\n")
            tb = time.monotonic()
            futs = {pipe.submit(v, p): v for v in variants}
            done_n, failed, best, default_ms = 0, 0, (None, float("inf")), None
            deadline = t0 + a.budget
            pending = set(futs)
            while pending and time.monotonic() < deadline:
                done, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                for fu in done:
                    v, o = futs[fu], fu.result()
                    f.write(trial_line(b, v.name, o, notes=o.notes) + "\n")
                    done_n += 1
                    failed += not o.ok
                    if o.ok and o.ms < best[1]:
                        best = (v.name, o.ms)
                    if v == dv and o.ok:
                        default_ms = o.ms
                f.flush()
            complete = not pending
            for fu in pending:
                fu.cancel()
            f.write(json.dumps({"kind": "bucket_end", "bucket": bucket_label(b),
                                "complete": complete, "measured": done_n}) + "\n")
            fl = p.flops()
            summary.append((bucket_label(b), len(variants), done_n, failed, best[0],
                            fl / best[1] / 1e9 if best[0] else 0.0,
                            fl / default_ms / 1e9 if default_ms else 0.0,
                            time.monotonic() - tb, complete))
            if not complete:
                break
    pipe.close(kill=True)
    print(f"\nsweep on {info.get('gpu_name')} (torch {info.get('torch')}, triton "
          f"{info.get('triton')}), {time.monotonic() - t0:.0f} s, {cw} compile workers -> {out}")
    print(f"{'bucket':<40} {'space':>5} {'meas.':>5} {'fail':>4} {'best':<36} {'TFLOP/s':>7} "
          f"{'default':>7} {'wall':>5}")
    for lab, nv, dn, fl_, bn, bt, dt, w, comp in summary:
        print(f"{lab:<40} {nv:>5} {dn:>5} {fl_:>4} {bn or '-':<36} {bt:7.1f} {dt:7.1f} "
              f"{w:4.0f}s{'' if comp else ' INCOMPLETE'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
