"""Search scaling over GPUs: the same search with `--gpus 0`, then `--gpus 0,1` (...), each on
fresh storage and a fresh tuned DB, same seed; wall time, trials per second, and whether the
winners agree within noise. JSON to --out.

    python3 bench/search_scaling.py --gpus 0 0,1 --out $OUT/scaling.json      # on nvidia-h200-x2
    python3 bench/search_scaling.py --gpus 0 0,1 --gpu H100 --replay rec.jsonl   # CPU smoke run

--warm first runs the search once with the most GPUs (its own storage), so that Triton's cache
holds most kernels the measured runs compile: the runs then compare the search, not the
compiler. --cold gives each run an empty Triton and flashtune cache instead (what a first
search on a new machine pays). Each run is a `flashtune search` subprocess; its progress
lines go to <out dir>/scaling-gpus<N>.log.

Reported per run: wall (the command, start-up included), span (first trial started to last
trial done, from the storage: the search without process start-up), measured variants and
trials/s over both; speedups against the first run; per bucket, each run's winner and speed, and
`agree`: the same variant, or speeds within --noise of each other.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def search_args(a, gpus: str, storage: str, db: str) -> list[str]:
    args = [sys.executable, "-m", "flashtune.cli", "search", "--gpu", a.gpu, "--gpus", gpus,
            "--fresh", "--seed", str(a.seed), "--trials", str(a.trials),
            "--head-dim", a.head_dim, "--seqlen", a.seqlen, "--causal", a.causal,
            "--storage", storage, "--db", db, "--progress", "lines", "--format", "json"]
    for f in a.family.split(","):
        args += ["--family", f]
    if a.replay:
        args += ["--replay", a.replay]
    if a.compile_workers:
        args += ["--compile-workers", str(a.compile_workers)]
    return args


def trials_of(storage: str) -> list:
    """Every search trial in the storage (the claims study left out), read once."""
    import optuna

    from flashtune.search_claims import CLAIMS_STUDY
    from flashtune.search_study import make_storage

    st = make_storage(storage)
    return [t for s in optuna.get_all_study_summaries(st, include_best_trial=False)
            if s.study_name != CLAIMS_STUDY
            for t in optuna.load_study(study_name=s.study_name, storage=st).get_trials(deepcopy=False)]


def _measured(t) -> bool:
    from optuna.trial import TrialState

    return t.state == TrialState.COMPLETE and bool((t.user_attrs.get("result") or {}).get("measured"))


def span_of(trials: list) -> tuple[float, int]:
    """(seconds from the first trial's start to the last measured trial's end, measured)."""
    starts = [t.datetime_start for t in trials if t.datetime_start]
    ends = [t.datetime_complete for t in trials if _measured(t)]
    if not ends:
        return 0.0, 0
    return (max(ends) - min(starts)).total_seconds(), len(ends)


def profile_of(trials: list) -> dict:
    """Where a run's time went, per search process, from its trials' timestamps: proposals
    (every ask: measured, infeasible, duplicate, busy), measured trials' latency (asked to told:
    compile, gate and timing, with the queues between) and how many were in flight on average
    (their latencies summed over the process's span)."""
    per: dict = {}
    for t in trials:
        pid = (t.user_attrs.get("owner") or {}).get("pid")
        if pid is None or not t.datetime_start:
            continue
        p = per.setdefault(pid, {"asks": 0, "lat": [], "starts": [], "ends": [], "phases": {}})
        p["asks"] += 1
        p["starts"].append(t.datetime_start)
        if t.datetime_complete:
            p["ends"].append(t.datetime_complete)
        if _measured(t):
            p["lat"].append((t.datetime_complete - t.datetime_start).total_seconds())
            for k, v in (t.user_attrs["result"].get("phases") or {}).items():
                p["phases"].setdefault(k, []).append(v)
    out = {}
    for pid, p in per.items():
        span = (max(p["ends"] or p["starts"]) - min(p["starts"])).total_seconds()
        lat = p["lat"]
        out[str(pid)] = {"asks": p["asks"], "measured": len(lat), "span_s": round(span, 2),
                         "asks_per_s": round(p["asks"] / span, 2) if span else None,
                         "latency_s": round(sum(lat) / len(lat), 3) if lat else None,
                         "in_flight": round(sum(lat) / span, 2) if span else None,
                         "phases_s": {k: round(sum(v) / len(v), 3) for k, v in p["phases"].items()}}
    return out


def run(a, gpus: str, work: Path, log: Path, env: dict) -> dict:
    storage = f"journal:///{work}/optuna.journal"
    db = f"sqlite:///{work}/tuned.db"
    t0 = time.monotonic()
    with open(log, "w") as errf:
        p = subprocess.run(search_args(a, gpus, storage, db), env=env, stdout=subprocess.PIPE,
                           stderr=errf, text=True, timeout=a.timeout)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        tail = log.read_text()[-2000:]
        raise SystemExit(f"--gpus {gpus}: flashtune search exited {p.returncode}\n{tail}")
    summary = json.loads(p.stdout)
    trials = trials_of(storage)
    span, measured = span_of(trials)
    prof = profile_of(trials)
    if a.out:  # the storage itself, for a closer look
        import shutil
        shutil.copy(work / "optuna.journal", Path(a.out).parent / f"{log.stem}.journal")
    return {"gpus": gpus, "n_gpus": len(gpus.split(",")), "wall_s": round(wall, 2),
            "span_s": round(span, 2), "measured": measured,
            "trials_per_s": round(measured / wall, 3) if wall else 0.0,
            "trials_per_s_span": round(measured / span, 3) if span else 0.0,
            "search_wall_s": summary["wall_s"], "notes": summary.get("notes", []),
            "processes": prof,
            "buckets": {b["label"]: {"winner": b["winner"], "speed": b["tflops"],
                                     "unit": b["unit"], "measured": b["measured"],
                                     "status": b["status"], "by": b.get("by")}
                        for b in summary["buckets"]}}


def agree(runs: list[dict], noise: float) -> dict:
    out = {}
    base = runs[0]["buckets"]
    for label, b0 in base.items():
        row = {"winners": [r["buckets"].get(label, {}).get("winner") for r in runs],
               "speeds": [r["buckets"].get(label, {}).get("speed") for r in runs]}
        sp = [s for s in row["speeds"] if s]
        row["agree"] = (len(set(row["winners"])) == 1 or
                        (len(sp) == len(runs) and max(sp) / min(sp) - 1 <= noise))
        out[label] = row
    return out


def repeat_noise(winners: dict) -> dict:
    """How far one variant's measured speed moves between runs: over the buckets every run
    gave the same winner, max/min - 1 of its speeds (what "within noise" can mean for the
    buckets whose winners differ). {} when no bucket has one winner in every run."""
    spreads = sorted(max(w["speeds"]) / min(w["speeds"]) - 1 for w in winners.values()
                     if len(set(w["winners"])) == 1 and all(w["speeds"]))
    if not spreads:
        return {}
    return {"buckets": len(spreads), "median": round(spreads[len(spreads) // 2], 4),
            "max": round(spreads[-1], 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", nargs="+", default=["0", "0,1"], help="one run per value")
    ap.add_argument("--gpu", default="auto")
    ap.add_argument("--family", default="fwd")
    ap.add_argument("--head-dim", default="64,128")
    ap.add_argument("--seqlen", default="1024,4096")
    ap.add_argument("--causal", default="both")
    ap.add_argument("--trials", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile-workers", type=int, default=0)
    ap.add_argument("--replay", default=None, help="a recording: CPU smoke runs")
    ap.add_argument("--warm", action="store_true", help="fill Triton's cache first")
    ap.add_argument("--cold", action="store_true", help="empty caches for every run")
    ap.add_argument("--profile", action="store_true", help="cProfile every worker")
    ap.add_argument("--noise", type=float, default=0.03, help="winners agree within this")
    ap.add_argument("--timeout", type=float, default=540)
    ap.add_argument("--out", default=None, help="JSON results (logs go beside it)")
    a = ap.parse_args(argv)

    out_dir = Path(a.out).parent if a.out else Path(tempfile.mkdtemp(prefix="ft-scaling-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    tmp = Path(tempfile.mkdtemp(prefix="ft-scaling-work-"))
    if a.warm and not a.cold:
        most = max(a.gpus, key=lambda g: len(g.split(",")))
        work = tmp / "warm"
        work.mkdir()
        t0 = time.monotonic()
        run(a, most, work, out_dir / "scaling-warm.log", env)
        print(f"warm-up (--gpus {most}): {time.monotonic() - t0:.0f} s", flush=True)
    runs = []
    for gpus in a.gpus:
        work = tmp / f"gpus{gpus.replace(',', '_')}"
        work.mkdir()
        run_env = dict(env)
        if a.profile:  # each worker's cProfile, beside the JSON
            prof = out_dir / f"prof-gpus{len(gpus.split(','))}"
            prof.mkdir(exist_ok=True)
            run_env["FLASHTUNE_PROFILE_DIR"] = str(prof)
        if a.cold:
            run_env.update(TRITON_CACHE_DIR=str(work / "triton"),
                           FLASHTUNE_CACHE_DIR=str(work / "flashtune"))
        r = run(a, gpus, work, out_dir / f"scaling-gpus{len(gpus.split(','))}.log", run_env)
        runs.append(r)
        print(f"--gpus {gpus:<8} wall {r['wall_s']:7.1f} s  span {r['span_s']:7.1f} s  "
              f"{r['measured']:4d} measured  {r['trials_per_s']:6.2f} trials/s "
              f"({r['trials_per_s_span']:6.2f}/s over the span)", flush=True)
        for n in r["notes"]:
            print(f"  {n}")
        for pid, p in r["processes"].items():
            print(f"  process {pid}: {p['asks']} proposals ({p['asks_per_s']}/s), {p['measured']} "
                  f"measured, {p['latency_s']} s each asked to told, {p['in_flight']} in flight")
            print("    mean s per measured trial: " + ", ".join(f"{k} {v}" for k, v in
                                                          p["phases_s"].items()))
    base = runs[0]
    for r in runs:
        r["speedup_wall"] = round(base["wall_s"] / r["wall_s"], 3) if r["wall_s"] else None
        r["speedup_span"] = round(base["span_s"] / r["span_s"], 3) if r["span_s"] else None
    winners = agree(runs, a.noise)
    print(f"\n{'run':<12} {'wall':>8} {'span':>8} {'trials/s':>9} {'x wall':>7} {'x span':>7}")
    for r in runs:
        print(f"--gpus {r['gpus']:<5} {r['wall_s']:8.1f} {r['span_s']:8.1f} "
              f"{r['trials_per_s']:9.2f} {r['speedup_wall']:7.2f} {r['speedup_span']:7.2f}")
    n_agree = sum(w["agree"] for w in winners.values())
    print(f"\nwinners agree (same variant, or within {a.noise:.0%}): {n_agree}/{len(winners)}")
    for label, w in winners.items():
        if not w["agree"]:
            sp = ", ".join(f"{x:.1f}" if x else "-" for x in w["speeds"])
            gap = (f", {max(w['speeds']) / min(w['speeds']) - 1:.1%} apart"
                   if all(w["speeds"]) else "")
            print(f"  {label}: {' vs '.join(str(x) for x in w['winners'])} ({sp}{gap})")
    noise = repeat_noise(winners)
    if noise:
        print(f"the same winner re-measured by each run ({noise['buckets']} buckets): "
              f"median {noise['median']:.1%}, max {noise['max']:.1%} apart")
    result = {"args": vars(a), "runs": runs, "winners": winners, "agree": n_agree,
              "buckets": len(winners), "repeat_noise": noise}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
