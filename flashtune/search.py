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
import json
import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass

import optuna

from . import targets
from .codegen import Variant, kernel_hash
from .families import get as get_family
from .pipeline import Pipeline
from .search_plan import PlannedBucket, plan
from .search_claims import Heartbeat, Liveness, claim, me, same
from .search_flight import Flight
from .search_progress import make_progress
from .search_study import BucketStudy, bucket_label, make_sampler, make_storage, open_study, study_name
from .timeline import mark

log = logging.getLogger("flashtune.search")


@dataclass(frozen=True)
class SearchConfig:
    gpu: str = "auto"
    families: tuple = ("fwd",)     # the CLI's default: every family with a search space
    dtypes: tuple = ("bfloat16",)
    head_dims: tuple = ()          # () = each family's own (Family.head_dims)
    causal: tuple = (False, True)
    seqlens: tuple = ()            # () = each family's own grid (search_plan, families/)
    batches: tuple = ()            # () = the standard grid's batch (16k tokens)
    trials: int = 40               # measured variants per bucket (infeasible/duplicates free)
    sampler: str = "tpe"
    seed: int | None = None
    storage: str | None = None     # Optuna storage URL (default: journal file in the cache)
    db: str | None = None          # tuned DB URL (default: TunedDB's)
    workers: int = 1               # timing workers, one per GPU
    gpus: tuple = ()               # one search process per GPU (--gpus 0,1), sharing the storage
    tag: str = ""                  # names this process in logs and results ("gpu1")
    compile_workers: int = 0       # 0: one per spare CPU core, at most 16
    resume: bool = True            # False (--fresh): delete the buckets' studies first
    time_budget_s: float | None = None
    in_order: bool = False         # the budget goes to the buckets in order; the rest are left
    top_k: int = 5                 # re-timed interleaved at the end
    retime_rounds: int = 5
    noise: float = 0.01            # "within noise": prefer the simpler config this close
    trial_timeout_s: float = 30.0
    prune: bool = True             # False sends even infeasible variants to the compiler
    write_db: bool = True
    enqueue_default: bool = True   # measure the built-in default first (a good first point)
    neighbour_seeds: int = 3       # and the winners of this many nearest searched buckets (below)
    table_seeds: int = 3           # and each shipped same-arch table's best this many (below)
    tables_dir: str | None = None  # where those tables are (default: the shipped tuned_db/tables)
    replay: str | None = None      # answer from a recording instead of the GPU
    masks: tuple = ((),)           # mask specs (Problem fields as pairs; () = dense), --mask
    groups: tuple = (1,)           # q heads per K/V head of the dense grid's buckets, --group


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
    by: str = ""                   # the process that picked the winner ("gpu1", "host:pid")
    busy: int = 0                  # proposals another process was measuring (not repeated)

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
    measured: int = 0              # variants measured by this run (every process of it)
    notes: tuple = ()              # what went wrong with a process of --gpus

    @property
    def trials_per_s(self) -> float:
        return self.measured / self.wall_s if self.wall_s > 0 else 0.0


def simplicity(v: Variant) -> tuple:
    """Smaller is simpler: fewer structural departures from the defaults, a shallower
    pipeline, fewer warps, smaller tiles. Ties within noise go to the simpler config.
    bwd: dq="atomic" counts as a departure (its dQ is not deterministic and the built-in
    default is "separate"), as does "fused" (not the default: its dQ tiles share the dK/dV
    kernel's warps and stages, which would otherwise look like fewer); the separate dQ kernel's
    stages, warps and tiles add to the rest."""
    structural = (not v.causal_split) + (v.loads != "pointer") + (v.dq in ("atomic", "fused"))
    return (structural, v.num_stages + v.num_stages2, v.num_warps + v.num_warps2,
            v.block_m * v.block_n + v.block_m2 * v.block_n2)


MAX_NOISE = 0.02


def pick(candidates: list, noise: float, default: Variant | None = None):
    """candidates: [(variant, ms, spread)]; the built-in default if it is within noise of the
    fastest, else the simplest one within noise of the fastest."""
    ok = [c for c in candidates if c[1] is not None]
    if not ok:
        return None
    fastest = min(ok, key=lambda c: c[1])
    # a noisy re-timing widens the band, but never past MAX_NOISE: a simpler config may cost
    # noise, not a real slowdown
    band = fastest[1] * (1 + min(max(noise, fastest[2] or 0.0), MAX_NOISE))
    within = [c for c in ok if c[1] <= band]
    # the default first: a "simpler" record up to MAX_NOISE slower than it would make tuning
    # a loss (4 H100 splitkv buckets, 1.6-2.1% slower than their default)
    for c in within:
        if default is not None and c[0] == default:
            return c
    return min(within, key=lambda c: (simplicity(c[0]), c[1]))


def _backend(cfg: SearchConfig, target):
    if cfg.replay:
        from .replay import ReplayBackend
        return ReplayBackend(cfg.replay)
    from .measure_gpu import GpuBackend
    return GpuBackend(smem_limit=target.smem_per_block,
                      flush_bytes=max(2 * target.l2_bytes, 256 << 20),
                      capability=10 * target.capability[0] + target.capability[1])


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
                cfg.batches, cfg.masks, cfg.groups)


def default_for(pb: PlannedBucket) -> Variant | None:
    """The built-in default the dispatcher would run for a planned bucket (the final pick
    re-times it; bench/tuning_value.py measures the tuned table against it)."""
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
    default first (bwd: both dQ schemes' defaults, so both are in the study from the start), each
    as a point of the bucket's space. Seeds are per head dim: a field the bucket does not search
    (a causal tile order in a non-causal bucket) goes back to its default, where the seed was
    dropped whole before (session 32: the D=64 non-causal searches never started from the
    three-consumer seeds, which carry a tile order; three consumers won every such bucket from
    1k on once measured there)."""
    from .families import get
    out = []
    for v in get(pb.bucket.family).seed_variants(pb.problem.head_dim, pb.problem.dtype,
                                                 arch=pb.space.target.arch):
        point = pb.space.project(_with_masks(pb, v))
        if point is not None and point not in out:
            out.append(point)
    return out


def neighbour_winners(storage, planned: list, pb: PlannedBucket, k: int) -> list[Variant]:
    """The winners already picked for the `k` buckets of `planned` nearest to `pb` that share
    its kernel class (Bucket.log_distance), as points of pb's space: measured first with the
    default, so a bucket's record is no slower than a neighbour's config it could run (the H200
    table's first tuning-value run found the config best over the whole grid 5% faster than
    the fwd records, 4% than the bwd ones: TPE's 40 trials had not proposed it). Read when a
    process starts the bucket, so the buckets searched before it (any process's) count."""
    if k <= 0:
        return []
    rivals = {study_name(o.space, o.bucket): o for o in planned
              if o is not pb and o.bucket.same_kernel_class(pb.bucket)}
    if not rivals:
        return []
    found = sorted((rivals[s.study_name].bucket.log_distance(pb.bucket), s.user_attrs["winner"])
                   for s in optuna.get_all_study_summaries(storage, include_best_trial=False)
                   if s.study_name in rivals and s.user_attrs.get("winner"))
    out = []
    for _, name in found:
        v = _with_masks(pb, Variant.parse(name))
        if pb.space.contains(v) and v not in out:
            out.append(v)
        if len(out) == k:
            break
    return out


def table_winners(pb: PlannedBucket, k: int, tables_dir=None) -> list[Variant]:
    """The best `k` variants (winner, then runner-ups) that each shipped table of pb's
    architecture recorded for pb's bucket, this GPU's own table first, then the winners of the
    `k` nearest buckets of its kernel class in those tables (Bucket.log_distance): measured first
    with the default, so a GPU searched again, or a new GPU of a tuned architecture, starts from
    what won there (the H200's 160 buckets took 1,259 s of 40 trials each; a sibling's winners
    let fewer trials keep most of the value). The neighbours' winners count because a bucket's
    next bucket opens while its last trials finish, before its pick (neighbour_winners reads
    picks): the D=256 non-causal N=512 re-search never measured the N=1k record's tile, which
    ran it 11% faster (session 25). Stale records count: only the name is used. Each winner's
    twins (Family.winner_twins: hopper_fwd's causal winners with head_order as their tile order)
    follow it, so a field added since the table was searched is tried on the point that won."""
    if k <= 0:
        return []
    from .families import get
    own, near = [], []
    for r in _table_records(pb.space.target, tables_dir):
        if r.bucket == pb.bucket:
            own += [(name, i == 0) for i, name in
                    enumerate(([r.variant.name] + [n for n, _ in r.runner_ups])[:k])]
        elif pb.bucket.same_kernel_class(r.bucket):
            near.append((pb.bucket.log_distance(r.bucket), r.variant.name))
    names = own + [(name, True) for _, name in sorted(near, key=lambda x: x[0])[:k]]
    out = []
    for name, won in names:
        try:
            v = _with_masks(pb, Variant.parse(name))
        except ValueError:
            continue
        for w in [v] + (get(v.family).twins_of(v) if won else []):
            if pb.space.contains(w) and w not in out:
                out.append(w)
    return out


def _table_records(target, tables_dir=None):
    """The records of every shipped table of `target`'s architecture, its own GPU's table first
    (a broken table is skipped: it costs seeds, never the search)."""
    from .tuned_db.io import read_header, read_table, shipped_tables
    for path in sorted(shipped_tables(tables_dir), key=lambda p: p.stem != target.slug):
        try:
            if read_header(path).arch != target.arch:
                continue
            records = read_table(path, strict=False).records
        except Exception as e:  # noqa: BLE001
            log.warning("search: table %s skipped: %s", path, e)
            continue
        yield from records


def rival_variants(pb: PlannedBucket, tables_dir=None) -> list[Variant]:
    """The variants the shipped tables of pb's architecture (its own GPU's first) hold, one per
    family, for pb's problem in the other families that serve its calls (the generic fwd beside
    hopper_fwd, hopper_bwd beside bwd) and that the search measures on the same inputs. The
    dispatcher picks between their records and this bucket's (dispatch._compete), so the final
    re-timing times them beside its candidates, never to win here: their times go in as
    runner-ups, same-run evidence for that pick (session 32: D=64 causal 8k ran the generic fwd
    on a 3% lead between records of two sessions)."""
    from .families import all_families, get
    from .problem import Bucket
    fam = get(pb.bucket.family)
    call = fam.serves[0] if fam.serves else fam.name  # the calls it serves: "fwd", "bwd"
    ops = fam.ops
    found: dict = {}
    for other in all_families():
        if other.name == fam.name or not (other.name == call or call in other.serves):
            continue
        try:
            theirs = other.ops
        except Exception as e:  # noqa: BLE001 -- a rival costs evidence, never the search
            log.warning("search: %s not timed beside %s: %s", other.name, fam.name, e)
            continue
        if not (isinstance(theirs, type(ops)) or isinstance(ops, type(theirs))):
            continue  # other inputs (splitkv's decode caches): not timed on these
        try:
            bucket = Bucket.of(dataclasses.replace(pb.problem, family=other.name))
        except ValueError:
            continue
        found[other.name] = bucket
    out: dict = {}
    for r in _table_records(pb.space.target, tables_dir):
        fam_name = r.bucket.family
        if fam_name in found and fam_name not in out and r.bucket == found[fam_name]:
            out[fam_name] = r.variant
    return list(out.values())


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


# consecutive proposals answered without measuring (infeasible, known) before the next one is
# drawn from the feasible variants nobody measured: the generic forward's D=256 buckets asked
# 435-1,000 times for their 40 measured variants (H200s, session 19), which bound that phase
DRAW_AFTER_IDLE = 6


def search_bucket(bs: BucketStudy, pipeline: Pipeline, trials: int, deadline: float | None,
                  progress, *, max_asks: int | None = None, until=None,
                  stop: threading.Event | None = None, flight: Flight | None = None,
                  leave_tail: bool = False, draw_after: int | None = DRAW_AFTER_IDLE) -> str:
    """Ask, measure and tell until `trials` distinct variants are measured (by every process
    sharing the study), the feasible space is exhausted, or the deadline passes.

    flight: the process's candidates in flight (flashtune/search_flight.py), which may hold an
    earlier bucket's last trials: they are told as they come back. leave_tail: return as soon as
    this bucket's whole budget is in flight, leaving its last trials in `flight` (the caller
    picks the winner when they are told); without it, wait for them. draw_after: after this
    many proposals in a row answered without measuring, the next is drawn from the feasible
    variants nobody measured (None: the sampler alone, as bench/sampler_eval compares them)."""
    problem = bs.problem
    flight = flight if flight is not None else Flight()
    feasible = len(bs.space.feasible) if bs.prune else len(bs.space.variants())
    max_asks = max_asks or 20 * trials + 200
    asks, idle_asks, streak = 0, 0, 0
    status = "done"
    others, synced = 0, -1e9   # variants other processes are measuring now (read every 0.25 s)

    def told(b) -> None:
        mark("first trial told", once=True)
        if b is bs:
            progress.trial(bs.measured(), bs.best_tflops())

    try:
        while True:
            if stop is not None and stop.is_set():
                raise KeyboardInterrupt
            # tell what is done before asking more: the sampler sees results as soon as they
            # exist, and fewer of its proposals are lies (constant liar)
            flight.settle_ready(told)
            if time.monotonic() - synced > 0.25:
                others, synced = bs.sync(), time.monotonic()
            mine = flight.of(bs)
            budget_left = bs.measured() + mine + others < min(trials, feasible)
            taken = not budget_left  # the whole budget measured or in flight
            if until is not None and until(bs):
                budget_left = taken = False
            if deadline is not None and time.monotonic() > deadline:
                status = "time budget"
                budget_left = taken = False
            if idle_asks > 200 or asks >= max_asks:
                budget_left = False  # the sampler keeps proposing what is known: it has converged
                taken = True
                bs.converged = True
            # at most half the budget left in flight (shared among the processes measuring
            # here): the sampler learns from what comes back before it proposes the rest, and
            # a bucket's end leaves few trials queued behind one GPU; never less than keeps
            # every timing worker busy
            left = min(trials, feasible) - bs.measured()
            cap = max(pipeline.feed, left // (2 * (1 + bs.sharing)))
            if budget_left and mine < min(pipeline.depth, cap):
                trial, variant, answer = bs.ask()
                asks += 1
                if answer is None and flight.holds(bs, variant):
                    flight.wait_for(bs, trial, variant)  # same variant in flight: wait for it
                    continue
                if answer is not None:
                    bs.tell(trial, variant, answer)
                    idle_asks += 1
                    streak += 1
                    if draw_after and streak >= draw_after and bs.prune:
                        streak = 0  # the sampler keeps missing: the next proposal is drawn
                        # (seeded by the trial's number: reproducible, and distinct across the
                        # processes sharing the study)
                        bs.enqueue_unmeasured(random.Random(trial.number),
                                              lambda v: flight.holds(bs, v))
                    continue
                streak = 0
                # the budget is the study's: count what the others measure, read after this
                # trial carries its variant (two processes taking the last slot at once: at
                # least one sees the other and stands back; never more than the budget)
                others, synced = bs.others, time.monotonic()  # ask() read them just now
                if bs.measured() + mine + others >= min(trials, feasible):
                    bs.tell(trial, variant, ("busy", None))
                    continue
                idle_asks = 0
                flight.add(pipeline.submit(variant, problem), bs, trial, variant)
                continue
            if not mine or (taken and leave_tail):
                break
            flight.wait_any(on_told=told)
    except KeyboardInterrupt:
        flight.interrupt()
        raise _Interrupted() from None
    return status


def run_search(cfg: SearchConfig, *, backend=None, db=None, progress=None,
               target=None, studies_ready=None) -> SearchResult:
    """Search cfg's buckets and write their winners. studies_ready (a --gpus child's): called
    once the workers are up, before the first bucket is opened; it waits until the parent has
    prepared the studies and returns False where there is nothing to search (then no bucket
    is opened and the result is empty)."""
    t_start = time.monotonic()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    target = target or resolve_target(cfg)
    if cfg.gpus:
        from .search_gpus import run_on_gpus
        return run_on_gpus(cfg, target=target, progress=progress)
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
    mark("search starts")
    storage = make_storage(cfg.storage)
    heartbeat = Heartbeat(storage).start()
    mark("storage open")
    pipeline = Pipeline(backend, devices=tuple(range(cfg.workers)), compile_workers=cw,
                        trial_timeout=cfg.trial_timeout_s).start()
    mark("workers started")
    if studies_ready is not None and not studies_ready():
        heartbeat.stop()
        pipeline.close()
        return SearchResult(target.short, (), time.monotonic() - t_start, False, 0, 0)
    run = _Run(cfg, planned, pipeline, storage, db, progress, t_start)
    stop = threading.Event()
    progress.start(len(planned), cfg.trials * len(planned))
    try:
        with _ctrl_c(stop):
            run.buckets(stop)
    except KeyboardInterrupt:  # a second Ctrl-C, or one during a final pick
        run.interrupted = True
    finally:
        mark("buckets done")
        heartbeat.stop()
        pipeline.close(kill=run.interrupted)
        progress.close()
        mark("workers closed")
    results = tuple(run.results[i] for i in sorted(run.results))
    measured = sum(bs.counts["measured"] for bs in run._studies.values())
    return SearchResult(target.short, results, time.monotonic() - t_start, run.interrupted,
                        run.written, measured)


def open_bucket(cfg: SearchConfig, storage, pb: PlannedBucket, liveness=None) -> BucketStudy:
    """The bucket's study (deleted first with --fresh), dead owners' trials failed, the first
    points enqueued into a new one."""
    study = open_study(storage, study_name(pb.space, pb.bucket),
                       make_sampler(cfg.sampler, pb.space, cfg.seed), fresh=not cfg.resume)
    bs = BucketStudy(study, pb.space, pb.problem, prune=cfg.prune, liveness=liveness)
    bs.reap_abandoned()
    if cfg.enqueue_default and not study.trials:
        for v in _first_points(pb):  # points of pb.space
            bs.enqueue(v)
    return bs


class _Run:
    """The state of one search across its buckets.

    Several processes may search the same buckets through one storage (--gpus, or hosts by
    hand): each walks the plan in order, taking first the buckets no other live process has
    started (a claim per bucket, flashtune/search_claims.py), so the processes search different
    buckets side by side -- each with its whole in-flight budget: a bucket's in-flight cap is
    the study's, so processes sharing one bucket would only split it, and a search bound by
    compile latency would not go faster. When no bucket is free a process joins the others'
    buckets that have trials left, so no GPU idles while a bucket has trials left. A bucket
    whose last trials another process is measuring is left for a later pass: the process that
    finds it complete picks its winner, once (another claim). A later pass also finishes what
    a dead process left.
    """

    def __init__(self, cfg, planned, pipeline, storage, db, progress, t_start):
        self.cfg, self.planned, self.pipeline, self.storage = cfg, planned, pipeline, storage
        self.db, self.progress = db, progress
        self.deadline = t_start + cfg.time_budget_s if cfg.time_budget_s else None
        self.results: dict[int, BucketResult] = {}
        self.written = 0
        self.interrupted = False
        self.liveness = Liveness(storage)
        self.by = cfg.tag or f"{me()['host']}:{me()['pid']}"
        self._studies: dict[int, BucketStudy] = {}
        self._holders: dict[int, dict] = {}  # bucket -> the process that started it first
        self.flight = Flight()
        self._deferred: dict[int, tuple] = {}  # bucket -> (status, t_b, first): last trials in flight

    def _free(self, i: int) -> bool:
        """Bucket i is this process's to start: it claims it (once) and holds the claim, or the
        holder has died."""
        if i not in self._holders:
            name = study_name(self.planned[i].space, self.planned[i].bucket)
            self._holders[i] = claim(self.storage, f"bucket:{name}", self.liveness)
        h = self._holders[i]
        return same(h, me()) or not self.liveness.alive(h)

    def _open(self, i: int, pb: PlannedBucket) -> BucketStudy:
        if i not in self._studies:
            if not self._studies:  # this process's first bucket: its timing workers get ready
                self.pipeline.warm(pb.problem)  # while the first candidates compile
            bs = open_bucket(self.cfg, self.storage, pb, self.liveness)
            if self.cfg.enqueue_default and not bs.measured():
                for v in (table_winners(pb, self.cfg.table_seeds, self.cfg.tables_dir)
                          + neighbour_winners(self.storage, self.planned, pb,
                                              self.cfg.neighbour_seeds)):
                    bs.enqueue(v)
            self._studies[i] = bs
            mark("first bucket open", once=True)
        return self._studies[i]

    def buckets(self, stop: threading.Event) -> None:
        pending = list(range(len(self.planned)))
        quiet_since = None
        while pending:
            left, todo = [], list(pending)
            while todo:
                if stop.is_set():
                    self.interrupted = True
                if self.interrupted or (self.cfg.in_order and self._out_of_time()):
                    return self._wind_down()
                # the first bucket nobody else started, else the first of the others' (shared)
                i = next((j for j in todo if self._free(j)), todo[0])
                n_left = len(todo)
                todo.remove(i)
                if not self._bucket(i, n_left, stop):
                    left.append(i)
                left += self._conclude_ready()
            # the pass's last buckets: their last trials come back, then their winners
            self.flight.drain()
            left += self._conclude_ready()
            if left and left == pending:  # no progress: others are measuring their last trials
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since > 2 * self.cfg.trial_timeout_s + 60:
                    return  # theirs to finish; their winners are picked by them
                time.sleep(0.5)
            else:
                quiet_since = None
            pending = sorted(left)

    def _wind_down(self) -> None:
        """Stopping between buckets: what is in flight is measured and told (Ctrl-C: failed,
        transient), and the buckets it belonged to are concluded."""
        if self.interrupted:
            self.flight.interrupt()
        else:
            self.flight.drain()
        self._conclude_ready()

    def _out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def _bucket(self, i: int, n_left: int, stop: threading.Event) -> bool:
        """Search bucket i (again); False when others are measuring its last trials, so its
        winner is picked later (by whoever finds it complete)."""
        cfg, pb = self.cfg, self.planned[i]
        label = bucket_label(pb.bucket)
        bs = self._open(i, pb)
        first = i not in self.results
        if first:
            self.progress.bucket_start(label, cfg.trials, bs.measured())
        elif hasattr(self.progress, "label"):
            self.progress.label = label  # back to a bucket left for later: its trials count
        t_b = time.monotonic()
        bucket_deadline = self.deadline
        if self.deadline is not None and not cfg.in_order:
            # share what is left evenly among the buckets left
            bucket_deadline = t_b + (self.deadline - t_b) / n_left
        try:
            status = search_bucket(bs, self.pipeline, cfg.trials, bucket_deadline,
                                   self.progress, stop=stop, flight=self.flight,
                                   leave_tail=True)
        except _Interrupted:
            # what is already won is kept: the best measured variant, without re-timing
            self.interrupted = True
            self.pipeline.close(kill=True)
            status = "interrupted"
        if self.flight.of(bs):  # its last trials are in flight: concluded when they are told
            self._deferred[i] = (status, t_b, first)
            return True
        return self._conclude(i, status, t_b, first)

    def _conclude_ready(self) -> list[int]:
        """Conclude the buckets whose last trials have all been told; the ones others are
        still measuring are returned, for a later pass."""
        later = []
        for i in [i for i in self._deferred if self.interrupted
                  or not self.flight.of(self._studies[i])]:
            status, t_b, first = self._deferred.pop(i)
            if self.interrupted:
                status = "interrupted"
            if not self._conclude(i, status, t_b, first):
                later.append(i)
        return later

    def _conclude(self, i: int, status: str, t_b: float, first: bool) -> bool:
        """Pick bucket i's winner; False when others are measuring its last trials."""
        cfg, pb = self.cfg, self.planned[i]
        label, name = bucket_label(pb.bucket), study_name(pb.space, pb.bucket)
        bs = self._studies[i]
        pipeline = None if status == "interrupted" else self.pipeline
        feasible = len(bs.space.feasible) if bs.prune else len(bs.space.variants())
        complete = bs.measured() >= min(cfg.trials, feasible) or bs.converged
        if complete and status == "time budget":
            status = "done"  # its last trial came in as time ran out
        cut = status == "time budget" and cfg.in_order and not complete
        if (status == "done" and not complete) or cut:
            # others are measuring its last trials (picked later, by whoever finds it
            # complete), or the budget ran out (--in-order: left as it is for the next run)
            if first or cut:
                self.results[i] = BucketResult(
                    label=label, study=name, status="shared" if not cut else "left",
                    measured=bs.measured(),
                    failed=bs.counts["failed"], infeasible=bs.counts["infeasible"],
                    duplicates=bs.counts["duplicate"], busy=bs.counts["busy"],
                    unit=get_family(pb.bucket.family).unit, wall_s=time.monotonic() - t_b)
            if cut:
                self.progress.bucket_end(label, f"left: the time budget ran out at "
                                                f"{bs.measured()}/{cfg.trials} measured")
            return cut
        rec, res, here = self._pick(bs, pipeline, pb, label, name, status, t_b)
        self.results[i] = res
        # saved as soon as it is known; a pick made before (a resumed search) is saved again,
        # an upsert (--gpus: the parent saves every pick at the end)
        if rec is not None and cfg.write_db and (here or not cfg.tag):
            self.db = _write(cfg, self.db, [rec])
            self.written += here
        self.progress.bucket_end(label, _line(res) + ("" if here else f" [picked by {res.by}]"))
        return True

    def _pick(self, bs, pipeline, pb, label, name, status, t_b):
        """The bucket's winner, picked once per state of its study: reused if a pick already
        saw every measured variant, else picked here by the one process holding the claim
        (the others take its result when they come back to the bucket)."""
        cfg = self.cfg
        while status != "interrupted":  # Ctrl-C: every process keeps its best measured one
            bs.sync()
            final = bs.study.user_attrs.get("final")
            if final and final.get("measured") == bs.measured():
                return _from_final(final) + (False,)
            seen = (final or {}).get("measured", 0)
            holder = claim(self.storage, f"final:{name}:{seen}", self.liveness)
            if same(holder, me()):
                # the picker may have stored its pick and exited between our read above and
                # this claim (its claim is then a dead one's, and skipped): read it again
                final = _stored_pick(bs)
                if final:
                    return _from_final(final) + (False,)
                break
            # another process is picking this state (re-timing): take its pick when it is
            # stored; if it dies first, its claim no longer counts: claim again
            while self.liveness.alive(holder):
                final = _stored_pick(bs)
                if final:
                    return _from_final(final) + (False,)
                time.sleep(0.25)
        rec, res = _finish(bs, pipeline, self.pipeline.info, pb, label, name, cfg, status, t_b,
                           default_for(pb))
        res = dataclasses.replace(res, by=self.by, busy=bs.counts["busy"])
        if status != "interrupted":  # not re-timed: pick again on resume
            bs.study.set_user_attr("final", {"measured": res.measured, "result": _plain(res),
                                             "converged": bs.converged,
                                             "record": rec.to_dict() if rec else None})
        return rec, res, True


def _stored_pick(bs: BucketStudy) -> dict | None:
    """The study's stored pick if it saw every variant measured so far, else None."""
    final = bs.study.user_attrs.get("final")
    return final if final and final.get("measured", -1) >= bs.measured() else None


def _plain(res: BucketResult) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(res), default=str))


def _from_final(final: dict):
    from .tuned_db import Record

    d = dict(final["result"])
    d["failures"] = tuple(tuple(f) for f in d.get("failures", ()))
    rec = Record.from_dict(final["record"]) if final.get("record") else None
    return rec, BucketResult(**d)


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
        if passed is None and pipeline is not None:
            # not in the study: the space's constraints leave it out (splitkv's default tile
            # is wider than a decode step's rows, which the launch narrows) or it was never
            # proposed. Gate it here, so a winner must beat what runs untuned.
            out = pipeline.submit(default, pb.problem).result()
            if out.ok:
                passed = {"ms": out.ms, "max_err": out.max_err or 0.0}
        if passed is not None:
            by_key[default.key] = (default, passed)
        if pipeline is not None:
            cands.append(default)
    # the other families' records for this problem, timed beside the candidates (not eligible:
    # their times become runner-ups, the dispatcher's same-run evidence between families)
    rivals = rival_variants(pb, cfg.tables_dir) if (pipeline is not None and cands) else []
    cands += [v for v in rivals if v.key not in by_key]
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
    win = pick(eligible, cfg.noise, default)
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
    runner_ups += tuple((r[0].name, float(r[1])) for r in rows
                        if r[0].family != v.family and r[1] is not None)
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


def _write(cfg: SearchConfig, db, records):
    """Put the records; returns the DB, opened once per search (opening checks its schema)."""
    if db is None:
        from .tuned_db import TunedDB
        db = TunedDB(cfg.db)
    for r in records:
        db.put(r)
    return db
