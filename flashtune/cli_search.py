"""`flashtune search`: tune the GPU present, bucket by bucket, and write the winners to the DB."""
from __future__ import annotations

import dataclasses
import json
import re

import click

from . import env
from .cli_params import DTYPE, DTYPE_HELP, HEAD_DIM, HEAD_DIM_HELP, comma_list


def _split(values, convert, name):
    out = []
    for v in values:
        for part in str(v).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                out.append(convert(part))
            except (ValueError, KeyError):
                raise click.BadParameter(f"cannot read {part!r}", param_hint=name) from None
    return tuple(dict.fromkeys(out))


def _seconds(text):
    if text is None:
        return None
    m = re.fullmatch(r"\s*([\d.]+)\s*([smh]?)\s*", str(text))
    if not m:
        raise click.BadParameter(f"{text!r}: give seconds or a number with s, m or h (90m)",
                                 param_hint="--time-budget")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


@click.command("search")
@click.option("--gpu", default=lambda: env.gpu_override() or "auto", show_default="auto",
              help="GPU to tune (A100, H100, H200, L40S, RTX4090); must be the one present. "
                   "auto: the one present.")
@click.option("--family", "families", multiple=True, default=(),
              help="kernel families (repeat or comma-separate; default: every family with a "
                   "search space that can run on the target: fwd, bwd, splitkv)")
@click.option("--dtype", "dtypes", multiple=True, default=("bf16",), show_default=True,
              callback=comma_list(DTYPE), help=f"{DTYPE_HELP} (repeat or comma-separate)")
@click.option("--head-dim", "head_dims", multiple=True, default=(), callback=comma_list(HEAD_DIM),
              help=f"{HEAD_DIM_HELP} (repeat or comma-separate); buckets pad it to a power of two "
                   "(default: each family's grid -- 64,128,256; splitkv 64,128)")
@click.option("--causal", type=click.Choice(["both", "true", "false"]), default="both",
              show_default=True, help="causal buckets, non-causal ones, or both")
@click.option("--seqlen", "seqlens", multiple=True, default=(),
              help="seqlen buckets (default: each family's grid -- fwd/bwd the standard grid, "
                   "query = key length 512..16k; splitkv the decode grid, keys 2k..128k)")
@click.option("--batch", "batches", multiple=True, default=(),
              help="batch sizes (default: the standard grid's, 16k tokens per batch)")
@click.option("--group", "groups", multiple=True, default=(),
              help="q heads per K/V head of the dense buckets (repeat or comma-separate): 1, MHA "
                   "(the default: the standard grid), 4 for Llama-style GQA; GQA buckets are "
                   "their own (splitkv's decode grid has its own 32/8 and 8/1)")
@click.option("--mask", "masks", multiple=True, default=(),
              help="tune masked buckets: none, window=<keys>, softcap, density=<0..1>, joined "
                   "by '+' (window=4096+softcap); repeat for several; default: none")
@click.option("--trials", type=click.IntRange(1), default=40, show_default=True,
              help="variants measured per bucket (infeasible and repeated proposals are free)")
@click.option("--sampler", type=click.Choice(["tpe", "cmaes", "random", "grid", "exhaustive"]),
              default="tpe", show_default=True, help="the Optuna sampler that proposes variants")
@click.option("--seed", type=int, default=None, help="sampler seed")
@click.option("--db", "db_url", default=None, help="tuned DB URL (default: $FLASHTUNE_DB or the "
              "SQLite file in the cache folder)")
@click.option("--storage", default=None, help="Optuna storage: journal:///file (or a path ending "
              ".journal), sqlite:///file, postgresql://... (share one between hosts to search "
              "together); default: a journal file in the cache folder")
@click.option("--gpus", default=None, help="one search process per GPU of this host, sharing "
              "the storage (0,1,2,3); each has its own compile pool and timing worker")
@click.option("--workers", type=click.IntRange(1), default=1, show_default=True,
              help="timing workers of one search process, one per GPU (--gpus scales better)")
@click.option("--compile-workers", type=click.IntRange(0), default=0,
              help="compile processes (default: spare CPU cores, at most 16)")
@click.option("--resume/--fresh", default=True, show_default=True,
              help="continue the buckets' studies, or delete them and start over")
@click.option("--dry-run", is_flag=True, help="print the buckets and their space sizes; "
              "measures nothing, needs no GPU")
@click.option("--status", "show_status", is_flag=True, help="print what the storage holds for "
              "the plan: per bucket trials measured, winner picked, done or left; measures "
              "nothing, needs no GPU")
@click.option("--time-budget", default=None, help="stop asking after this long (90m, 2h, 600); "
              "shared evenly over the buckets left, or see --in-order")
@click.option("--in-order", is_flag=True, help="with --time-budget: search the buckets to the "
              "end one after another and leave the rest untouched when time is up, for the next "
              "run on the same --storage to resume (tables built over several calls)")
@click.option("--top-k", type=click.IntRange(1), default=5, show_default=True,
              help="candidates re-timed interleaved for the final pick")
@click.option("--trial-timeout", type=float, default=30.0, show_default=True,
              help="seconds a candidate may take on the GPU before its worker is killed (the "
                   "slowest measured trial took 4.6 s; a hung kernel holds the GPU this long)")
@click.option("--replay", type=click.Path(exists=True, dir_okay=False), default=None,
              help="answer from a recorded sweep (bench/sweep.py) instead of measuring: "
                   "tests and sampler studies without a GPU")
@click.option("--no-prune", is_flag=True, hidden=True,
              help="send infeasible variants to the compiler too (checks the model)")
@click.option("--progress", type=click.Choice(["auto", "bars", "lines", "none"]), default="auto",
              show_default=True, help="progress on stderr: bars, lines (one per bucket and "
              "every 10 s) or none; auto: bars on a terminal, lines otherwise")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table",
              show_default=True, help="the summary (or the --dry-run plan) as a table or as JSON")
def search(gpu, families, dtypes, head_dims, causal, seqlens, batches, groups, masks, trials,
           sampler, seed, db_url, storage, gpus, workers, compile_workers, resume, dry_run,
           show_status, time_budget, in_order, top_k, trial_timeout, replay, no_prune, progress,
           fmt):
    """Tune this GPU's kernels and store the winners.

    Searches the kernel variants of each bucket on the GPU present and writes each bucket's
    winner to the tuned DB (`flashtune db export` ships them as a table)."""
    from .timeline import mark
    mark("search command")
    if not (dry_run or show_status):
        from .isolation import start_server
        start_server()
        mark("workers' server started")
    from . import targets
    from .search import SearchConfig, plan_of, resolve_target, run_search
    from .search_progress import make_progress

    from .search_spaces import families as space_families

    known = space_families()
    from .families import names
    fams = _split(families, str, "--family") or tuple(n for n in names() if n in known)
    for f in fams:
        if f not in known:
            raise click.BadParameter(f"{f!r} has no search space; known: {', '.join(known)}",
                                     param_hint="--family")
    from .masks import parse_spec
    try:
        mask_specs = tuple(tuple(sorted(parse_spec(m).items())) for m in masks) or ((),)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--mask") from None
    group_list = _split(groups, int, "--group") or (1,)
    if any(g < 1 for g in group_list):
        raise click.BadParameter(f"q heads per K/V head must be >= 1, got {group_list}",
                                 param_hint="--group")
    cfg = SearchConfig(masks=mask_specs, groups=group_list,
        gpu=gpu, families=fams, dtypes=dtypes, head_dims=head_dims,
        causal={"both": (False, True), "true": (True,), "false": (False,)}[causal],
        seqlens=_split(seqlens, int, "--seqlen"), batches=_split(batches, int, "--batch"),
        trials=trials, sampler=sampler, seed=seed, storage=storage, db=db_url, workers=workers,
        gpus=_split((gpus,), int, "--gpus") if gpus else (),
        compile_workers=compile_workers, resume=resume, time_budget_s=_seconds(time_budget),
        in_order=in_order,
        top_k=top_k, trial_timeout_s=trial_timeout, prune=not no_prune, replay=replay)
    try:
        # --status reads storage only: any GPU may be named; auto detects the one present
        target = resolve_target(cfg, dry_run=dry_run or (show_status and gpu != "auto"))
    except targets.GpuMismatch as e:
        raise click.BadParameter(str(e).removeprefix("--gpu "), param_hint="--gpu") from None
    mark("target resolved")
    if not families:  # the default: every family that runs on the target's arch
        from .families import get
        cap = target.capability[0] * 10 + target.capability[1]
        cfg = dataclasses.replace(cfg, families=tuple(
            f for f in fams if get(f).min_capability <= cap <= (get(f).max_capability or cap)))
    if dry_run:
        _dry_run(cfg, target, plan_of(cfg, target), fmt)
        return
    if show_status:
        from .search_status import print_status
        raise SystemExit(print_status(cfg, target, fmt))
    try:
        result = run_search(cfg, target=target, progress=make_progress(progress))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    _summary(result, fmt)
    mark("summary written")
    global _FINISHED
    _FINISHED = True
    if result.interrupted:
        raise SystemExit(130)


_FINISHED = False


def search_finished() -> bool:
    """A search ran to its summary in this process (`cli.entry` may then skip the teardown)."""
    return _FINISHED


def _dry_run(cfg, target, planned, fmt):
    from .search_study import bucket_label, study_name

    rows = []
    for pb in planned:
        rows.append({"bucket": bucket_label(pb.bucket), "study": study_name(pb.space, pb.bucket),
                     "problem": dict(pb.problem.__dict__), "sizes": pb.space.sizes(),
                     "params": {p.name: list(p.values) for p in pb.space.params},
                     "when": {p.name: p.when for p in pb.space.params if p.when},
                     "pinned": dict(pb.space.pinned),
                     "dropped": [f"{n}={v} (needs {f})" for n, v, f in pb.space.dropped]})
    if fmt == "json":
        click.echo(json.dumps({"gpu": target.short, "buckets": rows}, indent=2, default=str))
        return
    feats = ", ".join(sorted(target.features)) or "none"
    click.echo(f"dry run: {target.short} ({target.name}, {target.arch}, {target.sm_count} SMs, "
               f"{target.smem_per_block // 1024} KiB shared memory per block, features: {feats})")
    click.echo(f"sampler {cfg.sampler}, {cfg.trials} trials per bucket, {len(rows)} buckets")
    click.echo(f"\n{'bucket':<42} {'file':>6} {'target':>7} {'constr.':>8} {'feasible':>9}")
    for r in rows:
        s = r["sizes"]
        click.echo(f"{r['bucket']:<42} {s['file']:>6} {s['target']:>7} {s['constraints']:>8} "
                   f"{s['feasible']:>9}")
    if rows:
        click.echo("\nsizes: file = the product of search_spaces/<family>.json's lists; target = "
                   "after dropping what the GPU lacks and pinning what the problem ignores; "
                   "constr. = after the constraints; feasible = after the resource model")
        for fam in dict.fromkeys(pb.bucket.family for pb in planned):
            r = next(r for r, pb in zip(rows, planned) if pb.bucket.family == fam)
            click.echo(f"\n{fam} params on {target.short}:")
            for k, v in r["params"].items():
                only = f"  (only when {r['when'][k]})" if k in r["when"] else ""
                click.echo(f"  {k:<14} {', '.join(str(x) for x in v)}{only}")
            dropped = sorted({d for r2 in rows for d in r2["dropped"]})
            if dropped:
                click.echo(f"  not proposed   {'; '.join(dropped)}")


def _summary(result, fmt):
    if fmt == "json":
        import dataclasses
        click.echo(json.dumps(dict(dataclasses.asdict(result), trials_per_s=result.trials_per_s),
                              indent=2, default=str))
        return
    click.echo(f"\n{'bucket':<42} {'meas.':>5} {'fail':>4} {'winner':<34} {'speed':>8} "
               f"{'default':>8} {'unit':<7} {'speedup':>7} {'wall':>6}  status")
    for r in result.buckets:
        f = (lambda x: f"{x:8.1f}" if x else f"{'-':>8}")
        sp = f"{r.speedup:6.2f}x" if r.speedup else f"{'-':>7}"
        click.echo(f"{r.label:<42} {r.measured:>5} {r.failed:>4} {r.winner or '-':<34} "
                   f"{f(r.tflops)} {f(r.default_tflops)} {r.unit:<7} {sp} {r.wall_s:5.0f}s  "
                   f"{r.status}")
    for n in result.notes:
        click.echo(n)
    click.echo(f"\n{result.target}: {len(result.buckets)} buckets in {result.wall_s:.0f} s, "
               f"{result.measured} variants measured ({result.trials_per_s:.2f}/s), "
               f"{result.db_written} winners written to the tuned DB"
               + (" (interrupted: completed trials are kept; re-run to resume)"
                  if result.interrupted else ""))
