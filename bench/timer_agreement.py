"""Do the search's measurement and the bench's agree on a few forced variants? Each variant is
timed by the same timer (flashtune/timing.py: warm-up, L2 flushed before each run, median)
through the paths that have disagreed:

  plan         the variant's launch plan built once and run (fwd only; as the dispatcher
               memoizes it)
  search       its family's measuring ops (measure_fwd / measure_bwd: OPS.inputs, OPS.run), as
               a search's timing worker measures a trial
  api          flashtune.attention with the variant forced, as `flashtune bench` times flashtune
               (fwd under no_grad; bwd: torch.autograd.grad on one saved graph)
  interleaved  the search path again, in tuning_value's / the final pick's shuffled rounds

History (issue 12): session 15 found the search rebuilding Gluon plans on every timed run
(fixed); session 20 found the search timing bwd-m64-n64-w4-s2-dq=fused-mq64-nq64 (D=128
non-causal 4k/16k) at 431 TFLOP/s where the bench read 397-409, and fwd-m64-n64-w4-s3 (D=64
causal 8k) at 444 against 409-415, while the defaults agreed (docs/benchmarks.md, session 20).
Session 21: at 4k the record read ~6% lower on the API path in every pass, the default did not;
a forced variant's plan was then built on every call (its host time timed with the kernel),
which flashtune/ops.py now keeps like a dispatched one's: re-run to see what gap is left.
Three passes of each path in turn, with the GPU's SM clock and power read after each pass
(a sustained run clocks down: nvidia-smi).

    python3 bench/timer_agreement.py --mode bwd --d 128 --n 16384 --causal 0 VARIANT [VARIANT ...]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess

import torch

PATHS = ("plan", "search", "api")


def _clock() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                               "--format=csv,noheader", "-i", "0"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def _paths(mode: str, name: str, problem, seed: int = 0) -> dict:
    """path -> a no-argument callable running `name` on `problem` that way."""
    import flashtune
    from flashtune.codegen import Variant
    from flashtune.families import get
    var = Variant.parse(name)
    ops = get(var.family).ops
    p = dataclasses.replace(problem, family=var.family)
    tin = ops.inputs(p, seed + 1)
    out = {"search": lambda: ops.run(var, p, tin)}
    if mode == "fwd":
        q, k, v = tin
        plan = ops.plan(var, p, tin)
        out["plan"] = lambda: plan.run(q, k, v)

        def api():
            with torch.no_grad(), flashtune.force(name):
                return flashtune.attention(q, k, v, causal=p.causal)
        out["api"] = api
    else:
        q, k, v, _, _, do = tin
        xs = [t.detach().requires_grad_() for t in (q, k, v)]
        with flashtune.force(name):  # the forward of a forced bwd variant: dispatched
            o = flashtune.attention(*xs, causal=p.causal)

        def api():
            with flashtune.force(name):
                return torch.autograd.grad(o, xs, do, retain_graph=True)
        out["api"] = api
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--mode", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--causal", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--passes", type=int, default=3)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("timer_agreement: needs a CUDA GPU (it times kernels)")
    from flashtune import timing
    from flashtune.search_plan import standard_problem
    from flashtune.codegen import Variant
    fams = {Variant.parse(n).family for n in a.variants}
    want = {"fwd": ("fwd", "hopper_fwd"), "bwd": ("bwd", "hopper_bwd")}[a.mode]
    if not fams <= set(want):
        raise SystemExit(f"timer_agreement: --mode {a.mode} times {' or '.join(want)} variants, "
                         f"got {sorted(fams)}")
    problem = standard_problem(a.mode, "bfloat16", a.d, bool(a.causal), a.n)
    b, h = problem.batch, problem.heads
    flops = 4.0 * b * h * a.n * a.n * a.d / (2 if a.causal else 1) * (2.5 if a.mode == "bwd" else 1)
    fns = {n: _paths(a.mode, n, problem) for n in a.variants}
    rows = {n: {path: [] for path in fns[n]} for n in a.variants}
    clocks = []
    for _ in range(a.passes):
        for path in PATHS:
            for n in a.variants:
                if path in fns[n]:
                    ms, _ = timing.bench(fns[n][path])
                    rows[n][path].append(round(flops / ms / 1e9, 1))
            clocks.append(f"{path}: {_clock()}")
    for n, (ms, spread) in zip(a.variants, timing.interleaved(
            [fns[n]["search"] for n in a.variants], a.rounds)):
        rows[n]["interleaved"] = round(flops / ms / 1e9, 1)
        rows[n]["interleaved_spread"] = round(spread, 3)
    out = dict(mode=a.mode, D=a.d, N=a.n, causal=bool(a.causal), B=b, H=h,
               device=torch.cuda.get_device_name(), rows=rows, clocks_after_each_pass=clocks)
    print(json.dumps(out, indent=1))
    path = os.path.join(os.environ.get("OUT", "."), "timer_agreement.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
