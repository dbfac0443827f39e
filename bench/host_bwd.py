"""Where a backward's host time goes (issue 10: the bench's D=128 causal 512 backward cell spread
over 25% between samples, host-bound): the GPU time of one backward (torch.profiler, kernels
summed) beside the host time to issue one (the GPU kept busy by a queued sleep, so no issue waits
on it), the backward's host time layer by layer (phases), then cProfile's top functions over
those issues. The backward is called as the bench calls it: torch.autograd.grad on a retained
graph.

    python3 bench/host_bwd.py [--d 128 --n 512 --b 32 --causal] [--top 30]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

import flashtune  # noqa: E402


def issue_us(fn, calls: int) -> float:
    """Host microseconds per call of fn, the GPU busy behind a sleep long enough for all."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU cycles queued ahead
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / calls * 1e6


def gpu_us(fn) -> dict:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    per: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:60]] = per.get(e.name[:60], 0.0) + e.device_time / 10
    return per


def phases(xs, do, causal: bool, bwd, calls: int) -> None:
    """The backward's host time peeled layer by layer, each without profiler overhead: the
    autograd call as the bench makes it, flashtune.ops.run_backward without autograd, the cached
    plan's run alone (a CUDA graph's replay where the plan has launch_graphs: the calls repeat
    their buffers), that run with every Launcher launch stubbed and no graph (what is left:
    allocations, descriptors, Python), and the allocations alone. Differences between lines
    are the layers' costs (autograd engine; checks and plan lookup; launches)."""
    from flashtune import launcher, ops
    q, k, v = (x.detach() for x in xs)
    o, lse = ops.run_forward(q, k, v, causal, None)
    ops.run_backward(do, q, k, v, o, lse, causal, None)
    plan = next(iter(ops._bwd_plans.values())) if len(ops._bwd_plans) == 1 else None

    def direct():
        return ops.run_backward(do, q, k, v, o, lse, causal, None)

    def allocs():
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                torch.empty(q.shape[:3], dtype=torch.float32, device=q.device),
                torch.empty(q.shape[:3], dtype=torch.float32, device=q.device))
    steps = [("autograd.grad, as the bench", bwd), ("ops.run_backward, no autograd", direct)]
    if plan is not None:
        steps.append((f"{type(plan).__name__}.run alone", lambda: plan.run(do, q, k, v, o, lse)))
    steps.append(("5 allocations (dq, dk, dv, delta, lse2)", allocs))
    for name, fn in steps:
        runs = [issue_us(fn, calls) for _ in range(3)]
        print(f"phase {name}: {statistics.median(runs):.1f} us "
              f"(runs {', '.join(f'{r:.1f}' for r in runs)})")
    if plan is not None:  # the launches stubbed: the Python, allocations and descriptors left
        from flashtune.launch_graphs import LaunchGraphs
        real, graphs = launcher.Launcher.__call__, getattr(plan, "graphs", None)
        launcher.Launcher.__call__ = lambda self, grid, *args: None
        if graphs is not None:  # no replay of the real graph, no capture of the stubs
            plan.graphs = LaunchGraphs()
            plan.graphs.ok = False
        try:
            runs = [issue_us(lambda: plan.run(do, q, k, v, o, lse), calls) for _ in range(3)]
        finally:
            launcher.Launcher.__call__ = real
            if graphs is not None:
                plan.graphs = graphs
        print(f"phase {type(plan).__name__}.run, launches stubbed: "
              f"{statistics.median(runs):.1f} us (runs {', '.join(f'{r:.1f}' for r in runs)})")


def peers(xs, do, causal: bool, calls: int) -> None:
    """The same backward by SDPA's cuDNN and flash backends, and the autograd engine alone (a
    Python Function whose backward returns its gradient, as flashtune's runs on the engine's
    CUDA thread): GPU time, host time to issue, and the bench's time (L2 flush, events around
    one call: flashtune.timing.bench) beside it with the host given about 1 ms head start (a GPU
    sleep after the flush), which leaves the GPU time. Which peer the host bounds, and by how
    much the engine alone costs, on this machine."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from flashtune import timing
    from host_profile import Ident

    def sdpa(backend):
        def make():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(*xs, is_causal=causal)
        return make

    makes = [("flashtune", lambda: flashtune.attention(*xs, causal=causal)),
             ("sdpa-cudnn", sdpa(SDPBackend.CUDNN_ATTENTION)),
             ("sdpa-flash", sdpa(SDPBackend.FLASH_ATTENTION)),
             ("engine alone (identity Function)", lambda: Ident.apply(xs[0]))]
    for name, make in makes:
        try:
            out = make()
        except RuntimeError as e:  # a backend this build lacks
            print(f"peer {name}: not run ({str(e).splitlines()[0][:100]})")
            continue
        grads = do if out.shape == do.shape else torch.randn_like(out)
        inputs = xs if name != "engine alone (identity Function)" else xs[:1]

        def bwd(out=out, grads=grads, inputs=inputs):
            return torch.autograd.grad(out, inputs, grads, retain_graph=True)
        gpu = sum(gpu_us(bwd).values())
        host = statistics.median(issue_us(bwd, calls) for _ in range(3))
        timed = timing.bench(bwd)[0] * 1e3
        ahead = statistics.median(timing.samples(
            bwd, 30, 256 << 20, after_flush=lambda: torch.cuda._sleep(int(2e6)))) * 1e3
        print(f"peer {name}: GPU {gpu:.1f} us, host {host:.1f} us to issue, bench {timed:.1f} "
              f"us, bench with a ~1 ms host head start {ahead:.1f} us")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--b", type=int, default=32)
    ap.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args(argv)
    h = 2048 // a.d
    xs = [torch.randn(a.b, h, a.n, a.d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
          for _ in range(3)]
    out = flashtune.attention(*xs, causal=a.causal)
    do = torch.randn_like(out)

    def bwd():
        return torch.autograd.grad(out, xs, do, retain_graph=True)

    def fwd():
        with torch.no_grad():
            return flashtune.attention(*xs, causal=a.causal)
    print(f"D={a.d} N={a.n} B={a.b} H={h} causal={a.causal}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}")
    for name, fn in (("backward", bwd), ("forward", fwd)):
        per = gpu_us(fn)
        print(f"{name}: GPU {sum(per.values()):.1f} us per call: "
              + ", ".join(f"{k} {v:.1f}" for k, v in sorted(per.items(), key=lambda x: -x[1])))
        runs = [issue_us(fn, a.calls) for _ in range(3)]
        print(f"{name}: host {statistics.median(runs):.1f} us per call to issue "
              f"(runs {', '.join(f'{r:.1f}' for r in runs)})")
    phases(xs, do, a.causal, bwd, a.calls)
    peers(xs, do, a.causal, a.calls)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.calls):
        bwd()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
    print(f"backward, cProfile over {a.calls} calls (tottime):")
    print(s.getvalue()[-6000:])
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(a.top)
    print("backward, cumulative:")
    print(s.getvalue()[-6000:])


if __name__ == "__main__":
    main()
