"""Where the Hopper kernels lose to cuDNN (issue 10): one call of each case under Nsight Compute,
flashtune as dispatched beside SDPA's cuDNN backend on the same inputs.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
        --section LaunchStats --section SchedulerStats --csv --page details \
        python3 bench/hopper_ncu.py > ncu.csv
    python3 bench/hopper_ncu.py --summary ncu.csv      # a table per kernel (no GPU needed)

Every case is run (and compiled) a few times before the profiled call, which alone lies between
cudaProfilerStart and cudaProfilerStop, so `--profile-from-start off` profiles exactly one
launch of each kernel of each case. Cases: the standard grid's worst buckets against cuDNN
(docs/benchmarks.md, sessions 10-11: forward D=256 causal N=512 at 0.69x, D=128 causal N=1k at
0.72x, the D=128 non-causal backward at 0.73-0.8x) and a good bucket for contrast (forward
D=128 non-causal 4k). B*N = 16k, hidden 2048, bf16, as the grid.
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (name, mode, D, causal, N): B = 16384 // N, H = 2048 // D
CASES = (("fwd-d256-causal-512", "fwd", 256, True, 512),
         ("fwd-d128-causal-1k", "fwd", 128, True, 1024),
         ("fwd-d128-4k", "fwd", 128, False, 4096),
         ("bwd-d128-2k", "bwd", 128, False, 2048))

# the metrics the summary prints, by their ncu names (the sections above)
METRICS = (("Duration", "us"), ("Compute (SM) Throughput", "%"), ("Memory Throughput", "%"),
           ("Registers Per Thread", ""), ("Achieved Occupancy", "%"),
           ("Issue Slots Busy", "%"), ("No Eligible", "%"), ("Warp Cycles Per Issued Instruction", ""))


def run_cases(names) -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import flashtune
    for name, mode, d, causal, n in CASES:
        if names and name not in names:
            continue
        b, h = 16384 // n, 2048 // d
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=mode == "bwd") for _ in range(3))
        do = torch.randn_like(q)

        def ours():
            return flashtune.attention(q, k, v, causal=causal)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return sdpa(q, k, v, is_causal=causal)
        for impl, fn in (("flashtune", ours), ("cudnn", cudnn)):
            if mode == "fwd":
                def step(fn=fn):
                    with torch.no_grad():
                        fn()
            else:
                out = {}

                def step(fn=fn, out=out):
                    o = fn()
                    out["g"] = torch.autograd.grad(o, (q, k, v), do)
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(f"{name}/{impl}")
            torch.cuda.cudart().cudaProfilerStart()
            step()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            torch.cuda.nvtx.range_pop()
            print(f"# profiled {name} {impl}", file=sys.stderr, flush=True)


def summary(path: str) -> None:
    """ncu's --csv --page details output -> one row per profiled kernel, METRICS as columns, and
    the warp stall reasons (WarpStateStats) above 5% of a warp's cycles."""
    lines = [ln for ln in open(path) if ln.startswith('"')]
    rows = list(csv.DictReader(lines))
    kernels: dict = {}
    order = []
    for r in rows:
        key = (r["ID"], r["Kernel Name"][:60])
        if key not in kernels:
            kernels[key] = {}
            order.append(key)
        kernels[key][r["Metric Name"]] = (r["Metric Value"], r["Metric Unit"])
    for key in order:
        m = kernels[key]
        got = ", ".join(f"{n} {m[n][0]}{m[n][1] if m[n][1] in ('%', 'us', 'ms') else ''}"
                        for n, _ in METRICS if n in m)
        print(f"{key[0]:>3} {key[1]}\n      {got}")
        stalls = sorted(((float(v[0].replace(",", "")), n) for n, v in m.items()
                         if n.startswith("Stall") or "stall" in n.lower()), reverse=True)
        if stalls:
            print("      stalls: " + ", ".join(f"{n} {x:g}" for x, n in stalls[:6]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--summary", default=None, help="summarise an ncu CSV instead of running")
    args = ap.parse_args(argv)
    if args.summary:
        summary(args.summary)
        return 0
    run_cases({c for c in args.cases.split(",") if c})
    return 0


if __name__ == "__main__":
    sys.exit(main())
