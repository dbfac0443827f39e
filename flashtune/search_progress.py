"""Progress of a search: rich bars on a terminal (overall and per bucket, best-so-far TFLOP/s,
ETA), plain lines otherwise (logs, CI, pipes)."""
from __future__ import annotations

import sys
import time


def _fmt_s(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class PlainProgress:
    """One line per bucket start and end, and one every `every` seconds in between."""

    def __init__(self, stream=None, every: float = 10.0):
        self.stream = stream or sys.stderr
        self.every = every

    def _say(self, msg: str) -> None:
        print(msg, file=self.stream, flush=True)

    def start(self, n_buckets: int, total_trials: int) -> None:
        self.n_buckets, self.total, self.done = n_buckets, total_trials, 0
        self.t0 = time.monotonic()
        self.i = 0

    def bucket_start(self, label: str, trials: int, already: int) -> None:
        self.i += 1
        self.label, self.trials, self.n = label, trials, already
        self.bt0 = time.monotonic()
        self.last = self.bt0
        self._say(f"[{self.i}/{self.n_buckets}] {label}: {already}/{trials} measured so far")

    def trial(self, measured: int, best: float) -> None:
        self.done += max(0, measured - self.n)
        self.n = measured
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            rate = (now - self.t0) / max(1, self.done)
            eta = rate * max(0, self.total - self.done)
            self._say(f"[{self.i}/{self.n_buckets}] {self.label}: {measured}/{self.trials}, "
                      f"best {best:.1f}, ETA {_fmt_s(eta)}")

    def bucket_end(self, label: str, line: str) -> None:
        self._say(f"[{self.i}/{self.n_buckets}] {label}: {line} "
                  f"({_fmt_s(time.monotonic() - self.bt0)})")

    def log(self, msg: str) -> None:
        self._say(msg)

    def close(self) -> None:
        pass


class RichProgress(PlainProgress):
    def __init__(self):
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        self.console = Console(stderr=True)
        self.bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("best {task.fields[best]:.1f}"),
                             TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                             console=self.console, transient=False)

    def start(self, n_buckets: int, total_trials: int) -> None:
        self.n_buckets, self.i = n_buckets, 0
        self.bars.start()
        self.overall = self.bars.add_task(f"all {n_buckets} buckets", total=total_trials, best=0.0)
        self.task = None

    def bucket_start(self, label: str, trials: int, already: int) -> None:
        self.i += 1
        self.label, self.n = label, already
        self.bt0 = time.monotonic()
        if self.task is not None:
            self.bars.remove_task(self.task)
        self.task = self.bars.add_task(f"[{self.i}/{self.n_buckets}] {label}", total=trials,
                                       completed=min(already, trials), best=0.0)
        self.bars.update(self.overall, advance=min(already, trials))

    def trial(self, measured: int, best: float) -> None:
        step = max(0, measured - self.n)
        self.n = measured
        self.bars.update(self.task, completed=measured, best=best)
        self.bars.update(self.overall, advance=step)

    def bucket_end(self, label: str, line: str) -> None:
        self.bars.console.print(f"[{self.i}/{self.n_buckets}] {label}: {line} "
                                f"({_fmt_s(time.monotonic() - self.bt0)})")

    def log(self, msg: str) -> None:
        self.bars.console.print(msg)

    def close(self) -> None:
        self.bars.stop()


class NoProgress(PlainProgress):
    def __init__(self):
        super().__init__()
        self.start(0, 0)
        self.bucket_start("", 0, 0)

    def _say(self, msg: str) -> None:
        pass


def make_progress(mode: str = "auto"):
    """mode: "auto" (bars on a terminal, lines otherwise), "bars", "lines", "none"."""
    if mode == "none":
        return NoProgress()
    if mode == "bars" or (mode == "auto" and sys.stderr.isatty()):
        try:
            return RichProgress()
        except ImportError:
            pass
    return PlainProgress()
