"""Candidates flow: compile (a pool of worker processes) -> gate + timing (one worker per GPU).

`submit` returns a future; the caller keeps about (compile workers + timing workers) in flight
so the GPUs never wait for a compile. Inline mode runs the backend in the calling thread, for
replayed measurements that need no isolation (sampler comparisons).
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from .isolation import Worker, WorkerLost
from .measure import Outcome


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
        self.depth = 1
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
        self.depth = compile_workers + len(devices)
        self._pool = ThreadPoolExecutor(max_workers=self.depth + 1,
                                        thread_name_prefix="flashtune-pipeline")

    def start(self) -> "Pipeline":
        """Start the timing workers now (their startup failures are the search's, not a
        trial's) and report their environment; compile workers start on first use."""
        if self.inline:
            self.info = self.backend.environment()
            return self
        timers = [self._timers.get() for _ in range(self._timers.qsize())]
        try:
            for w in timers:
                w.start()
        finally:
            for w in timers:
                self._timers.put(w)
        self.info = timers[0].info if timers else {}
        return self

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

    def _on(self, workers: queue.Queue, method: str, args, timeout: float, stage: str):
        w = workers.get()
        try:
            if self._stop.is_set():
                return Outcome.fail("interrupted", "search stopped")
            return w.call(method, *args, timeout=timeout)
        except WorkerLost as e:
            msg = str(e)
            if self._stop.is_set() or msg == "interrupted":
                return Outcome.fail("interrupted", "search stopped")
            return Outcome.fail("timeout" if msg.startswith("timeout") else "crash",
                                f"{stage} worker: {msg}")
        except RuntimeError as e:
            return Outcome.fail(stage, str(e))
        finally:
            workers.put(w)

    def _run(self, variant, problem) -> Outcome:
        res = self._on(self._compilers, "compile", (variant, problem), self.compile_timeout,
                       "compile")
        if res is not None:
            return res
        return self._on(self._timers, "measure", (variant, problem), self.trial_timeout,
                        "timing")

    # -- final pick ------------------------------------------------------------------------
    def retime(self, variants, problem, rounds: int) -> list:
        if self.inline:
            return self.backend.retime(variants, problem, rounds)
        timeout = self.trial_timeout * (1 + len(variants))
        res = self._on(self._timers, "retime", (variants, problem, rounds), timeout, "retime")
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
