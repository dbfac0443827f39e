"""Measuring backends: one interface, a real GPU implementation and a replay one.

A backend is a picklable description; its methods run inside worker processes that
flashtune/isolation.py starts (compile workers call `compile`, timing workers `measure` and
`retime`), so whatever a kernel does to its process stays there. `Outcome` is what a trial
learns: a median time, or the stage that failed and why.
"""
from __future__ import annotations

from dataclasses import dataclass

# Stages a candidate can fail at, in pipeline order. "interrupted" and "lost" are transient:
# they say nothing about the variant, so a later proposal of it is measured again.
STAGES = ("infeasible", "compile", "gate", "launch", "timing", "timeout", "crash")
TRANSIENT = ("interrupted", "lost")


@dataclass(frozen=True)
class Outcome:
    ok: bool
    ms: float | None = None       # median of the timed runs
    stage: str = ""               # where it failed (STAGES or TRANSIENT); "" when ok
    reason: str = ""              # why, in words (the exception, the error report, the limit)
    max_err: float | None = None  # the correctness gate's max abs error vs float64
    notes: str = ""               # e.g. "recompiled in the timing worker"
    # where the trial's time went, seconds: the backend's own parts (gate, bench) and the
    # pipeline's (compile, time: in a worker's call; *_wait: waiting for a free worker)
    phases: tuple = ()            # ((name, seconds), ...): hashable, like the rest

    @property
    def transient(self) -> bool:
        return self.stage in TRANSIENT

    @classmethod
    def fail(cls, stage: str, reason: str, **kw) -> "Outcome":
        return cls(False, stage=stage, reason=reason[:2000], **kw)


class Backend:
    """What the search needs from a measuring backend. Subclasses are frozen dataclasses."""

    name = "abstract"
    # a timing worker whose process state is no longer trustworthy (a CUDA error poisons the
    # context) sets this; the worker then exits after replying and is restarted
    poisoned = False

    def setup(self, role: str, index: int) -> None:
        """Once per worker process, before anything else. role: "compile" | "time"."""

    def compile(self, variant, problem) -> Outcome | None:
        """Compile ahead of timing (compile workers). None when it compiled."""
        return None

    def measure(self, variant, problem) -> Outcome:
        """Correctness gate, then the median time (timing workers)."""
        raise NotImplementedError

    def warm(self, problem) -> None:
        """Make what the first measure() of `problem` would make first (timing workers; the
        pipeline runs it while the first candidates compile)."""

    def retime(self, variants, problem, rounds: int) -> list:
        """Re-time `variants` interleaved, round after round: [(median ms, spread) | None]."""
        raise NotImplementedError

    def environment(self) -> dict:
        """Provenance of the timing worker: gpu_name, compute_capability, sm_count, driver,
        cuda, torch, triton (tuned_db.Provenance fields)."""
        return {}

    def supports(self, family: str) -> bool:
        """Whether this backend can measure `family`."""
        return True

    def device_count(self) -> int:
        """How many timing workers this host can run (called in the driver process)."""
        return 1
