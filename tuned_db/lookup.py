"""The lookup order behind the dispatcher: which record serves a bucket.

Levels, highest first: the user's DB ("user-db"), the shipped table of this GPU ("gpu-table"),
shipped tables of other GPUs of the same architecture ("arch-table": an H200 may use an H100's),
then the built-in default (flashtune/defaults.py, chosen by the dispatcher).

Choice among the records of all levels that may serve the bucket (same family, dtype, padded
head dim and causality -- Bucket.same_kernel_class):

  1. fresh before stale (the policy below);
  2. the nearest bucket by log distance (Bucket.log_distance; 0 is the bucket itself);
  3. the higher level on equal distance -- so the user's DB overrides a shipped table for the
     same bucket, but a shipped exact match beats a user record for a bucket 4x away;
  4. the bucket key, so that the choice never depends on file or row order.

Stale-entry policy: a record is stale when the code its variant renders to differs from the
code that was timed (codegen.kernel_hash: the GPU render without header, comments and blank
lines; records carry it in provenance.template_hash): the generator no longer emits the kernel
that was timed, so its numbers say nothing about the kernel that would run. A template edit that
leaves this variant's code alone (a branch other variants take, a comment) keeps it fresh. Stale records are demoted, not deleted: they serve only
when no fresh record of any level can, with a one-time warning naming the record and telling the
user to re-run `flashtune search`; a fresh record always wins, however far. The variant of a
stale record still compiles and was once the best of its search, which beats a one-size default.

Another Triton release is not staleness: the kernel is the same source, and every table shipped
with flashtune was measured with some Triton other than the one torch pins for a given user, so
a warning there would fire in every process and say nothing the user can act on. Such a record
serves as fresh; `explain` and `db show` say, in a neutral note, which Triton measured it.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from flashtune.problem import Bucket

from .errors import TunedDBError
from .record import Record

log = logging.getLogger("flashtune.dispatch")

LEVELS = ("user-db", "gpu-table", "arch-table")
_RANK = {name: i for i, name in enumerate(LEVELS)}


@dataclass(frozen=True)
class Source:
    """The usable records of one level, and what happened while reading it."""
    level: str
    origin: str              # the DB URL (password masked) or the table file
    records: tuple = ()
    notes: tuple = ()        # facts: why the level is empty ("no shipped table ...")
    errors: tuple = ()       # problems, logged once: an unreadable DB or table, skipped records


@dataclass(frozen=True)
class Match:
    record: Record
    level: str
    origin: str
    distance: float          # octaves between the asked bucket and the record's
    stale: tuple = ()        # reasons the record is stale (empty: fresh)
    notes: tuple = ()        # facts about the record that do not demote it (another Triton)


def _major_minor(version: str) -> str:
    return ".".join(str(version).split(".")[:2])


@lru_cache(maxsize=None)
def _current_template_hash(family: str) -> str | None:
    from flashtune.codegen import template_hash
    try:
        return template_hash(family)
    except Exception:  # noqa: BLE001 -- no template for the family: nothing can serve it
        return None


@lru_cache(maxsize=1)
def _triton_version() -> str:
    import triton
    return _major_minor(triton.__version__)


@lru_cache(maxsize=4096)
def _current_kernel_hash(variant) -> str | None:
    from flashtune.codegen import kernel_hash
    try:
        return kernel_hash(variant)
    except Exception:  # noqa: BLE001 -- no template for the family: nothing can serve it
        return None


def staleness(r: Record) -> tuple:
    """Why `r` is stale, or () if it is fresh (the policy in this module's docstring): the record
    carries the kernel hash of the code it timed (codegen.kernel_hash), so only a change to the
    code this variant runs makes it stale, not an edit of its template that other variants
    take (a new `#%if` branch) or of comments."""
    current = _current_kernel_hash(r.variant)
    if r.provenance.template_hash == current:
        return ()
    return (f"measured on {r.variant.name} code {r.provenance.template_hash or '(none)'}, the "
            f"generator now emits {current}: the kernel changed since it was timed",)


def record_notes(r: Record) -> tuple:
    """Neutral facts about `r` that do not demote it: a Triton major.minor other than this one."""
    measured, running = _major_minor(r.provenance.triton), _triton_version()
    if measured == running:
        return ()
    return (f"measured with triton {measured or '(unrecorded)'}, running {running}: timings may "
            "differ; `flashtune search` re-measures",)


def usable(records, origin: str) -> tuple[tuple, tuple]:
    """Drop records no kernel can serve (no template for their family): (records, errors)."""
    keep, notes = [], []
    for r in records:
        if _current_template_hash(r.variant.family) is None:
            notes.append(f"{origin}: {r.variant.name} skipped: the generator has no template "
                         f"for family {r.variant.family!r}")
            continue
        keep.append(r)
    return tuple(keep), tuple(notes)


def best(bucket: Bucket, sources) -> Match | None:
    """The record that serves `bucket` (None: nothing does; use the built-in default)."""
    found, found_key = None, None
    for src in sources:
        for r in src.records:
            dist = bucket.log_distance(r.bucket)
            if dist == float("inf"):
                continue
            stale = staleness(r)
            key = (bool(stale), dist, _RANK[src.level], r.bucket.key)
            if found_key is None or key < found_key:
                found, found_key = Match(r, src.level, src.origin, dist, stale), key
    if found is not None:
        found = dataclasses.replace(found, notes=record_notes(found.record))
    return found


# -- loading the levels -------------------------------------------------------------------------
def levels(gpu: str, arch: str, url: str | None, default_url: str, default_exists: bool,
           tables_dir: Path) -> list[Source]:
    """Every level that may serve `gpu`, in lookup order, empty ones included (with their notes):
    what `flashtune db show` lists."""
    out = [user_db(gpu, url, default_url, default_exists)]
    own, table_arch = gpu_table(gpu, tables_dir)
    out.append(own)
    out += arch_tables(gpu, arch or table_arch, tables_dir)
    return out


def user_db(gpu: str, url: str | None, default_url: str, default_exists: bool) -> Source:
    """The user's DB: FLASHTUNE_DB (or --db) if set, else the default SQLite file if it exists.
    Nothing is created here; an unreadable DB is a note and an empty level."""
    if url is None and not default_exists:
        return Source("user-db", default_url, (), (f"no user DB at {default_url}",))
    from .store import TunedDB
    db = TunedDB(url or default_url)
    try:
        records = db.records(gpu=gpu, strict=False)
    except TunedDBError as e:
        return Source("user-db", db.display_url, (), (),
                      (f"{e}; falling back to the shipped tables",))
    finally:
        db.dispose()
    recs, errors = usable(records, db.display_url)
    return Source("user-db", db.display_url, recs, (), errors)


def gpu_table(gpu: str, tables_dir: Path) -> tuple[Source, str]:
    """The shipped table of this GPU, and its architecture ("" if unknown)."""
    from .io import read_table, table_path
    path = table_path(gpu, tables_dir)
    if not path.exists():
        return Source("gpu-table", str(path), (), (f"no shipped table {path}",)), ""
    try:
        t = read_table(path, strict=False)
    except TunedDBError as e:
        return Source("gpu-table", str(path), (), (), (f"{e}; falling back",)), ""
    recs, errors = usable(t.records, str(path))
    return Source("gpu-table", str(path), recs, (), t.skipped + errors), t.arch


def arch_tables(gpu: str, arch: str, tables_dir: Path) -> list[Source]:
    """Shipped tables of the other GPUs of architecture `arch`, in file-name order."""
    from .io import read_header, read_table, shipped_tables
    out = []
    if not arch:
        return out
    for path in shipped_tables(tables_dir):
        if path.stem == gpu:
            continue
        try:
            if read_header(path).arch != arch:
                continue
            t = read_table(path, strict=False)
        except TunedDBError as e:
            out.append(Source("arch-table", str(path), (), (), (f"{e}; skipped",)))
            continue
        recs, errors = usable(t.records, str(path))
        out.append(Source("arch-table", str(path), recs, (), t.skipped + errors))
    return out
