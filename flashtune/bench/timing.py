"""Timing for `flashtune bench`: on CUDA the search's own timer (flashtune/timing.py: CUDA
events, L2 flushed before each run, median), optionally over CUDA-graph replays; on the CPU
(Triton's interpreter: a smoke run, not a measurement) a wall-clock median of a few runs.
Also the two ceilings a run reports against: a bf16 matmul and a device copy."""
from __future__ import annotations

import statistics
import time

import torch


def measure(fn, device: str, *, budget_ms: float = 60.0, graph: bool = False) -> tuple[float, str]:
    """(median ms of fn(), note). graph=True times a CUDA-graph replay of fn (the GPU's work
    without Python's launch cost); a step that cannot be captured is timed eagerly, noted."""
    if device != "cuda":
        fn()
        times = []
        for _ in range(2):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times), "cpu wall clock"
    from .. import timing
    note = ""
    if graph:
        try:
            fn = graphed(fn)
            note = "cuda graph"
        except Exception as e:  # noqa: BLE001 -- eager timing is still a number
            torch.cuda.synchronize()
            note = f"eager (graph capture failed: {type(e).__name__})"
    ms, spread = timing.bench(fn, budget_ms=budget_ms)
    return ms, (note + "; " if note else "") + f"spread {spread:.3f}"


def graphed(fn):
    """fn captured as a CUDA graph (warmed eagerly and on the capture stream): its replay."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # warm on the capture stream
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            fn()
    torch.cuda.synchronize()
    return g.replay


def peak_mib(fn, device: str) -> float:
    """Peak memory fn() allocates above what was allocated before it, MiB (CUDA only)."""
    if device != "cuda":
        raise RuntimeError("peak memory is measured on CUDA only")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def ceilings(device: str, quick: bool = False) -> dict:
    """What this device reaches on the two simplest kernels, measured now: a bf16 matmul
    (TFLOP/s, 2*n^3) and a device-to-device copy (GB/s, bytes read + written)."""
    n = 8192 if device == "cuda" else 256
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    c = torch.empty(n, n, dtype=dtype, device=device)
    ms_mm, _ = measure(lambda: torch.mm(a, b, out=c), device, budget_ms=100 if quick else 300)
    del a, b, c
    nbytes = (1 << 30) if device == "cuda" else (16 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms_cp, _ = measure(lambda: dst.copy_(src), device, budget_ms=100 if quick else 300)
    del src, dst
    return {"matmul": {"tflops": 2.0 * n ** 3 / (ms_mm * 1e-3) / 1e12, "ms": ms_mm,
                       "what": f"torch.mm {n}x{n}x{n} {str(dtype).removeprefix('torch.')}"},
            "copy": {"gbps": 2.0 * nbytes / (ms_cp * 1e-3) / 1e9, "ms": ms_cp,
                     "what": f"copy_ of {nbytes >> 20} MiB (read + write)"}}
