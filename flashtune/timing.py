"""GPU timing: median of repeated runs with L2 flushed before each, and interleaved re-timing.

Runs in a timing worker process (flashtune/isolation.py) and needs CUDA.
"""
from __future__ import annotations

import random
import statistics

import torch

_flush_buf = {}


def _flush(nbytes: int) -> None:
    """Overwrite L2 so every run reads its inputs from HBM (as in a real model step)."""
    dev = torch.cuda.current_device()
    buf = _flush_buf.get(dev)
    if buf is None or buf.numel() < nbytes:
        buf = _flush_buf[dev] = torch.empty(nbytes, dtype=torch.int8, device="cuda")
    buf.zero_()


def capture(fn):
    """fn captured once in a CUDA graph (warmed on a side stream first, as capture requires):
    its replay. Raises where fn cannot be captured (a host sync inside, say: found before any
    capture begins). The replay keeps fn -- and so every tensor its closures hold -- and the
    captured outputs (replay.outputs) alive: the graph holds raw pointers to them, and once
    freed the allocator hands their memory to whatever is allocated next (flashtune bench's
    paged decode peer replayed with its block tables overwritten by the next peer's tensors:
    clamped page indices, in bounds but wrong, and timed faster than the GPU can read -- 3.4-4.0
    TB/s on the H100, session 29)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        # a host sync would break the capture, and a broken capture leaves the CUDA generator
        # in capture mode: every later torch.randn on the device raised "Offset increment
        # outside graph capture" (torch 2.11). So the second warm-up run makes syncs errors: a
        # syncing fn raises here, before any capture begins.
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    torch.cuda.synchronize()

    def replay(g=g, keep=fn):
        return g.replay()
    replay.outputs = out  # what the capture returned: each replay writes it again
    return replay


def graphed(fn):
    """fn's CUDA-graph replay (capture): a microsecond kernel (a decoding step) is timed by its
    GPU time, not by Python's launch latency (which the L2 flush before each run does not
    always hide). fn itself where it cannot be captured."""
    try:
        return capture(fn)
    except Exception:  # noqa: BLE001 -- not capturable: time the plain calls
        torch.cuda.synchronize()
        return fn


def samples(fn, reps: int, flush_bytes: int, after_flush=None) -> list[float]:
    """`reps` timings of fn() in ms, each after an L2 flush, events around fn only.
    after_flush: called between each flush and its start event (bench/host_gap.py gives the
    host a head start there with a GPU sleep)."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        _flush(flush_bytes)
        if after_flush is not None:
            after_flush()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def warm_gpu(fn, est_ms: float, warm_ms: float) -> None:
    """About warm_ms of untimed back-to-back runs of fn (at most 200): a GPU left idle while the
    host compiled (seconds) has clocked down, and the first milliseconds of work after it run
    slow -- on the H100/H200 benches the first cell after each compile (N=512, the first of each
    group) had p80/p20 spreads of 0.2-0.7 where the rest had < 0.1."""
    for _ in range(min(200, int(warm_ms / max(est_ms, 1e-3)))):
        fn()


def bench(fn, *, budget_ms: float = 60.0, min_reps: int = 5, max_reps: int = 100,
          flush_bytes: int = 256 << 20, warm_ms: float = 25.0) -> tuple[float, float]:
    """(median ms, relative spread p80/p20 - 1) of fn over about budget_ms of runs, after
    about warm_ms of untimed runs (warm_gpu)."""
    fn()  # warm: first-call costs (module load, autotune caches) stay out of the numbers
    torch.cuda.synchronize()
    est = statistics.median(samples(fn, 3, flush_bytes))
    warm_gpu(fn, est, warm_ms)
    reps = int(min(max_reps, max(min_reps, budget_ms / max(est, 1e-3))))
    return summary(samples(fn, reps, flush_bytes))


def summary(times: list) -> tuple[float, float]:
    """(median, relative spread p80/p20 - 1) of timings."""
    t = sorted(times)
    p20, p80 = t[len(t) // 5], t[(4 * len(t)) // 5]
    return statistics.median(t), (p80 / p20 - 1.0) if p20 > 0 else 0.0


def interleaved(fns: list, rounds: int, reps: int = 5, flush_bytes: int = 256 << 20,
                seed: int = 0) -> list[tuple[float, float]]:
    """Re-time several fns in shuffled order each round, so drift (clocks, temperature) hits
    them alike; per fn: (median of the round medians, relative spread of the round medians)."""
    rng = random.Random(seed)
    per = [[] for _ in fns]
    for f in fns:
        f()
    torch.cuda.synchronize()
    for f in fns:  # each a few ms: the rounds start on a warm GPU
        warm_gpu(f, statistics.median(samples(f, 2, flush_bytes)), 5.0)
    for _ in range(rounds):
        order = list(range(len(fns)))
        rng.shuffle(order)
        for i in order:
            per[i].append(statistics.median(samples(fns[i], reps, flush_bytes)))
    out = []
    for r in per:
        r = sorted(r)
        med = statistics.median(r)
        out.append((med, (r[-1] / r[0] - 1.0) if len(r) > 1 and r[0] > 0 else 0.0))
    return out
