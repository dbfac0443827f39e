"""Where a masked forward+backward spends its time (issue 11): torch.profiler over flashtune's
fwd+bwd with no mask, a 100%-dense and a 10%-dense block mask, a sliding window, softcap and a
10% block mask with causal + softcap, beside Flex on the 100% mask. Prints, per case, the wall
time per step, the GPU kernel time per step, the kernels by GPU time, the host's CUDA runtime
calls per step (launches, synchronisations, copies, allocations) and the ops with the most host
self time; one JSON line per case to --out.

    python3 bench/sparse_profile.py --out sparse_profile.jsonl     # N=4k, B=1, H=16, D=128, bf16
    TRITON_INTERPRET=1 python3 bench/sparse_profile.py --smoke     # CPU: tiny, no Flex

Why: the quick mask grid on the H100 (docs/benchmarks.md, session 5) timed the 100%-dense block
mask's fwd+bwd at 3.56 ms against 1.34 ms without a mask and 1.23 ms for Flex; its forward alone
is 0.29 ms. The kernels it runs compile without spills for sm_90 (no element mask), so the time
is either in a kernel the dense path does not run, or on the host.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import flashtune  # noqa: E402
from mask_bench import fwd_bwd, random_blocks  # noqa: E402


def profile(run, steps: int, cuda: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile as prof
    for _ in range(3):
        run()
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        run()
    if cuda:
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t) * 1e3 / steps
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with prof(activities=acts) as p:
        for _ in range(steps):
            run()
        if cuda:
            torch.cuda.synchronize()
    kernels, runtime, cpu_ops = [], {}, []
    for e in p.key_averages():
        dev = getattr(e, "device_time_total", None)
        if dev is None:
            dev = getattr(e, "cuda_time_total", 0)
        if cuda and dev and e.key and not e.key.startswith(("aten::", "cuda", "Torch", "autograd")):
            kernels.append((e.key[:70], dev / 1e3 / steps, e.count // steps))
        # the host's CUDA runtime/driver calls per step: launches, and anything that waits on the
        # GPU (a synchronize or a device->host copy serialises host and GPU) or allocates
        if e.key.startswith(("cuda", "cu")) and not e.key.startswith("cudnn"):
            runtime[e.key] = round(e.count / steps, 2)
        cpu_ops.append((e.key[:60], e.self_cpu_time_total / 1e3 / steps, e.count / steps))
    kernels.sort(key=lambda x: -x[1])
    cpu_ops.sort(key=lambda x: -x[1])
    return {"wall_ms": wall_ms, "kernel_ms": sum(k[1] for k in kernels),
            "kernels": [{"name": n, "ms": ms, "calls": c} for n, ms, c in kernels[:12]],
            "runtime_calls": runtime,
            "cpu_self_ms": [{"name": n, "ms": round(ms, 4), "calls": c} for n, ms, c in cpu_ops[:10]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="CPU: N=256, H=2, D=32, float16")
    ap.add_argument("--out", default=None)
    ap.add_argument("--densities", default="",
                    help="also block masks of these percents, mask_bench.py's random blocks "
                         "(same seeds: the sweep's patterns), e.g. 5,10")
    ap.add_argument("--only", default="",
                    help="comma-separated case-name prefixes to run (default: every case)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    dev = "cuda" if cuda else "cpu"
    n, h, d, dt = args.n, args.heads, args.head_dim, torch.bfloat16
    if args.smoke:
        n, h, d, dt, args.steps = 256, 2, 32, torch.float16, 1
    q, k, v = (torch.randn(1, h, n, d, dtype=dt, device=dev, requires_grad=True) for _ in range(3))
    nb = n // 128
    g = torch.Generator().manual_seed(0)
    sparse = torch.rand(1, 1, nb, nb, generator=g) < 0.10
    sparse |= torch.eye(nb, dtype=torch.bool)  # no empty row
    masks = {
        "block100": flashtune.BlockMask.from_dense(torch.ones(1, 1, nb, nb, dtype=torch.bool,
                                                              device=dev), (n, n), block_size=128),
        "block10": flashtune.BlockMask.from_dense(sparse.to(dev), (n, n), block_size=128),
    }
    for pct in (int(x) for x in args.densities.split(",") if x.isdigit()):
        masks[f"sweep{pct}"] = flashtune.BlockMask.from_dense(
            random_blocks(nb, pct / 100, seed=pct).to(dev), (n, n), block_size=128)
    cases = {"dense": lambda q, k, v: flashtune.attention(q, k, v),
             "window1024": lambda q, k, v: flashtune.attention(q, k, v, causal=True,
                                                             window=(1024, 0)),
             "softcap50": lambda q, k, v: flashtune.attention(q, k, v, softcap=50.0)}
    for name, bm in masks.items():
        cases[name] = lambda q, k, v, bm=bm: flashtune.attention(q, k, v, block_mask=bm)
    cases["block10+causal+softcap"] = lambda q, k, v: flashtune.attention(
        q, k, v, causal=True, softcap=50.0, block_mask=masks["block10"])
    # the block-sparse backward with the dense call's bwd tiles: a block-sparse bucket has no
    # tuned record, so it runs the built-in default (D=128 sm_90: dK/dV m32-n128-w8-s2) where the
    # dense call runs its tuned record (H100 table: m64-n128-w8-s2); forced here (mask rendered
    # in, tiles fitted), the dK/dV time says how much of the gap the tiles explain
    from flashtune import dispatch
    dense_bwd = dispatch.select_for_call("bwd", q, k, False)

    def forced_tiles(q, k, v):
        with flashtune.force(dense_bwd):  # carried to the backward (ops.call_forced)
            return flashtune.attention(q, k, v, block_mask=masks["block100"])
    cases[f"block100 bwd {dense_bwd.name}"] = forced_tiles
    if cuda:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            flex = torch.compile(flex_attention)
            fbm = create_block_mask(lambda b, hh, qi, ki: qi >= 0, 1, 1, n, n, device=dev)
            cases["flex_block100"] = lambda q, k, v: flex(q, k, v, block_mask=fbm)
        except Exception as e:  # noqa: BLE001 -- a missing peer is a line, not a crash
            print(f"flex unavailable: {type(e).__name__}: {e}")
    only = tuple(x for x in args.only.split(",") if x)
    out = open(args.out, "w") if args.out else None
    for name, fn in cases.items():
        if only and not name.startswith(only):
            continue
        try:
            row = {"case": name, "N": n, "H": h, "D": d,
                   **profile(fwd_bwd(fn, q, k, v), args.steps, cuda)}
        except Exception as e:  # noqa: BLE001
            row = {"case": name, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        if "error" in row:
            print(f"{name}: failed: {row['error']}")
        else:
            print(f"{name}: wall {row['wall_ms']:.3f} ms/step, kernels {row['kernel_ms']:.3f} ms")
            for kk in row["kernels"]:
                print(f"    {kk['ms']:8.3f} ms  x{kk['calls']}  {kk['name']}")
            if row["runtime_calls"]:
                print("    host runtime calls per step: " + ", ".join(
                    f"{n} x{c:g}" for n, c in sorted(row["runtime_calls"].items())))
            print("    top host self time per step: " + ", ".join(
                f"{o['name']} {o['ms']:.3f} ms" for o in row["cpu_self_ms"][:6]))
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
