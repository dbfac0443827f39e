"""`flashtune search --gpus 0,1,...`: one search process per GPU, the Optuna way.

Each child process is pinned to its GPU (CUDA_VISIBLE_DEVICES) and runs the ordinary search
(flashtune/search.py) with its own compile pool and timing worker, against one shared storage:
the processes ask their own trials of the same studies, so a bucket is shared until its budget
is taken and no GPU idles while any bucket has trials left. What they must agree on -- a
variant being measured, a dead process's trials, who picks a bucket's winner -- goes through
the storage (flashtune/search_claims.py), so the same thing works across hosts by hand (every
host runs `flashtune search --storage postgresql://...`).

The parent starts the children, then prepares the studies while they start their workers
(--fresh deletes them here, once; the first points are enqueued once; a child opens no bucket
before that), shows their combined progress (their lines tagged with the GPU) and merges their
results. A child that dies loses nothing: its completed trials are
in storage, its RUNNING ones are failed by the others and measured again.
"""
from __future__ import annotations

import dataclasses
import os
import queue
import signal
import time

from .isolation import (_context, _describe_exit, adopt_env, server_handle, share_server,
                        start_server)
from .timeline import mark


class QueueProgress:
    """A child's progress, sent to the parent: (tag, method, args)."""

    def __init__(self, q, tag: str):
        self.q, self.tag = q, tag

    def _send(self, method: str, *args) -> None:
        self.q.put((self.tag, method, args))

    def start(self, n_buckets: int, total_trials: int) -> None:
        pass  # the parent knows the plan

    def bucket_start(self, label: str, trials: int, already: int) -> None:
        self.label = label
        self._send("bucket_start", label, trials, already)

    def trial(self, measured: int, best: float) -> None:
        self._send("trial", self.label, measured, best)

    def bucket_end(self, label: str, line: str) -> None:
        self._send("bucket_end", label, line)

    def log(self, msg: str) -> None:
        self._send("log", msg)

    def close(self) -> None:
        pass


class MultiProgress:
    """The parent's view: every child line tagged with its GPU, and every `every` seconds one
    line for all of them (trials measured, rate, buckets finished, ETA); with rich bars, the
    overall bar follows the same count."""

    def __init__(self, base, n_buckets: int, trials: int, already: dict, every: float = 10.0):
        self.base, self.n_buckets, self.trials, self.every = base, n_buckets, trials, every
        self.seen = dict(already)          # bucket label -> measured (study-wide)
        self.start_count = self._count()
        self.finished: set = set()
        self.current: dict = {}            # tag -> label
        self.t0 = self.last = time.monotonic()
        base.start(n_buckets, trials * n_buckets)
        if hasattr(base, "bars"):
            base.bars.update(base.overall, completed=self.start_count)

    def _count(self) -> int:
        return sum(min(m, self.trials) for m in self.seen.values())

    def event(self, tag: str, method: str, args) -> None:
        if method == "bucket_start":
            label, trials, already = args
            self.current[tag] = label
            self.seen[label] = max(self.seen.get(label, 0), already)
            self.base.log(f"[{tag}] {label}: {already}/{trials} measured so far")
        elif method == "trial":
            label, measured, best = args
            self.seen[label] = max(self.seen.get(label, 0), measured)
            if hasattr(self.base, "bars"):
                self.base.bars.update(self.base.overall, completed=self._count())
            if time.monotonic() - self.last >= self.every:
                self.summary()
        elif method == "bucket_end":
            label, line = args
            self.finished.add(label)
            self.base.log(f"[{tag}] {label}: {line}")
        elif method == "log":
            self.base.log(f"[{tag}] {args[0]}")

    def summary(self) -> None:
        from .search_progress import _fmt_s

        now = time.monotonic()
        self.last = now
        done = self._count() - self.start_count
        total = self.trials * self.n_buckets
        rate = done / max(1e-9, now - self.t0)
        eta = (total - self._count()) / rate if rate > 0 else 0
        where = ", ".join(f"{t}: {lb}" for t, lb in sorted(self.current.items()))
        self.base.log(f"[all] {self._count()}/{total} trials, {rate:.2f}/s, "
                      f"{len(self.finished)}/{self.n_buckets} buckets picked, "
                      f"ETA {_fmt_s(eta)} ({where})")

    def close(self) -> None:
        self.base.close()


def device_ids(gpus) -> list[str]:
    """--gpus indices -> CUDA_VISIBLE_DEVICES entries (indices into an existing list)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else None
    out = []
    for g in gpus:
        if ids is not None and g >= len(ids):
            raise ValueError(f"--gpus {g}: CUDA_VISIBLE_DEVICES={visible} shows {len(ids)} GPU(s)")
        out.append(ids[g] if ids is not None else str(g))
    return out


class StudiesReady:
    """A child's wait for the parent's studies (run_search's studies_ready): True to search,
    False when the parent found nothing to search, stopped, or is gone."""

    def __init__(self, go, verdict, parent: int):
        self.go, self.verdict, self.parent = go, verdict, parent

    def __call__(self) -> bool:
        while not self.go.wait(1.0):
            try:
                os.kill(self.parent, 0)
            except OSError:  # the parent died before it said: nothing is this child's to do
                return False
        return bool(self.verdict.value)


def _child(cfg, target, device: str, q, env: dict, server=None, ready=None) -> None:
    adopt_env(env)
    # its workers come from the parent's server (torch imported once for all processes)
    shared = share_server(server)
    os.environ["CUDA_VISIBLE_DEVICES"] = device  # before anything here touches CUDA
    where = "the parent's server" if shared else "a server of its own"
    mark(f"search process for GPU {device} up (workers from {where})")
    from .search import run_search
    try:
        # started with SIGINT blocked (a Ctrl-C while it imported would kill it mid-import);
        # one that came meanwhile arrives now, as a KeyboardInterrupt
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        res = run_search(cfg, target=target, progress=QueueProgress(q, cfg.tag),
                         studies_ready=ready)
    except KeyboardInterrupt:
        q.put((cfg.tag, "interrupted", ()))
        raise SystemExit(130) from None
    except BaseException as e:  # noqa: BLE001 -- told to the parent, then this process fails
        q.put((cfg.tag, "error", (f"{type(e).__name__}: {e}",)))
        raise SystemExit(1) from None
    q.put((cfg.tag, "result", (res,)))


def run_on_gpus(cfg, *, target, progress=None):
    from .search import SearchResult, _backend, _from_final, _write, open_bucket, plan_of
    from .search_claims import Liveness
    from .search_progress import make_progress
    from .search_status import bucket_status
    from .search_study import bucket_label, default_storage, make_storage

    t_start = time.monotonic()
    gpus = tuple(cfg.gpus)
    if len(set(gpus)) != len(gpus) or any(g < 0 for g in gpus):
        raise ValueError(f"--gpus {','.join(map(str, gpus))}: give distinct GPU indices")
    if cfg.workers != 1:
        raise ValueError("--gpus runs one timing worker per GPU process: leave out --workers")
    backend = _backend(cfg, target)
    mark("backend built")
    n_dev = backend.device_count()
    mark("devices counted")
    if max(gpus) >= n_dev:
        raise ValueError(f"--gpus {','.join(map(str, gpus))}: this host has {n_dev} GPU(s)")
    missing = [f for f in cfg.families if not backend.supports(f)]
    if missing:
        raise ValueError(f"--family {', '.join(missing)}: the {backend.name} backend has no "
                         "measuring function for it (its flashtune/families/ entry)")
    devices = device_ids(gpus)
    planned = plan_of(cfg, target)
    url = cfg.storage or default_storage()
    storage = make_storage(url)
    liveness = Liveness(storage)
    mark("buckets planned, storage open")
    # each process's share of the cores less its driver and timing worker
    cw = cfg.compile_workers or max(1, min(16, ((os.cpu_count() or 2) - 2 * len(gpus))
                                              // len(gpus)))
    ctx = _context()  # forked from a server with torch imported, as the workers are
    start_server()
    server = server_handle()  # which the search processes' workers come from too
    mark("workers' server handle")  # (a process's start waits until the server has started)
    q = ctx.Queue()
    # the children start first: their workers' start-up (CUDA, imports) runs while the studies
    # are prepared below (0.8 s for 36 buckets, session 20), and each waits for `go` before
    # opening a bucket; verdict 1: search, 0: stop (nothing to search, or this process failed)
    go, verdict = ctx.Event(), ctx.Value("b", 0)
    procs = {}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for k, (g, dev) in enumerate(zip(gpus, devices)):
            budget = cfg.time_budget_s
            if budget is not None:  # counted from this command's start, as without --gpus
                budget = max(0.0, budget - (time.monotonic() - t_start))
            child = dataclasses.replace(cfg, gpus=(), workers=1, storage=url, resume=True,
                                        compile_workers=cw, tag=f"gpu{g}", time_budget_s=budget,
                                        seed=None if cfg.seed is None else cfg.seed + k)
            p = ctx.Process(target=_child, args=(child, target, dev, q, dict(os.environ),
                                                 server, StudiesReady(go, verdict, os.getpid())),
                            name=f"flashtune-gpu{g}")
            p.start()
            procs[child.tag] = p
            mark("first search process started", once=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    mark(f"{len(procs)} search processes started")
    try:
        # the studies, once, before any child opens them (a child's --fresh would delete the
        # others' trials; two children could both enqueue the first points)
        already = {}
        measured0 = 0
        finals = []
        for pb in planned:
            bs = open_bucket(cfg, storage, pb, liveness)
            already[bucket_label(pb.bucket)] = bs.measured()
            measured0 += bs.measured()
            finals.append(bucket_status(storage, pb, cfg.trials)["state"] == "done"
                          and bs.study.user_attrs.get("final"))
        verdict.value = 0 if all(finals) else 1
    finally:  # whatever happened, no child waits on `go` (an error here stops them all)
        go.set()
        mark("studies ready")
    if all(finals):  # nothing left to search: the children stop without opening a bucket
        for p in procs.values():
            p.join(30)
        recs = [_from_final(f) for f in finals]
        if cfg.write_db and any(r for r, _ in recs):
            _write(cfg, None, [r for r, _ in recs if r])
        return SearchResult(target.short, tuple(res for _, res in recs),
                            time.monotonic() - t_start, False, 0, 0)
    progress = MultiProgress(progress or make_progress(), len(planned), cfg.trials, already)
    results, errors, notes = {}, {}, []
    ended: set = set()
    interrupted = False

    def on_sigint(signum, frame):  # a terminal's Ctrl-C reaches the children too: they stop
        nonlocal interrupted
        interrupted = True
    prev = None
    try:
        prev = signal.signal(signal.SIGINT, on_sigint)
    except ValueError:  # not the main thread
        pass
    try:
        while True:
            try:
                tag, method, args = q.get(timeout=0.5)
            except queue.Empty:
                # every child is polled (waited for): a dead one must not linger as a zombie
                if not [p for p in procs.values() if p.is_alive()]:
                    break
                continue
            if method == "result":
                results[tag] = args[0]
            elif method == "interrupted":
                interrupted = True
            elif method == "error":
                errors[tag] = args[0]
            else:
                progress.event(tag, method, args)
            if method in ("result", "interrupted", "error"):  # each process's last message
                ended.add(tag)
                if len(ended) == len(procs):  # every process has told its end: no poll to wait out
                    break
    finally:
        mark("search processes reported")
        for p in procs.values():
            p.join(5)
        mark("search processes joined")
        if prev is not None:
            signal.signal(signal.SIGINT, prev)
        for tag, p in procs.items():
            if tag in errors:
                notes.append(f"{tag}: {errors[tag]}")
            elif tag not in results and not interrupted:
                notes.append(f"{tag}: the search process {_describe_exit(p.exitcode)}; its "
                             "completed trials are kept, its running ones measured again")
        for n in notes:
            progress.base.log(n)
        progress.close()
    if errors and not results and not interrupted:
        raise ValueError("; ".join(f"{t}: {e}" for t, e in errors.items()))
    # one result per bucket, in plan order: the process that picked it, else any
    merged = {}
    for tag in procs:
        for b in getattr(results.get(tag), "buckets", ()):
            if b.label not in merged or (b.by and not merged[b.label].by):
                merged[b.label] = b
    order = [bucket_label(pb.bucket) for pb in planned]
    buckets = tuple(merged[lb] for lb in order if lb in merged)
    written = sum(r.db_written for r in results.values())
    if (not interrupted and not notes and len(results) == len(procs)
            and len(buckets) == len(order) and all(b.status == "done" for b in buckets)
            and written >= sum(1 for b in buckets if b.winner)):
        # every bucket picked, each pick written by its process and counting every process's
        # trials of its study: nothing to read back (replaying the storage took 1.6-2.3 s)
        measured = sum(b.measured for b in buckets)
    else:
        studies = [open_bucket(dataclasses.replace(cfg, resume=True, enqueue_default=False),
                               storage, pb, liveness) for pb in planned]
        measured = sum(bs.measured() for bs in studies)
        if cfg.write_db:  # every pick in storage, this run's and earlier ones (an upsert)
            records = [_from_final(f)[0] for f in (bs.study.user_attrs.get("final")
                                                   for bs in studies) if f and f.get("record")]
            if records:
                _write(cfg, None, records)
    return SearchResult(target.short, buckets, time.monotonic() - t_start,
                        interrupted or any(r.interrupted for r in results.values()),
                        written, measured - measured0, tuple(notes))
