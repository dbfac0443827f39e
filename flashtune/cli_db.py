"""`flashtune db show|export|import|diff` and `flashtune dispatch explain`: thin commands over
flashtune.tuned_db and flashtune.dispatch."""
from __future__ import annotations

import json

import click

from .tuned_db.errors import TunedDBError

_db_option = click.option("--db", "db_url", metavar="URL", default=None,
                          help="SQLAlchemy URL of the tuned DB (default: FLASHTUNE_DB, else the "
                               "SQLite file in the cache folder)")
_format_option = click.option("--format", "fmt", type=click.Choice(["table", "json"]),
                              default="table", show_default=True)


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
@click.option("--gpu", default=None, help="only this GPU (H100, a device name or a slug)")
@click.option("--family", default=None, help="only this kernel family")
@click.option("--table", "table_file", type=click.Path(dir_okay=False), default=None,
              help="show a table file instead of the DB")
@_db_option
@_format_option
def show(gpu, family, table_file, db_url, fmt):
    """List the tuned records."""
    try:
        recs = _records_of(table_file, _slug(gpu)) if table_file else \
            _open(db_url).records(gpu=_slug(gpu), family=family)
    except TunedDBError as e:
        _fail(e)
    recs = [r for r in recs if family is None or r.bucket.family == family]
    if fmt == "json":
        click.echo(json.dumps([r.to_dict() for r in recs], indent=2, sort_keys=True))
        return
    rows = [[r.gpu] + _bucket_cells(r.bucket) + [
        r.variant.name, f"{r.median_ms:.4g}", f"{r.throughput:.4g} {r.unit}", f"{r.max_err:.2g}",
        r.provenance.source, r.provenance.date[:10]] for r in recs]
    click.echo(_table(["gpu"] + _BUCKET_HEAD + ["variant", "ms", "throughput", "err", "source",
                                                 "date"], rows))
    click.echo(f"{len(recs)} record(s)")


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
        recs = _open(db_url).records(gpu=slug)
        path = write_table(output or table_path(slug), slug, recs)
    except (TunedDBError, ValueError) as e:
        _fail(e)
    click.echo(f"wrote {len(recs)} record(s) of {slug} to {path}")


@db.command("import")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--mark-imported", is_flag=True,
              help="set provenance.source to 'import' (default: keep how each was found)")
@_db_option
def import_(files, mark_imported, db_url):
    """Upsert the records of table FILES into the DB (all checked before any is written)."""
    import dataclasses

    from .tuned_db.io import read_table
    try:
        recs = [r for f in files for r in read_table(f).records]
        if mark_imported:
            recs = [dataclasses.replace(r, provenance=dataclasses.replace(
                r.provenance, source="import")) for r in recs]
        db_ = _open(db_url)
        n = db_.put_many(recs)
    except TunedDBError as e:
        _fail(e)
    click.echo(f"imported {n} record(s) into {db_.display_url}")


@db.command("diff")
@click.argument("old")
@click.argument("new")
@click.option("--gpu", default=None, help="only this GPU")
@_format_option
def diff_(old, new, gpu, fmt):
    """What changed from OLD to NEW (table files, or DB URLs) and by how much."""
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
@click.option("--family", default="fwd", show_default=True)
@click.option("--dtype", type=click.Choice(["float16", "bfloat16", "float32"]), default="float16",
              show_default=True)
@click.option("--head-dim", type=int, default=128, show_default=True)
@click.option("--causal/--no-causal", default=False, show_default=True)
@click.option("--batch", type=int, default=1, show_default=True)
@click.option("--heads", type=int, default=16, show_default=True)
@click.option("--kv-heads", type=int, default=None, help="K/V heads (default: --heads)")
@click.option("--seqlen-q", type=int, default=1024, show_default=True)
@click.option("--seqlen-k", type=int, default=None, help="default: --seqlen-q")
@click.option("--gpu", default=None, help="the GPU to look up (default: FLASHTUNE_GPU, else detected)")
@click.option("--tables", type=click.Path(file_okay=False), default=None,
              help="a folder of tables instead of the shipped ones")
@_db_option
@_format_option
def explain(family, dtype, head_dim, causal, batch, heads, kv_heads, seqlen_q, seqlen_k, gpu,
            tables, db_url, fmt):
    """Which bucket, which record and which level of the lookup order serve a problem."""
    from . import dispatch
    from .problem import Problem
    kv = kv_heads or heads
    if heads % kv:
        raise click.BadParameter(f"--heads {heads} is not a multiple of --kv-heads {kv}")
    p = Problem(family, dtype, head_dim, causal, heads // kv, batch, heads, seqlen_q,
                seqlen_k or seqlen_q)
    if gpu or tables or db_url:
        dispatch.configure(gpu=gpu, db=db_url, tables_dir=tables)
    try:
        ex = dispatch.explain(p)
    except KeyError as e:
        _fail(e)
    click.echo(json.dumps(ex.to_dict(), indent=2, sort_keys=True) if fmt == "json" else str(ex))
