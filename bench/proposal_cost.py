"""What one proposal costs the search's driver: BucketStudy.ask (TPE + storage writes) and
tell, per storage, on a real fwd space with synthetic timings (no GPU, no workers).

    python3 bench/proposal_cost.py --trials 120 --json out.json

Prints, per storage, the mean ask and tell cost over the run and over its last third (TPE and
the storage reads grow with the study), and the driver time per measured variant (infeasible
and duplicate proposals included). docs/search.md records a run.

--procs N runs N drivers at once on one storage (what --gpus 0,1,... does), each on a bucket of
its own (--shared: all on one), and adds their proposals per second together: what the storage's
lock lets several drivers do. `journal-optuna` is Optuna's own journal file backend (a polled
symlink lock, an fsync per append), beside flashtune's (flashtune/journal_file.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(url: str, trials: int, rec: str, pb, seed: int = 0) -> dict:
    import optuna

    from flashtune.measure import Outcome
    from flashtune.replay import ReplayBackend
    from flashtune.search_study import BucketStudy, make_sampler, make_storage, study_name

    backend = ReplayBackend(rec)
    if url == "memory":
        storage = optuna.storages.InMemoryStorage()
    elif url.startswith("journal-optuna:"):
        from optuna.storages.journal import JournalFileBackend
        storage = optuna.storages.JournalStorage(JournalFileBackend(url.split(":///", 1)[1]))
    else:
        storage = make_storage(url)
    study = optuna.create_study(study_name=study_name(pb.space, pb.bucket), storage=storage,
                                sampler=make_sampler("tpe", pb.space, seed), direction="maximize",
                                load_if_exists=True)
    bs = BucketStudy(study, pb.space, pb.problem)
    asks, tells, proposals = [], [], 0
    t_all = time.perf_counter()
    while bs.measured() < trials and proposals < 20 * trials:
        t0 = time.perf_counter()
        trial, variant, answer = bs.ask()
        t1 = time.perf_counter()
        proposals += 1
        outcome = answer if answer is not None else backend.measure(variant, pb.problem)
        t2 = time.perf_counter()
        bs.tell(trial, variant, outcome)
        t3 = time.perf_counter()
        asks.append(t1 - t0)
        tells.append(t3 - t2)
    wall = time.perf_counter() - t_all
    last = max(1, len(asks) // 3)
    ms = lambda xs: 1e3 * statistics.fmean(xs)  # noqa: E731
    return {"storage": url.split(":")[0], "measured": bs.measured(), "proposals": proposals,
            "ask_ms": ms(asks), "tell_ms": ms(tells), "ask_ms_last_third": ms(asks[-last:]),
            "tell_ms_last_third": ms(tells[-last:]),
            "driver_ms_per_measured": 1e3 * wall / max(1, bs.measured())}


def _one(args):
    url, trials, rec, pb, seed, q = args
    q.put(run(url, trials, rec, pb, seed))


def together(url: str, trials: int, rec: str, pbs, procs: int, shared: bool) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_one, args=((url, trials, rec, pbs[0 if shared else k], k, q),))
          for k in range(procs)]
    t0 = time.perf_counter()
    for p in ps:
        p.start()
    rs = [q.get() for _ in ps]
    wall = time.perf_counter() - t0
    for p in ps:
        p.join()
    n = sum(r["proposals"] for r in rs)
    return {"storage": url.split(":")[0], "procs": procs, "shared": shared, "proposals": n,
            "wall_s": wall, "proposals_per_s": n / wall,
            "ask_ms": statistics.fmean(r["ask_ms"] for r in rs),
            "tell_ms": statistics.fmean(r["tell_ms"] for r in rs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=120, help="measured variants per storage")
    ap.add_argument("--storages", default="memory,sqlite,journal")
    ap.add_argument("--procs", type=int, default=1, help="drivers at once on one storage")
    ap.add_argument("--shared", action="store_true", help="--procs on one bucket")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import optuna

    from flashtune import targets
    from flashtune.sampler_eval import synthesize
    from flashtune.search import SearchConfig, plan_of

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    h100 = targets.get("H100")
    cfg = SearchConfig(gpu="H100", families=("fwd",), head_dims=(128,),
                       seqlens=(512, 1024, 2048, 4096, 8192, 16384)[:max(1, args.procs)],
                       causal=(True,))
    pbs = plan_of(cfg, h100)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        rec = f"{d}/rec.jsonl"
        synthesize(rec, h100, [pb.problem for pb in pbs], fail_rate=0.03)
        urls = {"memory": "memory", "sqlite": f"sqlite:///{d}/optuna.db",
                "journal": f"journal:///{d}/optuna.journal",
                "journal-optuna": f"journal-optuna:///{d}/optuna-own.journal"}
        for name in args.storages.split(","):
            if args.procs == 1:
                r = run(urls[name], args.trials, rec, pbs[0])
                rows.append(r)
                print(f"{name:<8} {r['measured']:>4} measured in {r['proposals']:>4} proposals: "
                      f"ask {r['ask_ms']:6.1f} ms (last third {r['ask_ms_last_third']:6.1f}), "
                      f"tell {r['tell_ms']:5.1f} ms (last third {r['tell_ms_last_third']:5.1f}); "
                      f"{r['driver_ms_per_measured']:6.1f} ms of driver per measured variant",
                      flush=True)
                continue
            r = together(urls[name], args.trials, rec, pbs, args.procs, args.shared)
            rows.append(r)
            print(f"{name:<14} {args.procs} drivers ({'one bucket' if args.shared else 'a bucket each'}): "
                  f"{r['proposals']} proposals in {r['wall_s']:.1f} s, {r['proposals_per_s']:.1f}/s "
                  f"together; ask {r['ask_ms']:.1f} ms, tell {r['tell_ms']:.1f} ms", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
