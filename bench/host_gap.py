"""Does host time enter the bench's samples? (plan item 1, session 25)

The bench times a cell as: flush L2 (a 256 MB memset), start event, fn(), end event, many times
without a sync (flashtune/timing.py). The host runs ahead of the GPU only while its time per
call stays under the GPU's (flush + kernel); past that the GPU waits for each launch between the
start event and the kernel, and the sample holds host time. For one dense cell, per
implementation:

  host_us      host time per call, measured with the GPU held busy (torch.cuda._sleep) so
               every launch queues: the Python path alone
  bench        timing.bench as the report uses it (TFLOP/s)
  bench_sleep  the same with a GPU sleep of --sleep-us after each flush: the host gets that
               long a head start, so a sample is the kernels' GPU time

    python3 bench/host_gap.py --d 256 --n 512 --causal 0 --variants NAME,...
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _sleep_cycles(us: float) -> int:
    import torch
    return int(us * torch.cuda.get_device_properties(0).clock_rate / 1e3)  # clock_rate: kHz


def host_us(fn, calls: int = 60) -> float:
    """Host microseconds per call of fn with the GPU busy (a long _sleep first)."""
    import torch
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(_sleep_cycles(1e6 * 0.2))  # 200 ms: far longer than the calls below
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return 1e6 * dt / calls


def bench(fn, sleep_us: float = 0.0, reps: int = 60) -> float:
    """timing.samples (flush, events around fn), optionally a GPU sleep after each flush; the
    median in ms."""
    import statistics

    import torch

    from flashtune import timing
    fn()
    torch.cuda.synchronize()
    timing.warm_gpu(fn, 0.2, 25.0)
    cycles = _sleep_cycles(sleep_us)
    return statistics.median(timing.samples(
        fn, reps, 256 << 20, after_flush=(lambda: torch.cuda._sleep(cycles)) if cycles else None))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--causal", type=int, default=0)
    ap.add_argument("--variants", default="", help="hopper_fwd variants forced (API and plan)")
    ap.add_argument("--sleep-us", type=float, default=300.0)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import flashtune
    from flashtune.codegen import Variant
    from flashtune.launch_hopper import HopperFwdPlan
    causal = bool(a.causal)
    b, h = 16384 // a.n, 2048 // a.d
    q, k, v = (torch.randn(b, h, a.n, a.d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4.0 * b * h * a.n * a.n * a.d / (2 if causal else 1)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(q, k, v, is_causal=causal)

    def dispatched():
        with torch.no_grad():
            return flashtune.attention(q, k, v, causal=causal)
    impls = [("sdpa-cudnn", cudnn), ("flashtune", dispatched)]
    for name in [x for x in a.variants.split(",") if x]:
        var = Variant.parse(name)
        plan = HopperFwdPlan(q, k, v, causal, None, var)

        def api(var=var):
            with torch.no_grad(), flashtune.force(var):
                return flashtune.attention(q, k, v, causal=causal)
        impls += [(f"api:{name}", api), (f"plan:{name}", lambda plan=plan: plan.run(q, k, v))]
    rows = []
    for label, fn in impls:
        r = {"impl": label, "D": a.d, "N": a.n, "causal": causal,
             "host_us": host_us(fn)}
        r["bench_tflops"] = flops / bench(fn) / 1e9
        r["bench_sleep_tflops"] = flops / bench(fn, a.sleep_us) / 1e9
        rows.append(r)
        print(f"{label[:90]:<90} host {r['host_us']:7.1f} us  bench {r['bench_tflops']:6.1f}  "
              f"with a {a.sleep_us:.0f} us head start {r['bench_sleep_tflops']:6.1f} TFLOP/s",
              flush=True)
    if a.out:
        with open(a.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
