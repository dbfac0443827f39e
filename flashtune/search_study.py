"""One Optuna study per bucket: naming, storage, samplers, and the ask/tell bookkeeping.

Objective: speed in the family's unit (TFLOP/s; GB/s for splitkv), maximized. A candidate that is infeasible or fails (compile, gate, launch,
timeout, crash) is told as a COMPLETE trial of 0 TFLOP/s with a violated constraint, so TPE
(constraints_func) and CMA-ES (the value) learn to stay away; only transient failures (Ctrl-C,
a lost worker) are told FAIL and measured again if proposed again. Every trial carries the
variant's name and what happened to it in user attrs, which optuna-dashboard shows.
"""
from __future__ import annotations

import os
import warnings
from datetime import datetime
from functools import lru_cache, partial

import optuna
from optuna.trial import TrialState

from .codegen import Variant
from .families import get as get_family
from .measure import Outcome
from .problem import Bucket, Problem
from .search_claims import ORPHAN_GRACE_S, Liveness, me, same
from .search_space import Space

SAMPLERS = ("tpe", "cmaes", "random", "grid")
# CMA-ES learns from the 0 TFLOP/s of failed trials; it need not say it ignores their constraint
warnings.filterwarnings("ignore", message="Constraints have been set, but CmaEsSampler")
warnings.filterwarnings("ignore", message=".*(with_margin|constraints_func|group).*experimental")
_ALIASES = {"exhaustive": "grid"}


def bucket_label(b: Bucket) -> str:
    dt = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(b.dtype, b.dtype)
    return (f"{b.family}-{dt}-d{b.head_dim}-{'causal' if b.causal else 'full'}"
            f"{'-gqa' if b.gqa else ''}-q{b.seqlen_q}-k{b.seqlen_k}-bh{b.batch_heads}"
            f"{'-' + b.mask if b.mask else ''}")


def study_name(space: Space, bucket: Bucket) -> str:
    """Readable and exact: the bucket, the GPU, and the hash of everything that shapes the space."""
    return f"{bucket_label(bucket)}.{space.target.short}.{space.hash}"


JOURNAL = "journal:///"


def default_storage() -> str:
    """A journal file in the cache folder: proposals cost a third of SQLite's there
    (bench/proposal_cost.py, docs/search.md), several local processes share it, and it is one
    plain file to copy between machines."""
    from . import env

    path = env.cache_dir() / "search.journal"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"{JOURNAL}{path}"


def make_storage(url: str | None):
    """An Optuna storage from a URL: sqlite:///file (RDB, WAL), postgresql://... (RDB, across
    hosts), journal:///file (Optuna's JournalStorage on an append-only file, flock()ed per
    append: flashtune/journal_file.py; one plain file to copy between machines), or any
    SQLAlchemy URL."""
    url = url or default_storage()
    if "://" not in url and url.endswith((".journal", ".log")):
        url = JOURNAL + os.path.abspath(url)  # a bare journal file path
    if url.startswith(JOURNAL):
        from .journal_file import JournalFile

        path = url[len(JOURNAL) - 1:]
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        return optuna.storages.JournalStorage(JournalFile(path))
    if url.startswith("sqlite:///"):
        return optuna.storages.RDBStorage(url, engine_kwargs={"creator": _sqlite_creator(url)})
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://"):]  # psycopg 3, not psycopg2
    return optuna.storages.RDBStorage(url, engine_kwargs={"pool_pre_ping": True})


def _sqlite_creator(url: str):
    """WAL + synchronous=NORMAL: a commit survives kill -9 (only power loss may drop the last
    ones) and costs microseconds instead of an fsync -- a trial makes about ten of them.
    Several local processes may share the file: they wait for its lock instead of failing."""
    import sqlite3

    path = url[len("sqlite:///"):]

    def connect():
        conn = sqlite3.connect(path, timeout=60, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn
    return connect


def _constraint(trial) -> list[float]:
    return [float(trial.user_attrs.get("violation", 0.0))]


# Optuna 5 reads constraints set on the trial (Trial.set_constraint); Optuna 4 asks the
# sampler's constraints_func. Same information, either way.
_TRIAL_CONSTRAINTS = hasattr(optuna.trial.Trial, "set_constraint")


def make_sampler(name: str, space: Space, seed: int | None = None, *,
                 n_startup_trials: int = 10):
    name = _ALIASES.get(name, name)
    if name == "tpe":
        kw = {} if _TRIAL_CONSTRAINTS else {"constraints_func": _constraint}
        if any(p.when for p in space.params):
            # a conditional space (bwd: the dQ kernel's tiles exist for dq="separate" only):
            # multivariate TPE over each group of params that appear together
            kw.update(group=True)
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True,
                                          n_startup_trials=n_startup_trials, **kw)
    if name == "cmaes":
        # with_margin keeps integer params from collapsing onto one value
        return optuna.samplers.CmaEsSampler(seed=seed, with_margin=True,
                                            warn_independent_sampling=False,
                                            n_startup_trials=min(n_startup_trials, 5))
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        return optuna.samplers.GridSampler(space.grid(), seed=seed)
    raise ValueError(f"--sampler must be one of {SAMPLERS + tuple(_ALIASES)}, got {name!r}")


def open_study(storage, name: str, sampler, *, fresh: bool = False) -> optuna.Study:
    if fresh:
        try:
            optuna.delete_study(study_name=name, storage=storage)
        except KeyError:
            pass
    return optuna.create_study(study_name=name, storage=storage, sampler=sampler,
                               direction="maximize", load_if_exists=True)


@lru_cache(maxsize=65536)
def _key_of(name: str) -> str:
    return Variant.parse(name).key


class BucketStudy:
    """The search of one bucket: proposals, dedup, and telling outcomes.

    Trial user attrs (few, since each is a storage write): "variant" (its name), "owner"
    ({host, pid} of the asking process) and "result" ({measured, violation, ms, tflops,
    max_err, stage, reason, notes, duplicate}).

    Several processes may share the study (`--gpus`, or hosts on one PostgreSQL storage): each
    asks its own trials; a variant measured by any of them is a duplicate for the others, one
    being measured by another is "busy" (told FAIL, never measured twice), and RUNNING trials
    of a dead owner are failed so that they neither block the budget nor count.
    """

    def __init__(self, study: optuna.Study, space: Space, problem: Problem, *, prune: bool = True,
                 liveness: Liveness | None = None):
        self.study, self.space, self.problem, self.prune = study, space, problem, prune
        self.owner = me()
        self.liveness = liveness or Liveness(study._storage)
        self.converged = False  # the sampler only repeats itself (set by search_bucket)
        self.others: int | None = None  # variants other processes measure (the last read)
        self.sharing = 0  # other processes measuring in this study (the last read)
        # the objective: speed in the family's unit (TFLOP/s; GB/s for decoding). The result key
        # stays "tflops" so that studies started before GB/s families resume
        self._speed = partial(get_family(problem.family).throughput, problem)
        self._known: dict[str, tuple[float, dict]] = {}  # variant key -> (value, result)
        self.counts = {"measured": 0, "failed": 0, "infeasible": 0, "duplicate": 0, "busy": 0}
        self.failures: list[tuple[str, str, str]] = []  # (variant, stage, reason), this run
        self.set_attrs()
        self.refresh()

    def set_attrs(self) -> None:
        s = self.study
        for k, v in {"family": self.space.family, "gpu": self.space.target.short,
                     "bucket": bucket_label(Bucket.of(self.problem)),
                     "problem": self.problem.__dict__, "space_hash": self.space.hash,
                     "feasible": len(self.space.feasible)}.items():
            if s.user_attrs.get(k) != v:
                s.set_user_attr(k, v)

    # -- what storage knows (all processes, all hosts) ---------------------------------------
    def _completed(self):
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            r = t.user_attrs.get("result")
            if r and r.get("measured") and "variant" in t.user_attrs:
                yield t, r

    def refresh(self) -> None:
        for t, r in self._completed():
            key = _key_of(t.user_attrs["variant"])
            if key not in self._known:
                self._known[key] = (t.value, r)

    def measured(self) -> int:
        """Distinct variants measured in this study (by every process)."""
        return len(self._known)

    def sync(self) -> int:
        """Read the study once: learn what other processes measured, fail what dead ones left
        RUNNING, and return how many variants other live processes are measuring now."""
        return self._scan()[0]

    def _scan(self, trial=None, variant: Variant | None = None):
        """sync(), and another live process's RUNNING trial of `variant` (not `trial`)."""
        busy, other, owners = set(), None, set()
        for t in self.study.get_trials(deepcopy=False):
            a = t.user_attrs
            if t.state == TrialState.COMPLETE:
                r = a.get("result")
                if r and r.get("measured") and "variant" in a:
                    self._known.setdefault(_key_of(a["variant"]), (t.value, r))
            elif t.state == TrialState.RUNNING and not same(a.get("owner"), self.owner):
                if not self._reap(t) and "variant" in a:
                    busy.add(_key_of(a["variant"]))
                    o = a.get("owner") or {}
                    owners.add((o.get("host"), o.get("pid")))
                    if (variant is not None and other is None and t.number != trial.number
                            and a["variant"] == variant.name):
                        other = t
        self.others = len(busy - set(self._known))
        self.sharing = len(owners)
        return self.others, other

    def _reap(self, t) -> bool:
        """FAIL a RUNNING trial whose owner is dead (kill -9, power loss, a lost host), so that
        it neither blocks nor counts and its variant is measured again if proposed again."""
        owner = t.user_attrs.get("owner") or {}
        if not owner:  # between a process's ask() and its owner write, or killed there
            start = t.datetime_start
            if start is None or (datetime.now() - start).total_seconds() < ORPHAN_GRACE_S:
                return False
        elif same(owner, self.owner) or self.liveness.alive(owner):
            return False
        trial = optuna.trial.Trial(self.study, t._trial_id)
        try:
            why = (f"abandoned by process {owner.get('pid')} on {owner.get('host')}" if owner
                   else "abandoned by a process that died before writing its owner")
            trial.set_user_attr("result", {"measured": False, "stage": "lost", "reason": why})
            self.study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # another process reaped it first
        return True

    def reap_abandoned(self) -> int:
        """FAIL every RUNNING trial of a dead owner (see _reap); trials of live ones are theirs."""
        return sum(self._reap(t) for t in
                   self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))


    def enqueue(self, variant: Variant) -> None:
        """Propose `variant` first (the built-in default: a good first point for TPE)."""
        self.study.enqueue_trial(self.space.optuna_params(variant), skip_if_exists=True)

    def enqueue_unmeasured(self, rng, busy) -> bool:
        """Propose next a feasible variant nobody has measured (drawn by `rng`; `busy(v)`: this
        process has it in flight). For small spaces, where the sampler's proposals are mostly
        infeasible or known (D=256's generic forward: 10-24 of them per measured variant, each
        an ask and a tell on the shared storage). False when none is left."""
        left = [v for v in self.space.feasible if v.key not in self._known and not busy(v)]
        if not left:
            return False
        # not skip_if_exists: a variant once answered "busy" (another process had it) is
        # proposed again here, and the answer to this proposal decides it anew
        self.study.enqueue_trial(self.space.optuna_params(rng.choice(left)))
        return True

    # -- ask / tell --------------------------------------------------------------------------
    def ask(self):
        """(trial, variant, answer): answer is None when the proposal must be measured, an
        Outcome when it is infeasible, "duplicate" when it was measured before."""
        trial = self.study.ask()
        trial.set_user_attr("owner", self.owner)
        try:
            variant = self.space.suggest(trial)
        except ValueError as e:  # the space file allows a value Variant rejects
            return trial, None, Outcome.fail("infeasible", str(e))
        trial.set_user_attr("variant", variant.name)
        if self.prune:
            verdict = self.space.check(variant)
            if not verdict.ok:
                return trial, variant, Outcome.fail("infeasible", verdict.reason)
        if variant.key not in self._known:
            # one read of the study, after this trial carries its variant: what the others
            # measured meanwhile (then it is a duplicate), are measuring (self.others, for the
            # budget), and whether one of them is measuring this variant now. Of two processes
            # proposing one variant at once at least one sees the other and stands back (rarely
            # both: the variant waits for a later proposal); it is never measured twice.
            _, other = self._scan(trial, variant)
            if variant.key not in self._known and other is not None:
                return trial, variant, ("busy", other)
        else:
            self.others = None  # not read
        if variant.key in self._known:
            return trial, variant, "duplicate"
        return trial, variant, None

    def _finish(self, trial, value: float | None, result: dict) -> None:
        """Store the result and close the trial: COMPLETE with `value`, FAIL without one. A
        trial another process failed first (it took this one for dead: a host whose heartbeat
        stopped reaching the storage) stays as that process left it."""
        try:
            trial.set_user_attr("result", result)
            if value is None:
                self.study.tell(trial, state=TrialState.FAIL)
                return
            if _TRIAL_CONSTRAINTS:
                trial.set_constraint("failed", result.get("violation", 0.0))
            self.study.tell(trial, value)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass

    def tell(self, trial, variant: Variant | None, outcome) -> None:
        """Record what happened to a proposal; outcome is an Outcome, "duplicate", or ("busy",
        the other process's trial)."""
        if isinstance(outcome, tuple) and outcome[0] == "busy":
            other = outcome[1]
            if other is None:
                why = "the budget's last trials are being measured by other processes"
            else:
                owner = other.user_attrs.get("owner") or {}
                why = (f"being measured by trial {other.number} of process {owner.get('pid')} "
                       f"on {owner.get('host')}")
            self._finish(trial, None, {"measured": False, "stage": "busy", "reason": why})
            self.counts["busy"] += 1
            return
        if outcome == "duplicate":
            value, result = self._known[variant.key]
            self.counts["duplicate"] += 1
            self._finish(trial, value, dict(result, measured=False, duplicate=True))
            return
        o: Outcome = outcome
        if o.transient:
            self._finish(trial, None, {"measured": False, "stage": o.stage, "reason": o.reason})
            return
        measured = o.stage != "infeasible"
        result = {"measured": measured, "violation": 0.0 if o.ok else 1.0}
        if o.ok:
            result.update(ms=o.ms, tflops=self._speed(o.ms))
        else:
            result.update(stage=o.stage, reason=o.reason)
        if o.notes:
            result["notes"] = o.notes
        if o.max_err is not None:
            result["max_err"] = o.max_err
        if o.phases:  # where the trial's time went (seconds), for `bench/search_scaling.py`
            result["phases"] = {k: round(v, 4) for k, v in o.phases}
        value = result.get("tflops", 0.0)
        self._finish(trial, value, result)
        if measured:
            self._known[variant.key] = (value, result)
            self.counts["measured"] += 1
            self.counts["failed"] += not o.ok
        else:
            self.counts["infeasible"] += 1

    # -- results -----------------------------------------------------------------------------
    def top(self, k: int) -> list[tuple[Variant, dict]]:
        """The k fastest distinct variants measured (by any process), fastest first."""
        best: dict[str, tuple[Variant, dict]] = {}
        for t, r in self._completed():
            if r.get("violation", 1.0) <= 0 and "ms" in r:
                v = Variant.parse(t.user_attrs["variant"])
                best.setdefault(v.key, (v, r))
        return sorted(best.values(), key=lambda x: x[1]["ms"])[:k]

    def passed(self, variant: Variant) -> dict | None:
        """The measurement of `variant` in this study if it passed the gate (None otherwise)."""
        for t, r in self._completed():
            if (t.user_attrs["variant"] == variant.name and r.get("violation", 1.0) <= 0
                    and "ms" in r):
                return r
        return None

    def best_tflops(self) -> float:
        vals = [v for v, r in self._known.values() if r.get("violation", 1.0) <= 0]
        return max(vals, default=0.0)
