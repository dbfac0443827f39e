"""The search driver: for each bucket, an Optuna study proposes variants, the pipeline compiles
and measures them in isolated workers, the top few are re-timed interleaved, and the winner
goes to the tuned DB with its provenance.

    run_search(SearchConfig(gpu="H100", trials=40))      # what `flashtune search` calls

Ctrl-C stops asking, marks in-flight trials FAIL (transient: measured again on resume), keeps
every completed trial in the study storage, and writes the best measured variant of each
bucket searched so far to the DB.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import os
import signal
import threading
import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass

import optuna

from . import targets
from .codegen import Variant, kernel_hash
from .families import get as get_family
from .measure import Outcome
from .pipeline import Pipeline
from .search_plan import PlannedBucket, plan
from .search_progress import make_progress
from .search_study import BucketStudy, bucket_label, make_sampler, make_storage, open_study, study_name


@dataclass(frozen=True)
class SearchConfig:
    gpu: str = "auto"
    families: tuple = ("fwd",)     # the CLI's default: every family with a search space
    dtypes: tuple = ("bfloat16",)
    head_dims: tuple = (64, 128)
    causal: tuple = (False, True)
    seqlens: tuple = ()            # () = each family's own grid (search_plan, families/)
    batches: tuple = ()            # () = the standard grid's batch (16k tokens)
    trials: int = 40               # measured variants per bucket (infeasible/duplicates free)
    sampler: str = "tpe"
    seed: int | None = None
    storage: str | None = None     # Optuna storage URL (default: SQLite in the cache folder)
    db: str | None = None          # tuned DB URL (default: TunedDB's)
    workers: int = 1               # timing workers, one per GPU
    compile_workers: int = 0       # 0: one per spare CPU core, at most 16
    resume: bool = True            # False (--fresh): delete the buckets' studies first
    time_budget_s: float | None = None
    top_k: int = 5                 # re-timed interleaved at the end
    retime_rounds: int = 5
    noise: float = 0.01            # "within noise": prefer the simpler config this close
    trial_timeout_s: float = 120.0
    prune: bool = True             # False sends even infeasible variants to the compiler
    write_db: bool = True
    enqueue_default: bool = True   # measure the built-in default first (a good first point)
    replay: str | None = None      # answer from a recording instead of the GPU
    masks: tuple = ((),)           # mask specs (Problem fields as pairs; () = dense), --mask


@dataclass(frozen=True)
class BucketResult:
    label: str
    study: str
    status: str                    # "done" | "interrupted" | "time budget" | "no winner"
    measured: int
    failed: int
    infeasible: int
    duplicates: int
    winner: str | None = None
    ms: float | None = None
    tflops: float | None = None    # speed in `unit` (the family's: TFLOP/s, GB/s for decoding)
    default_tflops: float | None = None
    wall_s: float = 0.0
    unit: str = "TFLOP/s"
    failures: tuple = ()           # (variant name, stage, reason) of this run's failures

    @property
    def speedup(self) -> float | None:
        if self.tflops and self.default_tflops:
            return self.tflops / self.default_tflops
        return None


@dataclass(frozen=True)
class SearchResult:
    target: str
    buckets: tuple
    wall_s: float
    interrupted: bool
    db_written: int


def simplicity(v: Variant) -> tuple:
    """Smaller is simpler: fewer structural departures from the defaults, a shallower
    pipeline, fewer warps, smaller tiles. Ties within noise go to the simpler config.
    bwd: dq="atomic" counts as a departure (its dQ is not deterministic and the built-in
    default is "separate"); the separate dQ kernel's stages, warps and tiles add to the rest."""
    structural = (not v.causal_split) + (v.loads != "pointer") + (v.dq == "atomic")
    return (structural, v.num_stages + v.num_stages2, v.num_warps + v.num_warps2,
            v.block_m * v.block_n + v.block_m2 * v.block_n2)


MAX_NOISE = 0.02


def pick(candidates: list, noise: float):
    """candidates: [(variant, ms, spread)]; the simplest one within noise of the fastest."""
    ok = [c for c in candidates if c[1] is not None]
    if not ok:
        return None
    fastest = min(ok, key=lambda c: c[1])
    # a noisy re-timing widens the band, but never past MAX_NOISE: a simpler config may cost
    # noise, not a real slowdown
    band = fastest[1] * (1 + min(max(noise, fastest[2] or 0.0), MAX_NOISE))
    return min((c for c in ok if c[1] <= band), key=lambda c: (simplicity(c[0]), c[1]))


def _backend(cfg: SearchConfig, target):
    if cfg.replay:
        from .replay import ReplayBackend
        return ReplayBackend(cfg.replay)
    from .measure_gpu import GpuBackend
    return GpuBackend(smem_limit=target.smem_per_block,
                      flush_bytes=max(2 * target.l2_bytes, 256 << 20))


def resolve_target(cfg: SearchConfig, *, dry_run: bool = False):
    """The target to search; raises targets.GpuMismatch with what was found."""
    if dry_run:
        return targets.resolve(cfg.gpu, present=False)
    if cfg.replay:
        from .replay import read_recording
        recorded = targets.get(read_recording(cfg.replay)[0]["gpu"])
        return targets.resolve(cfg.gpu, present=recorded)
    return targets.resolve(cfg.gpu)


def plan_of(cfg: SearchConfig, target) -> list[PlannedBucket]:
    return plan(target, cfg.families, cfg.dtypes, cfg.head_dims, cfg.causal, cfg.seqlens,
                cfg.batches, cfg.masks)


def _default_variant(pb: PlannedBucket) -> Variant | None:
    """The built-in default the dispatcher would run (the final pick re-times it)."""
    from .defaults import default_variant
    try:
        return _with_masks(pb, default_variant(pb.bucket.family, pb.problem.head_dim,
                                               pb.problem.dtype, arch=pb.space.target.arch))
    except KeyError:
        return None


def _with_masks(pb: PlannedBucket, variant: Variant) -> Variant:
    """`variant` with the mask code the bucket's problem needs (the space pins the same)."""
    flags = {n: v for n, v in pb.space.pinned if n in ("window", "softcap", "block_sparse")}
    return dataclasses.replace(variant, **flags) if flags else variant


def _first_points(pb: PlannedBucket) -> list[Variant]:
    """Measured first (good points for TPE to start from): the family's seeds, its built-in
    default first (bwd: both dQ schemes' defaults, so both are in the study from the start)."""
    from .families import get
    return [_with_masks(pb, v) for v in get(pb.bucket.family).seed_variants(
        pb.problem.head_dim, pb.problem.dtype, arch=pb.space.target.arch)]


class _Interrupted(Exception):
    pass


@contextlib.contextmanager
def _ctrl_c(stop: threading.Event):
    """First Ctrl-C sets `stop` (the loop then stops at a point where storage is consistent);
    a second one interrupts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
    prev = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, prev)


def search_bucket(bs: BucketStudy, pipeline: Pipeline, trials: int, deadline: float | None,
                  progress, *, max_asks: int | None = None, until=None,
                  stop: threading.Event | None = None) -> str:
    """Ask, measure and tell until `trials` distinct variants are measured (by every process
    sharing the study), the feasible space is exhausted, or the deadline passes."""
    problem = bs.problem
    feasible = len(bs.space.feasible) if bs.prune else len(bs.space.variants())
    inflight: dict = {}        # future -> (trial, variant)
    waiting: dict = {}         # variant key -> [trials proposing a variant being measured]
    max_asks = max_asks or 20 * trials + 200
    asks, idle_asks = 0, 0
    status = "done"

    def settle(done) -> None:
        for f in done:
            trial, variant = inflight.pop(f)
            outcome = f.result()
            bs.tell(trial, variant, outcome)
            for t in waiting.pop(variant.key, []):
                bs.tell(t, variant, "duplicate" if not outcome.transient else outcome)
            progress.trial(bs.measured(), bs.best_tflops())
            if not outcome.ok and not outcome.transient:
                bs.failures.append((variant.name, outcome.stage, outcome.reason))

    try:
        while True:
            if stop is not None and stop.is_set():
                raise KeyboardInterrupt
            # tell what is done before asking more: the sampler sees results as soon as they
            # exist, and fewer of its proposals are lies (constant liar)
            settle([f for f in inflight if f.done()])
            budget_left = bs.measured() + len(inflight) < min(trials, feasible)
            if until is not None and until(bs):
                budget_left = False
            if deadline is not None and time.monotonic() > deadline:
                status = "time budget"
                budget_left = False
            if idle_asks > 200 or asks >= max_asks:
                budget_left = False  # the sampler keeps proposing what is known: it has converged
            if budget_left and len(inflight) < pipeline.depth:
                trial, variant, answer = bs.ask()
                asks += 1
                if answer is None and variant.key in waiting:
                    waiting[variant.key].append(trial)  # same variant in flight: wait for it
                    continue
                if answer is not None:
                    bs.tell(trial, variant, answer)
                    idle_asks += 1
                    continue
                idle_asks = 0
                inflight[pipeline.submit(variant, problem)] = (trial, variant)
                waiting[variant.key] = []
                continue
            if not inflight:
                break
            done, _ = wait(list(inflight), timeout=0.5, return_when=FIRST_COMPLETED)
            settle(done)
    except KeyboardInterrupt:
        for trial, variant in inflight.values():
            bs.tell(trial, variant, Outcome.fail("interrupted", "Ctrl-C"))
            for t in waiting.pop(variant.key, []):
                bs.tell(t, variant, Outcome.fail("interrupted", "Ctrl-C"))
        raise _Interrupted() from None
    return status


def run_search(cfg: SearchConfig, *, backend=None, db=None, progress=None,
               target=None) -> SearchResult:
    t_start = time.monotonic()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    target = target or resolve_target(cfg)
    backend = backend or _backend(cfg, target)
    n_dev = backend.device_count()
    if cfg.workers < 1 or cfg.workers > n_dev:
        raise ValueError(f"--workers {cfg.workers}: this host has {n_dev} GPU(s)")
    planned = plan_of(cfg, target)
    missing = [f for f in cfg.families if not backend.supports(f)]
    if missing:
        raise ValueError(f"--family {', '.join(missing)}: the {backend.name} backend has no "
                         "measuring function for it (its flashtune/families/ entry)")
    progress = progress or make_progress()
    cw = cfg.compile_workers or max(1, min(16, (os.cpu_count() or 2) - cfg.workers))
    pipeline = Pipeline(backend, devices=tuple(range(cfg.workers)), compile_workers=cw,
                        trial_timeout=cfg.trial_timeout_s).start()
    run = _Run(cfg, planned, pipeline, make_storage(cfg.storage), db, progress, t_start)
    stop = threading.Event()
    progress.start(len(planned), cfg.trials * len(planned))
    try:
        with _ctrl_c(stop):
            run.buckets(stop)
    except KeyboardInterrupt:  # a second Ctrl-C, or one during a final pick
        run.interrupted = True
    finally:
        pipeline.close(kill=run.interrupted)
        progress.close()
    return SearchResult(target.short, tuple(run.results), time.monotonic() - t_start,
                        run.interrupted, run.written)


class _Run:
    """The state of one search across its buckets."""

    def __init__(self, cfg, planned, pipeline, storage, db, progress, t_start):
        self.cfg, self.planned, self.pipeline, self.storage = cfg, planned, pipeline, storage
        self.db, self.progress = db, progress
        self.deadline = t_start + cfg.time_budget_s if cfg.time_budget_s else None
        self.results: list[BucketResult] = []
        self.written = 0
        self.interrupted = False

    def buckets(self, stop: threading.Event) -> None:
        cfg = self.cfg
        for i, pb in enumerate(self.planned):
            if stop.is_set():
                self.interrupted = True
                return
            label, name = bucket_label(pb.bucket), study_name(pb.space, pb.bucket)
            study = open_study(self.storage, name, make_sampler(cfg.sampler, pb.space, cfg.seed),
                               fresh=not cfg.resume)
            bs = BucketStudy(study, pb.space, pb.problem, prune=cfg.prune)
            bs.reap_abandoned()
            default = _default_variant(pb)
            if cfg.enqueue_default and not study.trials:
                known = set(pb.space.variants())
                for v in _first_points(pb):
                    if v in known:
                        bs.enqueue(v)
            self.progress.bucket_start(label, cfg.trials, bs.measured())
            t_b = time.monotonic()
            bucket_deadline = None
            if self.deadline is not None:  # share what is left evenly among the buckets left
                bucket_deadline = t_b + (self.deadline - t_b) / (len(self.planned) - i)
            try:
                status = search_bucket(bs, self.pipeline, cfg.trials, bucket_deadline,
                                       self.progress, stop=stop)
                pipeline = self.pipeline
            except _Interrupted:
                # what is already won is kept: the best measured variant, without re-timing
                self.interrupted = True
                self.pipeline.close(kill=True)
                status, pipeline = "interrupted", None
            rec, res = _finish(bs, pipeline, self.pipeline.info, pb, label, name, cfg, status,
                               t_b, default)
            self.results.append(res)
            if rec is not None and cfg.write_db:  # saved as soon as it is known
                _write(cfg, self.db, [rec])
                self.written += 1
            self.progress.bucket_end(label, _line(res))
            if self.interrupted:
                return


def _line(r: BucketResult) -> str:
    if r.winner is None:
        return _no_winner(r)
    sp = f", {r.speedup:.2f}x the default" if r.speedup else ""
    return (f"{r.status}: {r.winner} {r.tflops:.1f} {r.unit}{sp} ({r.measured} measured, "
            f"{r.failed} failed, {r.infeasible} infeasible, {r.duplicates} duplicates)")


def _no_winner(r: BucketResult) -> str:
    """What happened in a bucket that has no winner: how many candidates failed and where."""
    stages = collections.Counter(stage for _, stage, _ in r.failures)
    where = ", ".join(f"{n} at {stage}" for stage, n in stages.most_common())
    what = (f"{r.measured} measured, {r.failed} failed{f' ({where})' if where else ''}, "
            f"{r.infeasible} infeasible, {r.duplicates} duplicates")
    why = "no candidate passed" if r.measured else "no candidate was measured"
    if r.status != "no winner":  # stopped early: say why, then what it had
        why = f"{r.status}: {why} yet"
    return f"{why}: {what}"


def _finish(bs: BucketStudy, pipeline, info, pb, label, name, cfg, status, t_b, default):
    """Re-time the top few (plus the default) interleaved and pick the winner. Without a
    pipeline (Ctrl-C) the search's own numbers decide."""
    top = bs.top(cfg.top_k)
    by_key = {v.key: (v, a) for v, a in top}
    cands = [v for v, _ in top]
    if default is not None and default.key not in by_key:
        # measured first, so it passed the gate here unless it failed: then it may win the
        # re-timing even if the study's noisy first numbers left it out of the top k
        passed = bs.passed(default)
        if passed is not None:
            by_key[default.key] = (default, passed)
        if pipeline is not None:
            cands.append(default)
    timed = pipeline.retime(cands, pb.problem, cfg.retime_rounds) if (pipeline and cands) else []
    rows = []
    for i, v in enumerate(cands):
        t = timed[i] if i < len(timed) else None
        if t is None and v.key in by_key:
            t = (by_key[v.key][1]["ms"], 0.0)
        rows.append((v, t[0] if t else None, t[1] if t else None))
    fam = get_family(pb.bucket.family)
    tf = (lambda ms: fam.throughput(pb.problem, ms) if ms else None)  # in fam.unit
    default_ms = next((ms for v, ms, _ in rows if default is not None and v == default), None)
    # the default may only win if it passed the gate in this study
    eligible = [r for r in rows if r[0].key in by_key]
    win = pick(eligible, cfg.noise)
    counts = bs.counts
    common = dict(label=label, study=name, unit=fam.unit, measured=bs.measured(), failed=counts["failed"],
                  infeasible=counts["infeasible"], duplicates=counts["duplicate"],
                  default_tflops=tf(default_ms), wall_s=time.monotonic() - t_b,
                  failures=tuple(bs.failures))
    if win is None:
        return None, BucketResult(status="no winner" if status == "done" else status, **common)
    v, ms, _ = win
    runner_ups = tuple((r[0].name, float(r[1])) for r in sorted(eligible, key=lambda r: r[1] or 1e30)
                       if r[0] != v and r[1] is not None)
    rec = _record(pb, v, ms, tf(ms), by_key[v.key][1].get("max_err", 0.0), runner_ups,
                  info, bs)
    study_attrs = {"winner": v.name, "winner_ms": ms}
    for k, val in study_attrs.items():
        bs.study.set_user_attr(k, val)
    return rec, BucketResult(status=status, winner=v.name, ms=ms, tflops=tf(ms), **common)


def _record(pb, v, ms, tflops, max_err, runner_ups, info, bs):
    from . import __version__
    from .tuned_db import Provenance, Record

    info = info or {}
    prov = Provenance(
        gpu_name=info.get("gpu_name") or bs.space.target.name,
        compute_capability=info.get("compute_capability")
        or ".".join(map(str, bs.space.target.capability)),
        sm_count=int(info.get("sm_count") or bs.space.target.sm_count),
        driver=str(info.get("driver", "")), cuda=str(info.get("cuda", "")),
        torch=str(info.get("torch", "")), triton=str(info.get("triton", "")),
        flashtune=__version__, template_hash=kernel_hash(v),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        source="search")
    return Record(gpu=targets.slug_of(prov.gpu_name), bucket=pb.bucket, variant=v,
                  median_ms=float(ms), throughput=float(tflops),
                  unit=get_family(pb.bucket.family).unit,
                  max_err=float(max_err or 0.0), provenance=prov, runner_ups=runner_ups)


def _write(cfg: SearchConfig, db, records) -> None:
    if not records:
        return
    if db is None:
        from .tuned_db import TunedDB
        db = TunedDB(cfg.db)
    for r in records:
        db.put(r)
