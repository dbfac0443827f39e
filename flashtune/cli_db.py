"""`flashtune db show|export|import|diff` and `flashtune dispatch explain`: thin commands over
flashtune.tuned_db and flashtune.dispatch."""
from __future__ import annotations

import json
from pathlib import Path

import click

from .cli_params import DTYPE, DTYPE_HELP, HEAD_DIM, HEAD_DIM_HELP
from .tuned_db.errors import TunedDBError

_db_option = click.option("--db", "db_url", metavar="URL", default=None,
                          help="SQLAlchemy URL of the tuned DB (default: FLASHTUNE_DB, else the "
                               "SQLite file in the cache folder)")
_format_option = click.option("--format", "fmt", type=click.Choice(["table", "json"]),
                              default="table", show_default=True,
                              help="a table for reading, or JSON for scripts")


def _fail(e: Exception):
    raise click.ClickException(str(e)) from None


def _open(url):
    from .tuned_db import TunedDB
    return TunedDB(url)


def _slug(gpu):
    from .tuned_db.gpu import gpu_slug
    return None if gpu is None else gpu_slug(gpu)


def _records_of(spec: str, gpu):
    """Records of a table file, or of a DB when `spec` is a URL (has '://')."""
    from .tuned_db.io import read_table
    if "://" in spec:
        return _open(spec).records(gpu=gpu)
    recs = read_table(spec).records
    return [r for r in recs if gpu is None or r.gpu == gpu]


def _bucket_cells(b) -> list[str]:
    return [b.family, b.dtype, str(b.head_dim), "y" if b.causal else "n", "y" if b.gqa else "n",
            str(b.seqlen_q), str(b.seqlen_k), str(b.batch_heads)]


_BUCKET_HEAD = ["family", "dtype", "d", "causal", "gqa", "Nq", "Nk", "BH"]


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


@click.group()
def db():
    """The tuned DB and the shipped per-GPU tables."""


@db.command("show")
@click.option("--gpu", default=None,
              help="the GPU to show (H100, a device name or a slug; default: FLASHTUNE_GPU, else "
                   "the GPU detected)")
@click.option("--family", default=None, help="only this kernel family")
@click.option("--table", "table_file", type=click.Path(dir_okay=False), default=None,
              help="show this table file only, instead of the lookup levels")
@click.option("--tables", type=click.Path(file_okay=False), default=None,
              help="a folder of tables instead of the shipped ones")
@_db_option
@_format_option
def show(gpu, family, table_file, tables, db_url, fmt):
    """List the records that serve a GPU.

    Each with its source, in the dispatcher's lookup order: the user DB, then the shipped
    table of the GPU, then the shipped tables of its architecture. A record is "shadowed" when
    one of its bucket earlier in that order (or a fresh one, if it is stale) serves instead.
    Exits 1 if a level could not be read (the dispatcher would skip it)."""
    from .tuned_db import lookup
    if table_file:
        try:
            recs = _records_of(table_file, _slug(gpu))
        except TunedDBError as e:
            _fail(e)
        sources = [lookup.Source("table", table_file, tuple(recs))]
        slug = None
    else:
        slug, arch = _show_gpu(gpu)
        sources = _levels(slug, arch, db_url, tables)
    rows = _show_rows(sources, family)
    problems = [e for s in sources for e in s.errors]
    if fmt == "json":
        click.echo(json.dumps({"gpu": slug, "records": [_row_dict(r) for r in rows],
                               "levels": [{"level": s.level, "source": s.origin,
                                           "records": len(s.records), "notes": list(s.notes),
                                           "errors": list(s.errors)} for s in sources]},
                              indent=2, sort_keys=True))
    else:
        _print_show(slug, sources, rows)
    if problems:
        if fmt != "json":
            for e in problems:
                click.echo(f"error: {e}", err=True)
        raise SystemExit(1)


def _show_gpu(gpu) -> tuple[str, str]:
    """(slug, arch) of --gpu, else FLASHTUNE_GPU, else the GPU detected (as the dispatcher)."""
    from . import env, targets
    from .tuned_db.gpu import gpu_slug, target_of
    name = gpu or env.gpu_override()
    if name:
        t = target_of(name)
        return (t.slug, t.arch) if t else (gpu_slug(name), "")
    t = targets.detect()
    if t is None:
        raise click.UsageError("no GPU detected here: pass --gpu (H100, A100, ...) to list what "
                               "serves that GPU, or --table FILE to show one table file")
    return t.slug, t.arch


def _levels(slug, arch, db_url, tables):
    from . import env
    from .tuned_db import lookup
    from .tuned_db.io import TABLES_DIR
    default = env.cache_dir() / "tuned.db"
    return lookup.levels(slug, arch, db_url or env.db_url(), f"sqlite:///{default}",
                         default.exists(), Path(tables) if tables else TABLES_DIR)


def _show_rows(sources, family) -> list[tuple]:
    """(source, record, status, stale, notes) per record, in lookup order. status: "serves",
    "stale" (serves, with a warning), "shadowed" (never chosen), or "-" outside the lookup."""
    from .tuned_db import lookup
    out = []
    for s in sources:
        for r in s.records:
            if family is not None and r.bucket.family != family:
                continue
            stale = lookup.staleness(r)
            if s.level in lookup.LEVELS:
                won = lookup.best(r.bucket, sources)  # a record serves anything iff it wins its own
                status = ("stale" if stale else "serves") if won and won.record is r else "shadowed"
            else:
                status = "-"
            out.append((s, r, status, stale, lookup.record_notes(r)))
    return out


def _row_dict(row) -> dict:
    s, r, status, stale, notes = row
    return {"level": s.level, "source": s.origin, "status": status, "stale": list(stale),
            "notes": list(notes), "record": r.to_dict()}


def _print_show(slug, sources, rows):
    if slug is not None:
        click.echo(f"records serving {slug}, in lookup order:")
    for s in sources:
        click.echo(f"  {s.level:<10} {s.origin}: {len(s.records)} record(s)")
    table = []
    for s, r, status, _, _ in rows:
        p = r.provenance
        where = s.origin if s.level == "user-db" else Path(s.origin).name  # full path above
        table.append([s.level, where] + _bucket_cells(r.bucket) + [
            r.variant.name, f"{r.median_ms:.4g}", f"{r.throughput:.4g} {r.unit}",
            f"{r.max_err:.2g}", p.source, p.triton, p.date[:10], status])
    if table:
        click.echo()
        click.echo(_table(["level", "source"] + _BUCKET_HEAD + [
            "variant", "ms", "throughput", "err", "found", "triton", "date", "status"], table))
    for n in dict.fromkeys(n for row in rows for n in row[3] + row[4]):
        click.echo(f"note: {n}")
    click.echo(f"{len(rows)} record(s)")


@db.command("export")
@click.option("--gpu", required=True, help="the GPU whose records to export (H100, a name or slug)")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="the table file (default: the shipped tuned_db/tables/<gpu-slug>.json)")
@_db_option
def export(gpu, output, db_url):
    """Write the DB's records of one GPU as a shipped table."""
    from .tuned_db.io import table_path, write_table
    slug = _slug(gpu)
    try:
        db_ = _open(db_url)
        recs = db_.records(gpu=slug)
        if not recs:  # an empty table would shadow nothing yet look like a shipped result
            _fail(ValueError(f"{db_.display_url} has no records of {slug}: nothing to export "
                             f"(run `flashtune search --gpu {gpu}` on that GPU first); no file "
                             "written"))
        path = write_table(output or table_path(slug), slug, recs)
    except (TunedDBError, ValueError) as e:
        _fail(e)
    click.echo(f"wrote {len(recs)} record(s) of {slug} to {path}")


@db.command("import")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--mark-imported", is_flag=True,
              help="set provenance.source to 'import' (default: keep how each was found)")
@click.option("--keep-faster", is_flag=True,
              help="leave a bucket's record in the DB where it is at least as fast as the "
                   "file's (merging a partial re-search into a table: a bucket measured in a "
                   "slow moment does not replace a better record); where the file's run also "
                   "timed the DB record's variant (a runner-up), that run's numbers decide")
@_db_option
def import_(files, mark_imported, keep_faster, db_url):
    """Upsert table files into the DB.

    Every record of FILES is checked before any is written."""
    import dataclasses

    from .tuned_db.io import read_table
    try:
        recs = [r for f in files for r in read_table(f).records]
        if mark_imported:
            recs = [dataclasses.replace(r, provenance=dataclasses.replace(
                r.provenance, source="import")) for r in recs]
        db_ = _open(db_url)
        kept = []
        if keep_faster:
            from .tuned_db.record import keeps
            old = {(r.gpu, r.bucket): r for r in db_.records()}
            decided = [(r, *keeps(old[(r.gpu, r.bucket)], r)) if (r.gpu, r.bucket) in old
                       else (r, False, "") for r in recs]
            kept = [(old[(r.gpu, r.bucket)], r, why) for r, keep, why in decided if keep]
            recs = [r for r, keep, _ in decided if not keep]
        n = db_.put_many(recs)
    except TunedDBError as e:
        _fail(e)
    from .search_study import bucket_label
    for o, r, why in kept:
        if (o.variant, o.median_ms) != (r.variant, r.median_ms):  # the same timing is no news
            click.echo(f"kept {bucket_label(o.bucket)}: {o.variant.name} {o.throughput:.1f} "
                       f"{o.unit} (the file's {r.variant.name}: {r.throughput:.1f}; {why})")
    click.echo(f"imported {n} record(s) into {db_.display_url}"
               + (f"; kept {len(kept)} faster record(s)" if keep_faster else ""))


@db.command("diff")
@click.argument("old")
@click.argument("new")
@click.option("--gpu", default=None, help="only this GPU")
@_format_option
def diff_(old, new, gpu, fmt):
    """What changed between two tables or DBs.

    OLD and NEW are table files or DB URLs; changed records say by how much."""
    from .tuned_db.diff import diff
    try:
        changes = diff(_records_of(old, _slug(gpu)), _records_of(new, _slug(gpu)))
    except TunedDBError as e:
        _fail(e)
    if fmt == "json":
        click.echo(json.dumps([c.to_dict() for c in changes], indent=2, sort_keys=True))
        return
    rows = []
    for c in changes:
        r = c.new or c.old
        what = "; ".join(c.what()) or r.variant.name
        rows.append([c.kind, c.gpu] + _bucket_cells(c.bucket) + [what])
    if rows:
        click.echo(_table(["change", "gpu"] + _BUCKET_HEAD + ["what"], rows))
    counts = {k: sum(c.kind == k for c in changes) for k in ("added", "removed", "changed")}
    click.echo(", ".join(f"{n} {k}" for k, n in counts.items()))


@click.group("dispatch")
def dispatch_group():
    """The runtime dispatcher."""


@dispatch_group.command("explain")
@click.option("--family", default="fwd", show_default=True, help="kernel family (fwd, bwd)")
@click.option("--dtype", type=DTYPE, default="fp16", show_default=True, help=DTYPE_HELP)
@click.option("--head-dim", type=HEAD_DIM, default=128, show_default=True, help=HEAD_DIM_HELP)
@click.option("--causal/--no-causal", default=False, show_default=True, help="causal masking")
@click.option("--batch", type=click.IntRange(1), default=1, show_default=True, help="batch size")
@click.option("--heads", type=click.IntRange(1), default=16, show_default=True, help="query heads")
@click.option("--kv-heads", type=click.IntRange(1), default=None,
              help="K/V heads (default: --heads)")
@click.option("--seqlen-q", type=click.IntRange(1), default=1024, show_default=True,
              help="query length")
@click.option("--seqlen-k", type=click.IntRange(1), default=None,
              help="key length (default: --seqlen-q)")
@click.option("--mask", "mask_spec", default="none", show_default=True,
              help="masks beyond causal: window=<keys>, softcap, density=<0..1>, joined by '+'")
@click.option("--varlen", is_flag=True,
              help="an attention_varlen call: --batch sequences, the longest of --seqlen-q/-k")
@click.option("--gpu", default=None, help="the GPU to look up (default: FLASHTUNE_GPU, else detected)")
@click.option("--tables", type=click.Path(file_okay=False), default=None,
              help="a folder of tables instead of the shipped ones")
@_db_option
@_format_option
def explain(family, dtype, head_dim, causal, batch, heads, kv_heads, seqlen_q, seqlen_k,
            mask_spec, varlen, gpu, tables, db_url, fmt):
    """Why a problem runs the variant it runs.

    Prints the problem's bucket, the record and the level of the lookup order that serve it,
    and what each level said."""
    from . import dispatch
    from .problem import Problem
    kv = kv_heads or heads
    if heads % kv:
        raise click.BadParameter(f"--heads {heads} is not a multiple of --kv-heads {kv}")
    from .masks import parse_spec
    try:
        mask_fields = parse_spec(mask_spec)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--mask") from None
    p = Problem(family, dtype, head_dim, causal, heads // kv, batch, heads, seqlen_q,
                seqlen_k or seqlen_q, **mask_fields)
    if gpu or tables or db_url:
        dispatch.configure(gpu=gpu, db=db_url, tables_dir=tables)
    try:
        ex = dispatch.explain(p, varlen=varlen)
    except KeyError as e:
        _fail(e)
    click.echo(json.dumps(ex.to_dict(), indent=2, sort_keys=True) if fmt == "json" else str(ex))
