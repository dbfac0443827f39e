"""Progress of a bench run with an ETA: a bar redrawn in place on a terminal, plain lines
otherwise (logs, CI, the device machine). Either way each finished case prints one line."""
from __future__ import annotations

import sys
import time

from ..search_progress import _fmt_s


class Progress:
    def __init__(self, total: int, mode: str = "auto", stream=None):
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if getattr(self.stream, "isatty", lambda: False)() else "lines"
        self.mode, self.total, self.done = mode, total, 0
        self.t0 = time.monotonic()
        self._drawn = False

    def eta(self) -> str:
        if not self.done:
            return "?"
        spent = time.monotonic() - self.t0
        return _fmt_s(spent / self.done * (self.total - self.done))

    def _bar(self, label: str) -> str:
        width = 24
        fill = int(width * self.done / max(1, self.total))
        return (f"[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                f"{_fmt_s(time.monotonic() - self.t0)} ETA {self.eta()}  {label[:50]}")

    def step(self, label: str) -> None:
        """One (case, peer) finished."""
        self.done += 1
        if self.mode == "bar":
            self.stream.write("\r\033[K" + self._bar(label))
            self.stream.flush()
            self._drawn = True

    def line(self, text: str) -> None:
        """A finished case's summary (above the bar on a terminal)."""
        if self.mode == "none":
            return
        if self.mode == "bar":
            self.stream.write("\r\033[K" + text + "\n" + self._bar(""))
        else:
            pct = 100 * self.done / max(1, self.total)
            self.stream.write(f"[{self.done}/{self.total} {pct:3.0f}% ETA {self.eta()}] {text}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.mode == "bar" and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
