"""The replay backend: answers from recorded timings (bench/sweep.py writes them), so the
search, resume and fault handling run on a machine without a GPU.

A recording is JSON lines: one {"kind": "meta", "gpu": "H100", "gpu_name": ..., ...}, then
{"kind": "trial", "bucket": {Bucket fields}, "variant": name, "ms": float | null, "stage",
"reason", "max_err"} per measured variant ("bucket" lines with the problem and space size may
sit between); an optional "spread" is what `retime` reports as its relative spread (else 0). Tests add "fault": "hang" | "crash" | "poison" to act a failure out in the worker
process the way a real kernel would (hang until killed, die by a signal, break the context).
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from .measure import Backend, Outcome
from .problem import Bucket, Problem

_cache: dict[str, tuple[dict, dict, dict]] = {}


def read_recording(path) -> tuple[dict, dict, dict]:
    """(meta, {(bucket key, variant name): trial line}, {bucket key: Problem}) of a recording
    (cached per path)."""
    path = str(path)
    if path not in _cache:
        meta, trials, problems = {}, {}, {}
        with open(path) as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    d = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e})") from None
                kind = d.get("kind", "trial")
                if kind == "meta":
                    meta.update(d)
                elif kind == "trial":
                    trials[(Bucket(**d["bucket"]).key, d["variant"])] = d
                elif kind == "bucket":
                    problems[Bucket(**d["bucket"]).key] = Problem(**d["problem"])
        if not meta.get("gpu"):
            raise ValueError(f"{path}: no meta line naming the GPU it was recorded on")
        _cache[path] = (meta, trials, problems)
    return _cache[path]


def recorded_problems(path) -> list[Problem]:
    """The problems a recording timed, one per bucket, in recording order."""
    return list(read_recording(path)[2].values())


@dataclass(frozen=True)
class ReplayBackend(Backend):
    path: str
    delay_s: float = 0.0   # per measurement (or the meta line's delay_s): a search that takes
    #                        a while, for tests that interrupt one or time its workers
    devices: int = 64      # how many timing workers ("GPUs") --workers may ask for

    name = "replay"

    def setup(self, role: str, index: int) -> None:
        # which "GPU" this timing worker replays: pinned the way GpuBackend pins a real one
        # (the index-th entry of CUDA_VISIBLE_DEVICES, which --gpus sets per search process)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(index + 1)]
        object.__setattr__(self, "_index", ids[index] if index < len(ids) else str(index))

    def _line(self, variant, problem) -> dict | None:
        return read_recording(self.path)[1].get((Bucket.of(problem).key, variant.name))

    def compile(self, variant, problem):
        # the meta line's compile_delay_s: a compile worker's latency (a search whose trials
        # are bound by compiling, as on a GPU host with a warm cache, not by timing)
        delay = float(read_recording(self.path)[0].get("compile_delay_s", 0.0))
        if delay:
            time.sleep(delay)
        d = self._line(variant, problem)
        if d is not None and d.get("stage") == "compile":
            return Outcome.fail("compile", d.get("reason") or "compile error (replayed)")
        return None

    def measure(self, variant, problem) -> Outcome:
        delay = self.delay_s or float(read_recording(self.path)[0].get("delay_s", 0.0))
        if delay:
            time.sleep(delay)
        d = self._line(variant, problem)
        if d is None:
            return Outcome.fail("gate", f"{variant.name} is not in the recording {self.path}")
        fault = d.get("fault")
        if fault == "hang":
            time.sleep(1e6)
        elif fault == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        elif fault == "poison":
            object.__setattr__(self, "poisoned", True)
            return Outcome.fail("launch", "CUDA error: an illegal memory access was "
                                          "encountered (replayed)")
        if d.get("ms") is None:
            return Outcome.fail(d.get("stage") or "timing", d.get("reason") or "failed (replayed)",
                                max_err=d.get("max_err"))
        return Outcome(True, float(d["ms"]), max_err=d.get("max_err"),
                       notes=f"replayed on device {self.__dict__.get('_index', 0)}")

    def retime(self, variants, problem, rounds: int) -> list:
        out = []
        for v in variants:
            d = self._line(v, problem)
            ok = d is not None and d.get("ms") is not None and not d.get("fault")
            out.append((float(d["ms"]), float(d.get("spread") or 0.0)) if ok else None)
        return out

    def environment(self) -> dict:
        meta = read_recording(self.path)[0]
        keys = ("gpu_name", "compute_capability", "sm_count", "driver", "cuda", "torch", "triton")
        env = {k: str(meta.get(k, "")) for k in keys}
        env["sm_count"] = int(meta.get("sm_count") or 0)
        env["replay"] = str(Path(self.path).name)
        return env

    def device_count(self) -> int:
        return self.devices

    def gpu(self) -> str:
        return read_recording(self.path)[0]["gpu"]


def bucket_line(problem: Problem, **extra) -> str:
    return json.dumps({"kind": "bucket", "bucket": dataclasses.asdict(Bucket.of(problem)),
                       "problem": dataclasses.asdict(problem), **extra}, sort_keys=True)


def trial_line(bucket: Bucket, name: str, o: Outcome, **extra) -> str:
    return json.dumps({"kind": "trial", "bucket": dataclasses.asdict(bucket), "variant": name,
                       "ms": o.ms, "stage": o.stage, "reason": o.reason, "max_err": o.max_err,
                       **extra}, sort_keys=True)


def write_recording(path, meta: dict, problems, rows) -> None:
    """problems: the timed problems; rows: (bucket, variant name, Outcome[, extra dict])."""
    with open(path, "w") as f:
        f.write(json.dumps({"kind": "meta", **meta}, sort_keys=True) + "\n")
        for p in problems:
            f.write(bucket_line(p) + "\n")
        for row in rows:
            f.write(trial_line(*row[:3], **(row[3] if len(row) > 3 else {})) + "\n")
    _cache.pop(str(path), None)
