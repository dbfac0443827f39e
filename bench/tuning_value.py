"""Tuning value (issue 12): what a tuned table is worth on the GPU present, against the built-in
defaults and against the single config that is best over the family's whole grid.

    python3 bench/tuning_value.py                  # this GPU's shipped table, every family in it
    python3 bench/tuning_value.py --family fwd --head-dim 128 --budget 200
    python3 bench/tuning_value.py --table tuned_db/tables/nvidia-h100-80gb-hbm3.json  # the H100
                                                   # table used here (e.g. on an H200)
    python3 bench/tuning_value.py --replay rec.jsonl --table t.json   # recorded timings, no GPU

Buckets: those `flashtune search` tunes for the family (search_plan.plan over the family's grid,
causal and not, at the dtypes and head dims the table has records of the family for, or
--head-dim; --seqlen narrows the grid), each timed at its representative problem. A bucket the
table has no record for is skipped, and the summary says so.

Configs timed in a bucket: the table's record for it ("tuned"), the built-in default the
dispatcher runs untuned ("default", search.default_for) and the candidates ("candidate"): every
distinct winner of the family's dense records in the table. A config with several roles is timed
once. Each goes through the search's own pipeline (compile ahead, the float64 gate, a median
time), then all that passed are re-timed interleaved in one call (`--rounds` rounds in shuffled
order: the search's final-pick re-timing), so the configs of a bucket are compared side by side.
A candidate the feasibility model rules out is a row with stage "infeasible" (not compiled); the
record and the default are always tried, as the dispatcher would run them. Failures are rows with
their stage and reason (compile, gate, launch, timeout, crash), never a crash of the script.

Single best: the candidate with the smallest geometric mean, over the measured buckets, of its
time / the fastest config's time in that bucket. A candidate that failed or is infeasible in a
bucket is charged there the slowest time any config took in that bucket (a loss, never a gain).
"Tuned vs single best" then compares over the buckets where both ran and counts the buckets where
the single best failed.

Noise: the tuned record is "slower than the default" in a bucket when its time exceeds the
default's by more than the larger of the two re-timings' spreads (max / min of the round medians,
minus 1) and --noise (1%, the search's own "within noise").

Budget: --budget seconds in all, shared over the families by their number of configs to time
(what one leaves goes to the next); a bucket is started only while its family has time left. A
bucket cut mid-way keeps its rows in --out but is skipped in the summary ("cut by --budget": its
configs were not re-timed together). Lines are written as they are measured, so a killed run
keeps what it measured.

Output (--out, default $OUT/tuning_value.jsonl, JSON lines): one "meta" line (GPU, table, the
timing worker's environment); one "row" per measured (bucket, config): variant, roles, ok, ms
(the interleaved median; "timed": "measure" when the re-timing failed and the single measurement
stands in), spread, stage, reason, max_err, speed in the family's unit; then one "summary" per
family: tuned vs default (geomean speedup, worst bucket and which), the single best and tuned vs
it, the buckets where the tuned record is slower than the default beyond noise, the buckets where
it failed, and the buckets measured / skipped (with why). Speedups are time ratios: above 1 means
the tuned record is faster. A short table is printed at the end.

--replay RECORDING answers from recorded timings (flashtune/replay.py's format; its trial lines'
"spread" is what the re-timing reports), inline in this process, with no GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# -- measuring ------------------------------------------------------------------------------------
def bucket_configs(tuned, default, winners, against=None) -> dict:
    """{variant key: (variant, roles)}: each config once, with every role it plays (against:
    another table's record of the bucket)."""
    out: dict = {}
    for v, role in ([(tuned, "tuned"), (default, "default"), (against, "against")]
                    + [(w, "candidate") for w in winners]):
        if v is not None:
            out.setdefault(v.key, (v, []))[1].append(role)
    return out


def measure_bucket(pipe, pb, configs: dict, target, rounds: int, deadline: float, family):
    """Rows of one bucket's configs (gate + time each through the pipeline, then re-time those
    that passed, interleaved) and whether every config was measured before `deadline`."""
    from flashtune import feasibility
    from flashtune.measure import Outcome

    outcomes, futs = {}, {}
    for k, (v, roles) in configs.items():
        if roles == ["candidate"]:  # another bucket's winner: the model may rule it out here
            verdict = feasibility.check(v, pb.problem, target)
            if not verdict.ok:
                outcomes[k] = Outcome.fail("infeasible", verdict.reason)
                continue
        futs[pipe.submit(v, pb.problem)] = k
    pending = set(futs)
    while pending:
        left = deadline - time.monotonic()
        done, pending = wait(pending, timeout=max(0.0, min(left, 1.0)),
                             return_when=FIRST_COMPLETED)
        for fu in done:
            outcomes[futs[fu]] = fu.result()
        if left <= 0:
            break
    for fu in pending:
        fu.cancel()
    complete = not pending
    passed = [k for k in configs if k in outcomes and outcomes[k].ok]
    timed = {}
    if complete and passed:
        timed = dict(zip(passed, pipe.retime([configs[k][0] for k in passed], pb.problem,
                                             rounds)))
    rows = []
    for k, (v, roles) in configs.items():
        o = outcomes.get(k)
        if o is None:
            continue  # cut by the budget before it was measured
        t = timed.get(k)
        ms, spread, how = ((t[0], t[1], "retime") if t else
                           (o.ms, None, "measure") if o.ok else (None, None, None))
        rows.append({"kind": "row", "family": pb.bucket.family, "bucket": _label(pb.bucket),
                     "variant": v.name, "roles": roles, "ok": ms is not None, "ms": ms,
                     "spread": spread, "timed": how, "stage": o.stage, "reason": o.reason,
                     "max_err": o.max_err,
                     "speed": family.throughput(pb.problem, ms) if ms else None,
                     "unit": family.unit})
    return rows, complete


@dataclass
class FamilyPlan:
    """One family's buckets to measure (each with its configs) and those skipped, with why."""
    name: str
    work: list = field(default_factory=list)       # (PlannedBucket, configs)
    skipped: dict = field(default_factory=dict)    # label -> why
    records_off_grid: int = 0

    @property
    def configs(self) -> int:
        return sum(len(c) for _, c in self.work)


def plan_family(name, table, target, args, replay: bool, against=None) -> FamilyPlan:
    """The buckets `flashtune search` tunes for `name` that the table has a record for (with
    `against`, another table, its record of each bucket too; without single-best candidates
    when args.no_single)."""
    from flashtune.families import get
    from flashtune.search import default_for
    from flashtune.search_plan import plan
    from flashtune.tuned_db.io import bucket_order

    family = get(name)
    recs = sorted((r for r in table.records if r.bucket.family == name), key=bucket_order)
    by_bucket = {r.bucket.key: r for r in recs}
    # masked records' variants carry mask code: the dense grid's candidates are the dense winners
    winners = ([] if getattr(args, "no_single", False) else
               list(dict.fromkeys(r.variant for r in recs if not r.bucket.mask)))
    theirs = {r.bucket.key: r.variant for r in (against.records if against else ())}
    head_dims = tuple(args.head_dim) or tuple(sorted({r.bucket.head_dim for r in recs}))
    dtypes = tuple(sorted({r.bucket.dtype for r in recs}))
    planned = plan(target, (name,), dtypes, head_dims, (False, True), tuple(args.seqlen))
    fp = FamilyPlan(name)
    for pb in planned:
        rec = by_bucket.get(pb.bucket.key)
        if rec is None:
            fp.skipped[_label(pb.bucket)] = "no record in the table"
            continue
        why = "" if replay else family.cannot_run(pb.problem, target.arch)
        if why:
            fp.skipped[_label(pb.bucket)] = f"cannot run here: {why}"
            continue
        fp.work.append((pb, bucket_configs(rec.variant, default_for(pb), winners,
                                           theirs.get(pb.bucket.key))))
    on_grid = {pb.bucket.key for pb in planned}
    fp.records_off_grid = sum(r.bucket.key not in on_grid for r in recs)
    return fp


def run_family(fp: FamilyPlan, target, pipe, args, deadline, emit) -> dict:
    """Measure one family's planned buckets until `deadline`; returns its summary."""
    from flashtune.families import get

    family = get(fp.name)
    measured, skipped = {}, dict(fp.skipped)
    for pb, configs in fp.work:
        label = _label(pb.bucket)
        if time.monotonic() >= deadline:
            skipped[label] = "cut by --budget"
            continue
        rows, complete = measure_bucket(pipe, pb, configs, target, args.rounds, deadline, family)
        for r in rows:
            emit(r)
        if complete:
            measured[label] = rows
        else:
            skipped[label] = "cut by --budget"
        t = _role(rows, "tuned")
        d = _role(rows, "default")
        vs = (f"tuned/default {d['ms'] / t['ms']:.3f}x" if t and d and t["ok"] and d["ok"]
              else "tuned or default failed")
        print(f"  {label:<44} {sum(r['ok'] for r in rows)}/{len(configs)} ran, {vs}"
              f"{'' if complete else ' (cut by --budget)'}", flush=True)
    s = summarize(fp.name, measured, skipped, args.noise, family.unit)
    s["records_off_grid"] = fp.records_off_grid
    return s


# -- the summary (pure: rows in, numbers out) -----------------------------------------------------
def geomean(xs) -> float | None:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _role(rows, role):
    return next((r for r in rows if role in r["roles"]), None)


def _ratios(per: dict) -> dict:
    """{bucket: speedup} -> geomean, worst (smallest) and its bucket, count."""
    if not per:
        return {"geomean": None, "worst": None, "worst_bucket": None, "buckets": 0,
                "per_bucket": {}}
    worst = min(per, key=lambda b: (per[b], b))
    return {"geomean": geomean(per.values()), "worst": per[worst], "worst_bucket": worst,
            "buckets": len(per), "per_bucket": per}


def single_best(buckets: dict) -> tuple[str | None, dict]:
    """(name, {candidate: score}): score = geomean over buckets of time / the bucket's fastest,
    a failure charged the bucket's slowest measured time."""
    cands = list(dict.fromkeys(r["variant"] for rows in buckets.values() for r in rows
                               if "candidate" in r["roles"]))
    logs: dict = {c: [] for c in cands}
    for rows in buckets.values():
        times = [r["ms"] for r in rows if r["ok"]]
        if not times:
            continue  # nothing ran here: it says nothing about any candidate
        best, worst = min(times), max(times)
        ms = {r["variant"]: r["ms"] for r in rows if r["ok"]}
        for c in cands:
            logs[c].append(math.log(ms.get(c, worst) / best))
    score = {c: math.exp(sum(v) / len(v)) for c, v in logs.items() if v}
    if not score:
        return None, {}
    return min(score, key=lambda c: (score[c], c)), score


def summarize(family: str, buckets: dict, skipped: dict, noise: float, unit: str = "") -> dict:
    """buckets: {label: rows} of the buckets measured completely; skipped: {label: why}."""
    vs_default, slower, failed = {}, [], []
    for label, rows in buckets.items():
        t, d = _role(rows, "tuned"), _role(rows, "default")
        if t is not None and not t["ok"]:
            failed.append({"bucket": label, "variant": t["variant"], "stage": t["stage"],
                           "reason": t["reason"]})
        if t is None or d is None or not (t["ok"] and d["ok"]):
            continue
        vs_default[label] = d["ms"] / t["ms"]
        band = max(noise, t["spread"] or 0.0, d["spread"] or 0.0)
        if t["ms"] > d["ms"] * (1 + band):
            slower.append({"bucket": label, "tuned": t["variant"], "tuned_ms": t["ms"],
                           "default": d["variant"], "default_ms": d["ms"],
                           "slowdown": t["ms"] / d["ms"] - 1, "noise": band})
    vs_against = {}
    for label, rows in buckets.items():
        t, o = _role(rows, "tuned"), _role(rows, "against")
        if t is not None and o is not None and t["ok"] and o["ok"]:
            vs_against[label] = o["ms"] / t["ms"]
    best, scores = single_best(buckets)
    vs_single, single_failed = {}, []
    for label, rows in buckets.items():
        t = _role(rows, "tuned")
        s = next((r for r in rows if r["variant"] == best), None)
        if s is None or not s["ok"]:
            single_failed.append(label)
        elif t is not None and t["ok"]:
            vs_single[label] = s["ms"] / t["ms"]
    return {"kind": "summary", "family": family, "unit": unit,
            "buckets": len(buckets) + len(skipped), "measured": len(buckets),
            "skipped": len(skipped), "skipped_buckets": skipped,
            "tuned_vs_default": _ratios(vs_default),
            "single_best": {"variant": best, "score": scores.get(best),
                            "failed_in": single_failed, "scores": scores},
            "tuned_vs_single": _ratios(vs_single),
            "tuned_vs_against": _ratios(vs_against),
            "slower_than_default": slower, "tuned_failed": failed, "noise": noise}


def _label(b) -> str:
    from flashtune.search_study import bucket_label
    return bucket_label(b)


def print_table(summaries: list, out=sys.stdout) -> None:
    x = (lambda v: f"{v:.3f}x" if v is not None else "-")
    print(f"\n{'family':<11} {'meas.':>5} {'skip':>4}  {'tuned/default':>13} {'worst':>7} "
          f"{'bucket':<44} {'tuned/single':>12} {'worst':>7}  single best", file=out)
    for s in summaries:
        d, g = s["tuned_vs_default"], s["tuned_vs_single"]
        print(f"{s['family']:<11} {s['measured']:>5} {s['skipped']:>4}  {x(d['geomean']):>13} "
              f"{x(d['worst']):>7} {d['worst_bucket'] or '-':<44} {x(g['geomean']):>12} "
              f"{x(g['worst']):>7}  {s['single_best']['variant'] or '-'}"
              + (f" (failed in {len(s['single_best']['failed_in'])})"
                 if s['single_best']['failed_in'] else ""), file=out)
    if any(s["tuned_vs_against"]["buckets"] for s in summaries):
        print(f"\n{'family':<11} {'tuned/against':>13} {'worst':>7} {'bucket':<44} "
              f"{'best':>7} {'bucket':<44}", file=out)
        for s in summaries:
            g = s["tuned_vs_against"]
            if g["buckets"]:
                best = max(g["per_bucket"], key=lambda b: (g["per_bucket"][b], b))
                print(f"{s['family']:<11} {x(g['geomean']):>13} {x(g['worst']):>7} "
                      f"{g['worst_bucket']:<44} {x(g['per_bucket'][best]):>7} {best:<44}",
                      file=out)
    for s in summaries:
        for r in s["slower_than_default"]:
            print(f"  {s['family']}: tuned slower than the default beyond noise in {r['bucket']}: "
                  f"{r['tuned']} {r['tuned_ms']:.4f} ms vs {r['default']} {r['default_ms']:.4f} ms "
                  f"(+{100 * r['slowdown']:.1f}%, noise {100 * r['noise']:.1f}%)", file=out)
        for r in s["tuned_failed"]:
            print(f"  {s['family']}: the tuned record FAILED in {r['bucket']}: {r['variant']} "
                  f"({r['stage']}: {r['reason'][:120]})", file=out)
        why: dict = {}
        for reason in s["skipped_buckets"].values():
            why[reason] = why.get(reason, 0) + 1
        if why:
            print(f"  {s['family']}: skipped " + ", ".join(f"{n} ({w})" for w, n in why.items()),
                  file=out)
    print("speedups are time ratios (default, single best or the --against table's record / "
          "tuned): above 1, the tuned record is faster", file=out)


# -- main -----------------------------------------------------------------------------------------
def _parser():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", action="append", default=[],
                    help="kernel family (repeat); default: every family the table has records of")
    ap.add_argument("--table", help="a tuned table (default: the shipped table of the GPU present,"
                    " or of the recording's GPU with --replay)")
    ap.add_argument("--against", help="another tuned table: its record of each bucket is timed "
                    "beside the table's (e.g. the H200 table against the H100 table on an H200)")
    ap.add_argument("--no-single", action="store_true",
                    help="leave out the single-best candidates (time tuned, default, --against)")
    ap.add_argument("--head-dim", type=int, action="append", default=[],
                    help="head dims (repeat); default: those of the table's records per family")
    ap.add_argument("--seqlen", type=int, action="append", default=[],
                    help="narrow the grid to these seqlens (repeat; splitkv: key lengths)")
    ap.add_argument("--budget", type=float, default=400.0, help="seconds of measuring in all")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved re-timing rounds")
    ap.add_argument("--noise", type=float, default=0.01,
                    help="the least relative difference counted as slower (default 1%%)")
    ap.add_argument("--bench-ms", type=float, default=20.0,
                    help="timing budget of each config's first measurement (the re-timing decides)")
    ap.add_argument("--compile-workers", type=int, default=0)
    ap.add_argument("--replay", help="a recording (flashtune/replay.py): no GPU")
    ap.add_argument("--out", help="JSON lines (default $OUT/tuning_value.jsonl)")
    return ap


def main(argv=None) -> int:
    from flashtune.families import names

    ap = _parser()
    a = ap.parse_args(argv)
    for f in a.family:
        if f not in names():
            ap.error(f"--family {f!r}: unknown kernel family; known: {', '.join(names())}")
    if a.rounds < 1:
        ap.error(f"--rounds {a.rounds}: expected at least 1")
    if a.budget <= 0:
        ap.error(f"--budget {a.budget}: expected seconds > 0")
    for opt, vals in (("--head-dim", a.head_dim), ("--seqlen", a.seqlen)):
        if any(v < 1 for v in vals):
            ap.error(f"{opt} {min(vals)}: expected a positive integer")
    if a.noise < 0:
        ap.error(f"--noise {a.noise}: expected a fraction >= 0")
    if a.replay and not Path(a.replay).is_file():
        ap.error(f"--replay {a.replay}: no such file")
    if a.table and not Path(a.table).is_file():
        ap.error(f"--table {a.table}: no such file")
    if a.against and not Path(a.against).is_file():
        ap.error(f"--against {a.against}: no such file")

    from flashtune import targets
    from flashtune.pipeline import Pipeline
    from flashtune.tuned_db.errors import TableError
    from flashtune.tuned_db.io import read_table, table_path

    if a.replay:
        from flashtune.replay import ReplayBackend, read_recording
        try:
            target = targets.get(read_recording(a.replay)[0]["gpu"])
        except (ValueError, KeyError) as e:
            ap.error(f"--replay {a.replay}: {e}")
        backend = ReplayBackend(a.replay)
    else:
        target = targets.detect()
        if target is None:
            ap.error("no CUDA GPU found: bench/tuning_value.py measures on the GPU present "
                     "(or pass --replay RECORDING)")
        from flashtune.measure_gpu import GpuBackend
        backend = GpuBackend(smem_limit=target.smem_per_block, bench_ms=a.bench_ms,
                             flush_bytes=max(2 * target.l2_bytes, 256 << 20))
    path = Path(a.table) if a.table else table_path(target)
    if not a.table and not path.is_file():
        ap.error(f"no shipped table for {target.name} ({path}); pass --table")
    try:
        table = read_table(path)
    except TableError as e:
        ap.error(f"--table {path}: {e}")
    have = [n for n in names() if any(r.bucket.family == n for r in table.records)]
    for f in a.family:
        if f not in have:
            ap.error(f"--family {f}: the table {path} has no records of it (it has: "
                     f"{', '.join(have) or 'none'})")
    fams = list(dict.fromkeys(a.family)) or have
    if not fams:
        ap.error(f"--table {path} has no records")

    against = None
    if a.against:
        try:
            against = read_table(a.against)
        except TableError as e:
            ap.error(f"--against {a.against}: {e}")
    plans = [plan_family(n, table, target, a, bool(a.replay), against) for n in fams]
    out = Path(a.out) if a.out else Path(os.environ.get("OUT") or ".") / "tuning_value.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    if a.replay:
        pipe = Pipeline(backend, inline=True)  # replayed numbers need no isolation
    else:
        cw = a.compile_workers or max(1, min(15, (os.cpu_count() or 2) - 1))
        pipe = Pipeline(backend, devices=(0,), compile_workers=cw, trial_timeout=60)
    t0 = time.monotonic()
    deadline = t0 + a.budget
    summaries = []
    try:
        pipe.start()
        meta = {"kind": "meta", "gpu": target.short, **pipe.info, "table": str(path),
                "against": a.against, "single": not a.no_single,
                "table_gpu": table.gpu, "table_arch": table.arch, "families": fams,
                "planned": {p.name: {"buckets": len(p.work), "configs": p.configs}
                            for p in plans},
                "rounds": a.rounds, "noise": a.noise, "budget_s": a.budget,
                "bench_ms": a.bench_ms, "replay": a.replay,
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        with open(out, "w") as f:
            def emit(d):
                f.write(json.dumps(d, sort_keys=True, default=str) + "\n")
                f.flush()
            emit(meta)
            print(f"tuning value of {path.name} ({table.gpu_name or table.gpu}) on "
                  f"{pipe.info.get('gpu_name') or target.name}"
                  f"{' (replayed: ' + Path(a.replay).name + ')' if a.replay else ''}", flush=True)
            for i, fp in enumerate(plans):
                # the time left, shared by the configs left to time
                now, left = time.monotonic(), sum(p.configs for p in plans[i:])
                share = now + max(0.0, deadline - now) * (fp.configs / left if left else 1.0)
                print(f"{fp.name}: {len(fp.work)} buckets, {fp.configs} configs to time, "
                      f"{share - now:.0f} s", flush=True)
                s = run_family(fp, target, pipe, a, share, emit)
                emit(s)
                summaries.append(s)
    finally:
        pipe.close(kill=True)
    print(f"{time.monotonic() - t0:.0f} s -> {out}")
    print_table(summaries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
