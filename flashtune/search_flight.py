"""The candidates a search process has in flight, across its buckets.

A bucket whose budget is all in flight hands its last trials on: the next bucket's loop tells
them to their own study as they come back. So the GPU times the next bucket's first candidates
while this one's last ones finish, instead of idling through every bucket's tail (in-flight
capped at half of what is left, down to one per timing slot) and start (its first candidates
compiling). On an H200 that was ~0.9 s of ~3.9 s per 40-trial bucket. The bucket's winner is
picked once its last trial is told (flashtune/search.py, _Run).
"""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, wait

from .measure import Outcome


class Flight:
    def __init__(self):
        self.futures: dict = {}   # future -> (bucket study, trial, variant)
        self.waiting: dict = {}   # (id(bucket study), variant key) -> [trials proposing it]

    def add(self, future, bs, trial, variant) -> None:
        self.futures[future] = (bs, trial, variant)
        self.waiting[(id(bs), variant.key)] = []

    def holds(self, bs, variant) -> bool:
        """Whether `variant` of this bucket is being measured (a proposal of it waits)."""
        return (id(bs), variant.key) in self.waiting

    def wait_for(self, bs, trial, variant) -> None:
        self.waiting[(id(bs), variant.key)].append(trial)

    def of(self, bs) -> int:
        """This bucket's candidates in flight."""
        return sum(1 for b, _, _ in self.futures.values() if b is bs)

    def settle(self, done, on_told=None) -> None:
        """Tell what came back, each to its own study (and the proposals that waited on it);
        on_told(bs) after each."""
        for f in done:
            bs, trial, variant = self.futures.pop(f)
            outcome = f.result()
            bs.tell(trial, variant, outcome)
            for t in self.waiting.pop((id(bs), variant.key), []):
                bs.tell(t, variant, "duplicate" if not outcome.transient else outcome)
            if not outcome.ok and not outcome.transient:
                bs.failures.append((variant.name, outcome.stage, outcome.reason))
            if on_told is not None:
                on_told(bs)

    def settle_ready(self, on_told=None) -> None:
        self.settle([f for f in self.futures if f.done()], on_told)

    def wait_any(self, timeout: float = 0.5, on_told=None) -> None:
        done, _ = wait(list(self.futures), timeout=timeout, return_when=FIRST_COMPLETED)
        self.settle(done, on_told)

    def drain(self, on_told=None) -> None:
        """Wait for everything in flight and tell it."""
        while self.futures:
            self.wait_any(on_told=on_told)

    def interrupt(self) -> None:
        """Ctrl-C: every trial in flight (any bucket) and those waiting on it FAIL, transient."""
        for bs, trial, variant in self.futures.values():
            bs.tell(trial, variant, Outcome.fail("interrupted", "Ctrl-C"))
            for t in self.waiting.pop((id(bs), variant.key), []):
                bs.tell(t, variant, Outcome.fail("interrupted", "Ctrl-C"))
        self.futures.clear()
        self.waiting.clear()
