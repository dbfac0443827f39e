"""Shipped tuned tables: tuned_db/tables/<gpu-slug>.json, one per GPU.

A table is one JSON object, written with sorted keys, two-space indents and its records in
bucket order, so that a re-tune reads as a small diff:

    {"schema": "flashtune.tuned-table", "schema_version": 1,
     "gpu": "nvidia-h100-80gb-hbm3", "gpu_name": "NVIDIA H100 80GB HBM3", "arch": "sm_90",
     "records": [{"bucket": {...}, "variant": {...}, "median_ms": ..., "provenance": {...}}]}

Records inside a table leave out their "gpu" (the header's). Reading checks the schema name and
version and every record; errors are TableError naming the file.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import TableError
from .gpu import gpu_slug, target_of
from .record import Record

SCHEMA = "flashtune.tuned-table"
SCHEMA_VERSION = 1
TABLES_DIR = Path(__file__).parent / "tables"


@dataclass(frozen=True)
class Table:
    path: str
    gpu: str                 # slug
    gpu_name: str
    arch: str                # "sm_90" ("" if unknown)
    records: tuple           # Record, ... in bucket order
    skipped: tuple = ()      # messages for records left out (lenient reads only)


def table_path(gpu, tables_dir: str | Path | None = None) -> Path:
    return Path(tables_dir or TABLES_DIR) / f"{gpu_slug(gpu)}.json"


def bucket_order(r: Record) -> tuple:
    b = r.bucket
    return (r.gpu, b.family, b.dtype, b.head_dim, b.causal, b.gqa, b.seqlen_q, b.seqlen_k,
            b.batch_heads, b.mask)


def _arch_of(gpu: str, records) -> tuple[str, str]:
    t = target_of(gpu)
    if t is not None:
        return t.name, t.arch
    for r in records:  # a GPU the registry lacks: its records say what it is
        cc = r.provenance.compute_capability.replace(".", "")
        return r.provenance.gpu_name, f"sm_{cc}" if cc else ""
    return gpu, ""


def to_json(gpu, records) -> str:
    """The table text of `records` (all of GPU `gpu`): stable bytes for the same records."""
    slug = gpu_slug(gpu)
    records = sorted(records, key=bucket_order)
    for r in records:
        if r.gpu != slug:
            raise ValueError(f"record of GPU {r.gpu!r} in the table of {slug!r}")
    gpu_name, arch = _arch_of(slug, records)
    body = []
    for r in records:
        d = r.check().to_dict()
        del d["gpu"]
        body.append(d)
    doc = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "gpu": slug,
           "gpu_name": gpu_name, "arch": arch, "records": body}
    return json.dumps(doc, sort_keys=True, indent=2) + "\n"


def write_table(path: str | Path, gpu, records) -> Path:
    """Write the table atomically (a reader never sees half a file)."""
    path = Path(path)
    text = to_json(gpu, records)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def _load_doc(path: Path) -> dict:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise TableError(f"tuned table {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TableError(f"tuned table {path}: cannot read it: {e}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise TableError(f"tuned table {path} is corrupt (not JSON: {e})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise TableError(f"tuned table {path} is not a flashtune tuned table "
                         f"(expected \"schema\": {SCHEMA!r})")
    version = doc.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= SCHEMA_VERSION:
        raise TableError(f"tuned table {path} has schema version {version!r}, which this flashtune "
                         f"does not know (it reads versions 1..{SCHEMA_VERSION}): upgrade flashtune "
                         "or re-export the table")
    for k, typ in (("gpu", str), ("records", list)):
        if not isinstance(doc.get(k), typ):
            raise TableError(f"tuned table {path} is corrupt: {k!r} must be a {typ.__name__}")
    return doc


def read_header(path: str | Path) -> Table:
    """The table's GPU and architecture, without decoding its records."""
    path = Path(path)
    doc = _load_doc(path)
    return Table(str(path), doc["gpu"], str(doc.get("gpu_name", "")), str(doc.get("arch", "")), ())


def read_table(path: str | Path, *, strict: bool = True) -> Table:
    """Read and check a table. A bad record (e.g. a variant the generator no longer knows) is a
    TableError naming the file and the record (strict), or is left out and described in
    Table.skipped."""
    path = Path(path)
    doc = _load_doc(path)
    slug = doc["gpu"]
    records, skipped, seen = [], [], set()
    for i, d in enumerate(doc["records"]):
        try:
            if not isinstance(d, dict):
                raise ValueError("not a JSON object")
            if "gpu" in d and d["gpu"] != slug:
                raise ValueError(f"record of GPU {d['gpu']!r} in the table of {slug!r}")
            r = Record.from_dict({**d, "gpu": slug})
            if r.natural_key in seen:
                raise ValueError(f"a second record for bucket {dataclasses.astuple(r.bucket)}")
            seen.add(r.natural_key)
        except (ValueError, TypeError, KeyError) as e:
            msg = f"tuned table {path}, record {i}: {e}"
            if strict:
                raise TableError(msg) from None
            skipped.append(msg)  # the caller logs them (the dispatcher: once)
            continue
        records.append(r)
    return Table(str(path), slug, str(doc.get("gpu_name", "")), str(doc.get("arch", "")),
                 tuple(sorted(records, key=bucket_order)), tuple(skipped))


def shipped_tables(tables_dir: str | Path | None = None) -> list[Path]:
    d = Path(tables_dir or TABLES_DIR)
    return sorted(d.glob("*.json")) if d.is_dir() else []
