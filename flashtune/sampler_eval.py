"""Search efficiency, measured offline: replay a recorded exhaustive sweep and count how many
measured trials each sampler needs to get within 2% of the exhaustive best.

    python3 bench/compare_samplers.py search_spaces/sweeps/h100-*.jsonl   # the docs table

`synthesize` makes a recording of a made-up but smooth landscape, for tests (and for trying
the comparison before real sweeps exist).
"""
from __future__ import annotations

import hashlib
import math
import statistics
from dataclasses import dataclass

import optuna

from . import targets
from .measure import Outcome
from .pipeline import Pipeline
from .problem import Bucket, Problem
from .replay import ReplayBackend, read_recording, write_recording
from .search import search_bucket
from .search_progress import NoProgress
from .search_space import Space
from .search_study import BucketStudy, make_sampler


@dataclass(frozen=True)
class Trace:
    sampler: str
    seed: int
    trials: int | None       # measured trials until within `within` of the best (None: never)
    exhaustive: int          # measured variants of the recording in this space


def _unit(name: str, salt: str = "") -> float:
    return int(hashlib.sha256((salt + name).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def synthesize(path, target: targets.Target, problems, *, fail_rate: float = 0.03,
               faults: dict | None = None, **meta) -> None:
    """Write a recording of every feasible variant: a smooth optimum around m128-n64, warps
    matched to block_m, 3 stages, TMA a little faster, +-3% noise; some failures."""
    faults = faults or {}
    rows = []
    for p in problems:
        space = Space.build(p.family, target, p)
        b = Bucket.of(p)
        for v in space.feasible:
            n = v.name
            if _unit(n, "fail") < fail_rate:
                rows.append((b, n, Outcome.fail("gate", "max err 1e-1 > tolerance (synthetic)")))
                continue
            score = (math.exp(-(math.log2(v.block_m) - 7) ** 2 / 2)
                     * math.exp(-(math.log2(v.block_n) - 6) ** 2 / 3)
                     * math.exp(-(math.log2(v.block_m / (16 * v.num_warps)) - 0.5) ** 2 / 2)
                     * math.exp(-(v.num_stages - 3) ** 2 / 8)
                     * (1.1 if v.loads == "descriptor" else 1.0)
                     * (1.05 if v.causal_split else 1.0)
                     * (1 + 0.06 * (_unit(n, "noise") - 0.5)))
            ms = p.flops() / (400e12 * score) * 1e3
            f = faults.get(n)
            if f in ("compile", "gate"):  # recorded failures
                rows.append((b, n, Outcome.fail(f, f"{f} failure (synthetic)")))
            else:  # acted out in the worker: "hang", "crash", "poison"
                rows.append((b, n, Outcome(True, ms, max_err=1e-3), {"fault": f} if f else {}))
    write_recording(path, {"gpu": target.short, "gpu_name": target.name, "synthetic": True,
                           "sm_count": target.sm_count, **meta}, problems, rows)


def trials_to_best(recording: str, problem: Problem, sampler: str, seed: int, *,
                   within: float = 0.02, n_startup_trials: int = 10) -> Trace:
    """Run one sampler on a replayed bucket until a measured variant is within `within` of
    the recording's best over the same space."""
    meta, lines, _ = read_recording(recording)
    target = targets.get(meta["gpu"])
    space = Space.build(problem.family, target, problem)
    bkey = Bucket.of(problem).key
    times = {v.key: lines[(bkey, v.name)]["ms"] for v in space.feasible
             if (bkey, v.name) in lines}
    ok = [t for t in times.values() if t is not None]
    if not ok:
        raise ValueError(f"{recording}: nothing recorded for {Bucket.of(problem)}")
    goal = min(ok) * (1 + within)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=make_sampler(
        sampler, space, seed, n_startup_trials=n_startup_trials))
    bs = BucketStudy(study, space, problem)
    pipeline = Pipeline(ReplayBackend(recording), inline=True)
    hit = {}

    def reached(bs_):
        for key, (value, attrs) in bs_._known.items():
            if attrs.get("ms") is not None and attrs["ms"] <= goal and "n" not in hit:
                hit["n"] = bs_.measured()
        return "n" in hit

    search_bucket(bs, pipeline, len(times), None, NoProgress(), until=reached,
                  draw_after=None)  # the sampler's own proposals, nothing drawn for it
    return Trace(sampler, seed, hit.get("n"), len(times))


def compare(recording: str, problems, samplers=("tpe", "cmaes", "random", "grid"),
            seeds=range(10), within: float = 0.02) -> list[dict]:
    """One row per (bucket, sampler): median and worst trials-to-within-2% over the seeds,
    as counts and as a fraction of the exhaustive count."""
    from .search_study import bucket_label

    rows = []
    for p in problems:
        for s in samplers:
            traces = [trials_to_best(recording, p, s, seed, within=within) for seed in seeds]
            n = traces[0].exhaustive
            got = [t.trials if t.trials is not None else n for t in traces]
            rows.append({"bucket": bucket_label(Bucket.of(p)), "sampler": s, "exhaustive": n,
                         "median": statistics.median(got), "worst": max(got),
                         "median_frac": statistics.median(got) / n, "worst_frac": max(got) / n,
                         "seeds": len(got)})
    return rows


def table(rows: list[dict]) -> str:
    """Markdown, as docs/search.md shows it."""
    out = ["| bucket | sampler | exhaustive | median trials | worst | median % of exhaustive |",
           "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        out.append(f"| {r['bucket']} | {r['sampler']} | {r['exhaustive']} | {r['median']:g} | "
                   f"{r['worst']} | {100 * r['median_frac']:.1f}% |")
    return "\n".join(out)
