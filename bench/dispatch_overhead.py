"""Host overhead of flashtune.attention over a raw launch of the same compiled Triton kernel,
and a CUDA-graph capture of a dispatched call.

    python3 bench/dispatch_overhead.py                      # H100: the lead runs this
    python3 bench/dispatch_overhead.py --shape 1,1,128,64 --iters 3000 --reps 9
    TRITON_INTERPRET=1 python3 bench/dispatch_overhead.py --device cpu --iters 3 --reps 2  # smoke

Method: many calls on a tiny problem (one program per head: the GPU finishes each kernel long
before the host issues the next, so the loop measures host time), timed with perf_counter
before the final synchronize; median over interleaved repetitions. Rows:

    attention          flashtune.attention(q, k, v) -- validation, Problem, dispatch, launch
    direct+alloc       torch.empty_like(q), torch.empty(lse), load(variant).attn_fwd[grid](...)
    direct             the launch alone, outputs preallocated
    components         the host steps of attention, each alone (no launch)

The issue's target: attention - direct+alloc <= 10 us. Then a CUDA graph captures a dispatched
call (warm, and with a cold dispatcher memo: the table lookup runs during capture), is
replayed, and is compared with eager calls on the same and on new inputs; torch.compile of a
dispatched call is compared with eager too. A table goes to stdout, JSON to $OUT (if set).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import triton

import flashtune
from flashtune import dispatch, launch
from flashtune.codegen import load
from flashtune.validate import check_qkv

TARGET_US = 10.0


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _host_us(fn, iters: int, device: str) -> float:
    """Host microseconds per call over `iters` back-to-back calls."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    _sync(device)
    return (t1 - t0) / iters * 1e6


def _gpu_us(fn, iters: int) -> float:
    """GPU microseconds per call (events around the same loop): must stay below the host time,
    or the loop is GPU-bound and measures the kernel, not the host."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def _direct_launcher(q, k, v, causal, variant, prealloc: bool):
    """The same kernel and arguments launch.forward passes, with everything precomputed."""
    plan = launch.FwdPlan(q, k, v, causal, None, variant)
    kernel, grid, args = plan.kernel, plan.grid, plan.args  # kernel: a launcher.Launcher
    o0 = torch.empty_like(q)
    lse0 = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    if variant.loads == "descriptor":
        launch._need_allocator()
    if prealloc:
        def run_prealloc():
            kernel(grid, q, k, v, o0, lse0, *args)
            return o0
        return run_prealloc

    def run():
        o = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        kernel(grid, q, k, v, o, lse, *args)
        return o
    return run


def _components(q, k, v, causal, iters: int) -> dict:
    """Host microseconds of each step attention takes before the launch."""
    variant = dispatch.select_for_call("fwd", q, k, causal)
    steps = {
        "check_qkv": lambda: check_qkv(q, k, v, causal, None),
        "dispatch.select_for_call (memo hit)": lambda: dispatch.select_for_call("fwd", q, k, causal),
        "descriptor_ok": lambda: launch.descriptor_ok(q, k, v),
        "codegen.load (memo hit)": lambda: load(variant),
        "2x torch.empty (O, LSE)": lambda: (torch.empty_like(q), torch.empty(
            (q.shape[0], q.shape[1], q.shape[2]), dtype=torch.float32, device=q.device)),
    }
    out = {}
    for name, fn in steps.items():
        for _ in range(min(iters, 100)):
            fn()
        out[name] = statistics.median(_host_us(fn, iters, "cpu") for _ in range(5))
    return out


def _graph_check(q, k, v, causal: bool, cold: bool) -> dict:
    """Capture flashtune.attention in a CUDA graph, replay, compare with eager results."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (compiles the kernel) outside the capture
        for _ in range(3):
            flashtune.attention(q, k, v, causal=causal)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    if cold:
        dispatch.clear_cache()  # the first lookup (tables, DB, GPU detection) runs inside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = flashtune.attention(q, k, v, causal=causal)
    g.replay()
    torch.cuda.synchronize()
    same = (out.float() - flashtune.attention(q, k, v, causal=causal).float()).abs().max().item()
    with torch.no_grad():  # new inputs in the captured buffers: the replay must follow them
        q.copy_(torch.randn_like(q))
        k.copy_(torch.randn_like(k))
    g.replay()
    torch.cuda.synchronize()
    new = (out.float() - flashtune.attention(q, k, v, causal=causal).float()).abs().max().item()
    replay_us = statistics.median(_host_us(g.replay, 200, "cuda") for _ in range(5))
    return {"max_abs_diff_same_inputs": same, "max_abs_diff_new_inputs": new,
            "replay_host_us": replay_us, "ok": same == 0.0 and new == 0.0}


def _compile_check(q, k, v, causal: bool, mode) -> dict:
    try:
        torch._dynamo.reset()
        fn = torch.compile(lambda q, k, v: flashtune.attention(q, k, v, causal=causal),
                           fullgraph=True, mode=mode)
        for _ in range(3):
            got = fn(q, k, v)
        diff = (got.float() - flashtune.attention(q, k, v, causal=causal).float()).abs().max().item()
        return {"max_abs_diff": diff, "ok": diff == 0.0}
    except Exception as e:  # noqa: BLE001 -- reported, not fatal: the other rows still count
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:400]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="1,1,128,64", help="B,H,N,D (tiny: host-bound)")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--iters", type=int, default=2000, help="calls per timed repetition")
    ap.add_argument("--reps", type=int, default=7, help="interleaved repetitions (median)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a smoke run in Triton's interpreter (numbers meaningless)")
    args = ap.parse_args(argv)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU: run on the GPU machine (or --device cpu with TRITON_INTERPRET=1 "
              "for a smoke run)", file=sys.stderr)
        return 2
    b, h, n, d = (int(x) for x in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    q, k, v = (torch.randn(b, h, n, d, dtype=dtype, device=device) for _ in range(3))
    causal = args.causal

    ex = flashtune.explain(q, k, v, causal=causal)
    variant = ex.variant
    if variant.loads == "descriptor" and not launch.descriptor_ok(q, k, v):
        variant = dispatch.pointer_twin(variant)
    with torch.no_grad():
        calls = {
            "attention": lambda: flashtune.attention(q, k, v, causal=causal),
            "direct+alloc": _direct_launcher(q, k, v, causal, variant, prealloc=False),
            "direct": _direct_launcher(q, k, v, causal, variant, prealloc=True),
        }
        # the direct launch must be the same kernel with the same arguments: same bits
        ref = calls["attention"]()
        for name in ("direct+alloc", "direct"):
            got = calls[name]()
            if not torch.equal(got, ref):
                print(f"{name} differs from attention: the benchmark's launch is out of date "
                      "with flashtune/launch.py", file=sys.stderr)
                return 1
        for fn in calls.values():  # warm: compile, caches, allocator
            for _ in range(min(args.iters, 50)):
                fn()
        samples = {name: [] for name in calls}
        for _ in range(args.reps):  # interleaved, so drift hits every row alike
            for name, fn in calls.items():
                samples[name].append(_host_us(fn, args.iters, device))
        host = {name: statistics.median(s) for name, s in samples.items()}
        gpu = {name: _gpu_us(fn, args.iters) for name, fn in calls.items()} if device == "cuda" else {}
        comps = _components(q, k, v, causal, args.iters)

    overhead = host["attention"] - host["direct+alloc"]
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__, "triton": triton.__version__,
        "shape": [b, h, n, d], "dtype": args.dtype, "causal": causal,
        "variant": variant.name, "lookup_level": ex.level, "lookup_origin": ex.origin,
        "iters": args.iters, "reps": args.reps,
        "host_us": host, "host_us_samples": samples, "gpu_us": gpu, "components_us": comps,
        "overhead_us": overhead,
        "overhead_vs_prealloc_us": host["attention"] - host["direct"],
        "target_us": TARGET_US, "within_target": overhead <= TARGET_US,
    }
    if device == "cuda":
        result["cuda_graph"] = {"warm": _graph_check(q.clone(), k.clone(), v.clone(), causal, False),
                                "cold_memo": _graph_check(q.clone(), k.clone(), v.clone(), causal,
                                                          True)}
        result["torch_compile"] = {"default": _compile_check(q, k, v, causal, None),
                                   "reduce-overhead": _compile_check(q, k, v, causal,
                                                                     "reduce-overhead")}

    print(f"{result['device']} | torch {torch.__version__} | triton {triton.__version__}")
    print(f"shape B,H,N,D={b},{h},{n},{d} {args.dtype} causal={causal} | variant {variant.name} "
          f"({ex.level}) | {args.iters} calls x {args.reps} reps")
    print(f"{'call':<32}{'host us/call':>14}{'gpu us/call':>14}")
    for name in calls:
        g = f"{gpu[name]:.2f}" if name in gpu else "-"
        print(f"{name:<32}{host[name]:>14.2f}{g:>14}")
    for name, us in comps.items():
        print(f"  {name:<30}{us:>14.2f}")
    verdict = "PASS" if result["within_target"] else "FAIL"
    print(f"overhead attention - direct+alloc: {overhead:.2f} us  (target <= {TARGET_US:g} us: "
          f"{verdict}); vs direct (preallocated): {result['overhead_vs_prealloc_us']:.2f} us")
    if gpu and any(gpu[k_] >= host[k_] * 0.9 for k_ in calls):
        print("warning: GPU time per call is close to the host time: the loop may be GPU-bound; "
              "use a smaller --shape")
    for name, r in result.get("cuda_graph", {}).items():
        print(f"cuda graph ({name}): replay == eager: {r['ok']} (max |diff| same inputs "
              f"{r['max_abs_diff_same_inputs']:g}, new inputs {r['max_abs_diff_new_inputs']:g}); "
              f"replay {r['replay_host_us']:.2f} us host")
    for name, r in result.get("torch_compile", {}).items():
        print(f"torch.compile ({name}): " + ("ok" if r["ok"] else r.get("error", f"max |diff| "
                                                                          f"{r.get('max_abs_diff')}")))
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, "dispatch_overhead.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=2, sort_keys=True)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
