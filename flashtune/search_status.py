"""`flashtune search --status`: what a storage holds for a search plan -- per bucket, variants
measured against the budget, the winner picked and when -- and what is left. Reads only: a
search cut by its time budget or a kill is resumed by running it again on the same storage.

Exit status: 0 when every bucket is done, 3 when some are left.
"""
from __future__ import annotations

import json

import click
import optuna
from optuna.trial import TrialState

LEFT = 3


def bucket_status(storage, pb, trials: int) -> dict:
    from .search_study import _key_of, bucket_label, study_name

    name = study_name(pb.space, pb.bucket)
    row = {"bucket": bucket_label(pb.bucket), "study": name, "trials": trials,
           "feasible": len(pb.space.feasible), "measured": 0, "running": 0, "winner": None,
           "picked_at": None, "state": "not started"}
    try:
        study = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        return row
    keys = set()
    for t in study.get_trials(deepcopy=False):
        r = t.user_attrs.get("result") or {}
        if t.state == TrialState.COMPLETE and r.get("measured") and "variant" in t.user_attrs:
            keys.add(_key_of(t.user_attrs["variant"]))
        elif t.state == TrialState.RUNNING:
            row["running"] += 1
    final = study.user_attrs.get("final") or {}
    row["measured"] = len(keys)
    row["winner"] = (final.get("result") or {}).get("winner")
    row["picked_at"] = final.get("measured")
    target = min(trials, row["feasible"])
    if final and final.get("measured") == len(keys) and (len(keys) >= target
                                                          or final.get("converged")):
        row["state"] = "done"  # (converged: the sampler only repeated itself short of it)
    else:
        row["state"] = "left" if keys or final else "not started"
    return row


def status_rows(cfg, target) -> list[dict]:
    from .search import plan_of
    from .search_study import make_storage

    storage = make_storage(cfg.storage)
    return [bucket_status(storage, pb, cfg.trials) for pb in plan_of(cfg, target)]


def print_status(cfg, target, fmt: str = "table") -> int:
    rows = status_rows(cfg, target)
    done = [r for r in rows if r["state"] == "done"]
    to_go = sum(max(0, min(r["trials"], r["feasible"]) - r["measured"])
                for r in rows if r["state"] != "done")
    if fmt == "json":
        click.echo(json.dumps({"gpu": target.short, "buckets": rows, "done": len(done),
                               "left": len(rows) - len(done), "trials_left": to_go}, indent=2))
    else:
        click.echo(f"{'bucket':<44} {'measured':>9} {'running':>7} {'winner':<36} state")
        for r in rows:
            m = f"{r['measured']}/{min(r['trials'], r['feasible'])}"
            w = r["winner"] or "-"
            if r["winner"] and r["picked_at"] != r["measured"]:
                w += f" (at {r['picked_at']})"
            click.echo(f"{r['bucket']:<44} {m:>9} {r['running']:>7} {w:<36} {r['state']}")
        click.echo(f"\n{target.short}: {len(done)}/{len(rows)} buckets done, "
                   f"{len(rows) - len(done)} left ({to_go} trials to measure)")
    return 0 if len(done) == len(rows) else LEFT
