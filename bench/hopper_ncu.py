"""Where the Hopper kernels lose to cuDNN (issue 10): one call of each case under Nsight Compute,
flashtune as dispatched beside SDPA's cuDNN backend on the same inputs.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
        --section LaunchStats --section SchedulerStats --csv --page details \
        python3 bench/hopper_ncu.py > ncu.csv
    python3 bench/hopper_ncu.py --summary ncu.csv      # a table per kernel (no GPU needed)

Implementations: flashtune as dispatched, hopper_fwd forced to its own record (forward cases),
cuDNN. Every case is run (and compiled) a few times before the profiled call, which alone lies between
cudaProfilerStart and cudaProfilerStop, so `--profile-from-start off` profiles exactly one
launch of each kernel of each case. Cases: the standard grid's worst buckets against cuDNN
(docs/benchmarks.md, sessions 10-11: forward D=256 causal N=512 at 0.69x, D=128 causal N=1k at
0.72x, the D=128 non-causal backward at 0.73-0.8x) and a good bucket for contrast (forward
D=128 non-causal 4k), and D=256 non-causal 4k (0.84x, the D=256 gap). B*N = 16k, hidden 2048, bf16, as the grid.
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (name, mode, D, causal, N): B = 16384 // N, H = 2048 // D
CASES = (("fwd-d256-causal-512", "fwd", 256, True, 512),
         # session 25: the two cells left under 0.9x cuDNN (both N=512, 268 MB moved)
         ("fwd-d256-512", "fwd", 256, False, 512),
         ("fwd-d64-causal-512", "fwd", 64, True, 512),
         # session 30: the forward's one cell under 0.9x cuDNN (0.89-0.90x)
         ("fwd-d64-causal-1k", "fwd", 64, True, 1024),
         ("fwd-d128-512", "fwd", 128, False, 512),
         ("fwd-d128-causal-1k", "fwd", 128, True, 1024),
         # session 18: the forward's worst bucket after early_k_release (0.76x cuDNN)
         ("fwd-d128-causal-512", "fwd", 128, True, 512),
         ("fwd-d128-4k", "fwd", 128, False, 4096),
         ("fwd-d256-4k", "fwd", 256, False, 4096),
         ("bwd-d128-2k", "bwd", 128, False, 2048),
         # session 16: the long-N D=128 backward, 0.76-0.79x cuDNN (fused dQ, one launch)
         ("bwd-d128-16k", "bwd", 128, False, 16384),
         ("bwd-d128-causal-16k", "bwd", 128, True, 16384),
         # session 22: the backward's D=256 gap (0.70-0.75x cuDNN at N >= 2k, served by hopper_bwd)
         ("bwd-d256-4k", "bwd", 256, False, 4096))

# the metrics the summary prints, by their ncu names (the sections above)
METRICS = (("Duration", "us"), ("Compute (SM) Throughput", "%"), ("Memory Throughput", "%"),
           ("Registers Per Thread", ""), ("Achieved Occupancy", "%"),
           ("Issue Slots Busy", "%"), ("No Eligible", "%"), ("Warp Cycles Per Issued Instruction", ""),
           ("DRAM Throughput", "%"), ("L2 Hit Rate", "%"), ("Mem Busy", "%"),
           ("Max Bandwidth", "%"), ("Grid Size", ""), ("Block Size", ""),
           ("Dynamic Shared Memory Per Block", ""), ("Waves Per SM", ""))


def run_cases(names, bwd_variants=(), fwd_variants=(), only=()) -> None:
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
        impls = [("flashtune", ours), ("cudnn", cudnn)]
        if mode == "fwd":
            # the Hopper family's own record, forced: on short causal tiles the dispatcher
            # serves the generic family, which its record beats there
            from flashtune import dispatch
            from flashtune.problem import Problem
            hv = dispatch.select(Problem("hopper_fwd", "bfloat16", d, causal, 1, b, h, n, n))

            def hopper(hv=hv):
                with flashtune.force(hv):
                    return flashtune.attention(q, k, v, causal=causal)
            impls.insert(1, ("hopper_fwd", hopper))
        # forced variants beside cuDNN: --fwd-variants (hopper_fwd schedules the record does not
        # use, issue 10's D=256 gap, session 18) or --bwd-variants (which loop and which stall the
        # atomic-dQ schemes lose on, session 17)
        from flashtune.codegen import Variant
        for name_v in fwd_variants if mode == "fwd" else bwd_variants:
            def forced(variant=Variant.parse(name_v)):
                with flashtune.force(variant):
                    return flashtune.attention(q, k, v, causal=causal)
            impls.insert(-1, (name_v, forced))
        for impl, fn in impls:
            if only and impl not in only:
                continue
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
        key = (r["ID"], r["Kernel Name"][:140])  # cuDNN's names carry its tiles
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


def stalls(path: str) -> None:
    """ncu's --csv --page raw output (a row per kernel, a column per metric; the second row holds
    units) -> per kernel its duration, the tensor pipe's use and the warp stall reasons that
    take over 5% of the cycles between a warp's instructions, largest first."""
    lines = [ln for ln in open(path) if ln.startswith('"')]
    rows = list(csv.DictReader(lines))
    if rows and not rows[0].get("ID", "").strip().isdigit():
        rows = rows[1:]  # the units row
    for r in rows:
        def num(name):
            try:
                return float(str(r.get(name, "")).replace(",", ""))
            except ValueError:
                return None
        per = {k[len("smsp__average_warps_issue_stalled_"):-len("_per_issue_active.ratio")]: num(k)
               for k in r if k.startswith("smsp__average_warps_issue_stalled_")
               and k.endswith("_per_issue_active.ratio")}
        per = {k: v for k, v in per.items() if v}
        total = sum(per.values()) or 1.0
        pipe = ", ".join(f"{k.split('.')[-1]} {num(k):.1f}%" for k in r
                         if k.startswith("sm__pipe_tensor_cycles_active.avg.pct_of_peak")
                         and num(k) is not None)
        print(f"{r['ID']:>3} {r['Kernel Name'][:60]}  {num('gpu__time_duration.sum') or ''}")
        if pipe:
            print(f"      tensor pipe busy: {pipe}")
        print("      stalls (cycles per issued instruction): " + ", ".join(
            f"{k} {v:.2f}" for k, v in sorted(per.items(), key=lambda x: -x[1])
            if v / total > 0.05))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--bwd-variants", default="",
                    help="comma-separated bwd variant names, each forced beside the dispatched one")
    ap.add_argument("--fwd-variants", default="",
                    help="comma-separated hopper_fwd variant names, each forced beside the record")
    ap.add_argument("--only", default="",
                    help="comma-separated implementations to run (flashtune, hopper_fwd, cudnn, "
                         "a forced variant's name; default: all)")
    ap.add_argument("--summary", default=None, help="summarise an ncu CSV instead of running")
    ap.add_argument("--stalls", default=None,
                    help="the stall reasons of an ncu --page raw CSV instead of running")
    args = ap.parse_args(argv)
    if args.stalls:
        stalls(args.stalls)
        return 0
    if args.summary:
        summary(args.summary)
        return 0
    run_cases({c for c in args.cases.split(",") if c},
              tuple(v for v in args.bwd_variants.split(",") if v),
              tuple(v for v in args.fwd_variants.split(",") if v),
              {c for c in args.only.split(",") if c})
    return 0


if __name__ == "__main__":
    sys.exit(main())
