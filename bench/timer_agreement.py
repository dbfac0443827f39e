"""Do the bench's timer and tuning_value's interleaved re-timing agree on a few forced variants?
(issue 12: tuning_value read hopper_fwd records of short non-causal D=128 buckets 0.79-0.90x the
hopper default where the bench through the dispatcher read them 1.07-1.09x the defaults.)

    python3 bench/timer_agreement.py --d 128 --n 1024 --causal 0 VARIANT [VARIANT ...]

Each variant's plan is built once (as the dispatcher memoizes it); then three passes of
timing.bench over the variants in turn (the bench's timer: warm-up, L2 flush, median), and one
timing.interleaved (tuning_value's: shuffled rounds of 5 flushed runs). Prints TFLOP/s per pass.
"""
from __future__ import annotations

import argparse
import json
import os

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--causal", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    from flashtune import timing
    from flashtune.codegen import Variant
    from flashtune.launch import FwdPlan
    from flashtune.launch_hopper import HopperFwdPlan
    b, h = 16384 // a.n, 2048 // a.d
    q, k, v = (torch.randn(b, h, a.n, a.d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    flops = 4.0 * b * h * a.n * a.n * a.d / (2 if a.causal else 1)
    fns = []
    for name in a.variants:
        var = Variant.parse(name)
        plan = (HopperFwdPlan if var.family == "hopper_fwd" else FwdPlan)(q, k, v, bool(a.causal),
                                                                           None, var)
        fns.append(lambda plan=plan: plan.run(q, k, v))
    rows = {n: {"bench": []} for n in a.variants}
    for _ in range(3):
        for n, fn in zip(a.variants, fns):
            ms, spread = timing.bench(fn)
            rows[n]["bench"].append(round(flops / ms / 1e9, 1))
    for n, (ms, spread) in zip(a.variants, timing.interleaved(fns, a.rounds)):
        rows[n]["interleaved"] = round(flops / ms / 1e9, 1)
        rows[n]["interleaved_spread"] = round(spread, 3)
    out = dict(D=a.d, N=a.n, causal=bool(a.causal), B=b, H=h, device=torch.cuda.get_device_name(),
               rows=rows)
    print(json.dumps(out, indent=1))
    path = os.path.join(os.environ.get("OUT", "."), "timer_agreement.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
