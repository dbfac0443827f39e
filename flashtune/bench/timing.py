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
        return _cpu_ms(fn), "cpu wall clock"
    from .. import timing
    fn, note = timed_form(fn, device, graph)
    ms, spread = timing.bench(fn, budget_ms=budget_ms)
    return ms, (note + "; " if note else "") + f"spread {spread:.3f}"


def _cpu_ms(fn) -> float:
    fn()
    times = []
    for _ in range(2):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def timed_form(fn, device: str, graph: bool) -> tuple:
    """(what is timed for fn, note): its CUDA-graph replay with graph=True where it can be
    captured, else fn itself."""
    if device != "cuda" or not graph:
        return fn, ""
    try:
        return graphed(fn), "cuda graph"
    except Exception as e:  # noqa: BLE001 -- eager timing is still a number
        torch.cuda.synchronize()
        return fn, f"eager (graph capture failed: {type(e).__name__})"


def measure_together(fns: list, device: str, *, budget_ms: float = 60.0,
                     rounds: int = 4, contexts: list | None = None) -> list:
    """Each of a cell's peers' fns (timed_form already applied) timed in `rounds` rounds, each
    round visiting them in the order of the one before reversed, about budget_ms per fn in all:
    a GPU heating up through the cell (the H100's SM clock fell 1980 -> 1785 MHz over a minute
    of load, session 21) slows every peer alike instead of the ones timed last. Per fn: (median ms over all its
    samples, relative spread p80/p20 - 1), or the exception its timing raised. contexts: per
    fn, a callable returning the context its runs need (a peer's backend choice), entered
    around each of its visits."""
    import contextlib
    contexts = contexts or [contextlib.nullcontext] * len(fns)
    if device != "cuda":
        out = []
        for f, ctx in zip(fns, contexts):
            try:
                with ctx():
                    out.append((_cpu_ms(f), 0.0))
            except Exception as e:  # noqa: BLE001 -- that peer's error, not the cell's
                out.append(e)
        return out
    from .. import timing
    flush = 256 << 20
    state = []  # per fn: [reps per round, samples, first estimate in ms] or the exception
    for f, ctx in zip(fns, contexts):
        try:
            with ctx():
                f()  # first-call costs (module load, autotune caches) stay out of the numbers
                torch.cuda.synchronize()
                est = statistics.median(timing.samples(f, 3, flush))
            reps = int(min(100 // rounds, max(2, budget_ms / rounds / max(est, 1e-3))))
            state.append([reps, [], est])
        except Exception as e:  # noqa: BLE001
            torch.cuda.synchronize()
            # kept without its traceback: the traceback holds this frame, whose `state` holds
            # the exception -- a cycle that kept every peer's graphs and a cell's 16 layers of
            # caches alive until Python's cyclic collector ran (the H100 decode grid's last
            # cell ran out of memory behind 32 GiB of such pools, session 29)
            state.append(e.with_traceback(None))
    for r in range(rounds):
        live = [i for i, st in enumerate(state) if not isinstance(st, Exception)]
        # there and back: over an even number of rounds every fn's mean place is the same,
        # so a drift linear in time adds the same to each
        for i in (live if r % 2 == 0 else live[::-1]):
            reps, got, est = state[i]
            try:
                with contexts[i]():
                    timing.warm_gpu(fns[i], est, 10.0)  # after another peer's work
                    got += timing.samples(fns[i], reps, flush)
            except Exception as e:  # noqa: BLE001
                torch.cuda.synchronize()
                state[i] = e.with_traceback(None)  # (no cycle: above)
    out = []
    for st in state:
        if isinstance(st, Exception):
            out.append(st)
            continue
        out.append(timing.summary(st[1]))
    return out


def graphed(fn):
    """fn's CUDA-graph replay (flashtune.timing.capture: warmed first, keeps what fn holds
    alive). Raises where fn cannot be captured (timed_form times it eagerly then)."""
    from .. import timing
    return timing.capture(fn)


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
