"""Candidates flow: compile (a pool of worker processes) -> gate + timing (one worker per GPU).

`submit` returns a future; the caller keeps `depth` = compile workers + 2 x timing workers in
flight: every compile worker busy, and every timing worker with a compiled candidate waiting
behind the one it times, so a GPU never idles while the driver tells one result and asks for
the next. Inline mode runs the backend in the calling thread, for replayed measurements that
need no isolation (sampler comparisons).
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from .isolation import Worker, WorkerLost
from .measure import Outcome
from .timeline import mark


class Pipeline:
    def __init__(self, backend, *, devices=(0,), compile_workers: int = 2,
                 trial_timeout: float = 120.0, compile_timeout: float = 300.0,
                 inline: bool = False):
        self.backend = backend
        self.inline = inline
        self.trial_timeout, self.compile_timeout = trial_timeout, compile_timeout
        self._stop = threading.Event()
        self._compilers: queue.Queue = queue.Queue()
        self._timers: queue.Queue = queue.Queue()
        self._all: list[Worker] = []
        self._measured_on: dict = {}  # (problem, variant) keys -> the timing worker's index
        self.depth = 1
        self.feed = 1  # in flight enough to keep every timing worker busy (one waiting each)
        if inline:
            return
        for i in range(compile_workers):
            w = Worker(backend, "compile", i)
            self._all.append(w)
            self._compilers.put(w)
        for d in devices:
            w = Worker(backend, "time", d)
            self._all.append(w)
            self._timers.put(w)
        self.depth = compile_workers + 2 * len(devices)
        self.feed = 2 * len(devices)
        self._pool = ThreadPoolExecutor(max_workers=self.depth + 1,
                                        thread_name_prefix="flashtune-pipeline")

    def start(self) -> "Pipeline":
        """Start the timing workers now, all at once (their startup failures are the search's,
        not a trial's), and report their environment. Compile workers start in the background
        meanwhile; one that fails to start is started again on first use, where its error
        becomes that trial's."""
        if self.inline:
            self.info = self.backend.environment()
            return self
        timers = _drain(self._timers)
        errors = []
        try:
            # the server forks in the order asked: timers first, so they do not queue behind
            # 16 compile workers (the first trial needs one of each, and CUDA's start is longer)
            launched = []
            for w in timers:
                try:
                    launched.append(w.launch())
                except Exception as e:  # noqa: BLE001 -- the search's error, after cleanup
                    errors.append(e)
            compilers = _drain(self._compilers)
            for w in compilers:
                self._pool.submit(self._prestart, w)
            with ThreadPoolExecutor(max_workers=max(1, len(launched)),
                                    thread_name_prefix="flashtune-start") as ex:
                for f in [ex.submit(w.wait_started) for w in launched]:
                    if f.exception() is not None:
                        errors.append(f.exception())
        finally:
            for w in timers:
                self._timers.put(w)
        if errors:
            self.close(kill=True)
            raise errors[0]
        self.info = timers[0].info if timers else {}
        return self

    def _prestart(self, w: Worker) -> None:
        try:
            if not self._stop.is_set():
                w.start()
        except Exception:  # noqa: BLE001 -- retried on first use, where it is reported
            w.kill()
        finally:
            self._compilers.put(w)

    @property
    def restarts(self) -> int:
        return sum(w.restarts for w in self._all)

    # -- one candidate ---------------------------------------------------------------------
    def submit(self, variant, problem) -> Future:
        if self.inline:
            f = Future()
            f.set_result(self._run_inline(variant, problem))
            return f
        return self._pool.submit(self._run, variant, problem)

    def _run_inline(self, variant, problem) -> Outcome:
        try:
            res = self.backend.compile(variant, problem)
            return res if res is not None else self.backend.measure(variant, problem)
        except Exception as e:  # noqa: BLE001 -- a failing candidate is data
            return Outcome.fail("crash", f"{type(e).__name__}: {e}")

    def _on(self, workers: queue.Queue, method: str, args, timeout: float, stage: str,
            prefer=None, clock: list | None = None):
        t0 = time.monotonic()
        w = _take(workers, prefer)
        if clock is not None:  # (phase, seconds) pairs: the wait for a worker, then the call
            clock += [(f"{stage}_wait", time.monotonic() - t0)]
            t0 = time.monotonic()
        try:
            if self._stop.is_set():
                return Outcome.fail("interrupted", "search stopped")
            res = w.call(method, *args, timeout=timeout)
            if method == "measure":
                self._measured_on[(args[1].key, args[0].key)] = w.index
            return res
        except WorkerLost as e:
            msg = str(e)
            if self._stop.is_set() or msg == "interrupted":
                return Outcome.fail("interrupted", "search stopped")
            return Outcome.fail("timeout" if msg.startswith("timeout") else "crash",
                                f"{stage} worker: {msg}")
        except RuntimeError as e:
            return Outcome.fail(stage, str(e))
        finally:
            if clock is not None:
                clock += [(stage, time.monotonic() - t0)]
            workers.put(w)

    def warm(self, problem) -> None:
        """Each timing worker makes what its first measure() of `problem` needs (backend.warm),
        in the background: the first candidates compile meanwhile, and their timing waits for
        the worker as for any other call. A failure here is the first trial's to report."""
        if self.inline:
            return
        for w in (w for w in self._all if w.role == "time"):
            self._pool.submit(self._on, self._timers, "warm", (problem,), self.trial_timeout,
                              "warm", prefer=w.index).add_done_callback(
                lambda _: mark("timing worker warm"))

    def _run(self, variant, problem) -> Outcome:
        clock: list = []
        res = self._on(self._compilers, "compile", (variant, problem), self.compile_timeout,
                       "compile", clock=clock)
        if res is None:
            res = self._on(self._timers, "measure", (variant, problem), self.trial_timeout,
                           "timing", clock=clock)
        return dataclasses.replace(res, phases=tuple(clock) + res.phases)

    # -- final pick ------------------------------------------------------------------------
    def retime(self, variants, problem, rounds: int) -> list:
        if self.inline:
            return self.backend.retime(variants, problem, rounds)
        timeout = self.trial_timeout * (1 + len(variants))
        # on the timing worker that measured most of them: their kernels are loaded there
        # already, and its inputs for this problem are made
        votes: dict = {}
        for v in variants:
            d = self._measured_on.get((problem.key, v.key))
            if d is not None:
                votes[d] = votes.get(d, 0) + 1
        prefer = max(votes, key=votes.get) if votes else None
        res = self._on(self._timers, "retime", (variants, problem, rounds), timeout, "retime",
                       prefer=prefer)
        if isinstance(res, Outcome):  # the worker died: fall back to the search's numbers
            return [None] * len(variants)
        return res

    # -- shutdown --------------------------------------------------------------------------
    def close(self, kill: bool = False) -> None:
        """Stop every worker; with kill, do not wait for in-flight calls (Ctrl-C)."""
        if kill:
            self._stop.set()
        else:
            for w in self._all:
                w.ask_to_exit()  # all at once: each takes a moment to exit
        for w in self._all:
            w.close(kill=kill)
        if not self.inline:
            self._pool.shutdown(wait=not kill, cancel_futures=kill)


def _drain(q: queue.Queue) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


def _take(workers: queue.Queue, prefer=None) -> Worker:
    """The next free worker; with `prefer` (an index), that one if it is free now."""
    if prefer is None:
        return workers.get()
    free = _drain(workers)
    if not free:
        return workers.get()
    pick = next((w for w in free if w.index == prefer), free[0])
    for w in free:
        if w is not pick:
            workers.put(w)
    return pick
