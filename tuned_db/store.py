"""`TunedDB`: the tuned DB behind any SQLAlchemy URL (SQLite file by default, PostgreSQL, ...).

Writes are upserts on the natural key (gpu, family, bucket key) and are safe from several
processes at once: PostgreSQL resolves races with INSERT .. ON CONFLICT; SQLite runs in WAL mode
with a busy timeout, takes the write lock up front (BEGIN IMMEDIATE, so two writers never
deadlock upgrading a read lock) and retries while the file is locked.
"""
from __future__ import annotations

import json
import logging
import random
import threading
import time
from pathlib import Path

from sqlalchemy import create_engine, event, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, OperationalError

from flashtune import env
from flashtune.codegen import Variant
from flashtune.problem import Bucket

from . import migrate
from .errors import DBError, safe_url
from .events import notify_write
from .gpu import gpu_slug
from .models import TunedRow
from .record import Provenance, Record

log = logging.getLogger("flashtune.tuned_db")

DEFAULT_FILE = "tuned.db"
_SQLITE_BUSY_MS = 30_000
_RETRY_FOR_S = 60.0


def default_url() -> str:
    return f"sqlite:///{env.cache_dir() / DEFAULT_FILE}"


def resolve_url(url: str | None) -> str:
    """The URL to use: the argument, else FLASHTUNE_DB, else the SQLite file in the cache folder."""
    return url or env.db_url() or default_url()


def sqlite_path(url: str) -> Path | None:
    """The file of a file-backed SQLite URL (None for other databases and in-memory SQLite)."""
    try:
        u = make_url(url)
    except ArgumentError:
        return None
    if u.get_backend_name() != "sqlite" or u.database in (None, "", ":memory:"):
        return None
    return Path(u.database)


def _row_values(r: Record) -> dict:
    b, p = r.bucket, r.provenance
    return dict(
        gpu=r.gpu, family=b.family, bucket_key=b.key, dtype=b.dtype, head_dim=b.head_dim,
        causal=b.causal, gqa=b.gqa, seqlen_q=b.seqlen_q, seqlen_k=b.seqlen_k,
        batch_heads=b.batch_heads, mask=b.mask, variant=r.variant.to_json(),
        variant_name=r.variant.name,
        median_ms=r.median_ms, throughput=r.throughput, unit=r.unit, max_err=r.max_err,
        runner_ups=json.dumps([[str(n), float(ms)] for n, ms in r.runner_ups]),
        gpu_name=p.gpu_name, compute_capability=p.compute_capability, sm_count=p.sm_count,
        driver=p.driver, cuda=p.cuda, torch_version=p.torch, triton_version=p.triton,
        flashtune_version=p.flashtune, template_hash=p.template_hash, found_at=p.date,
        source=p.source)


def _record_of(row: TunedRow) -> Record:
    """Row -> Record; ValueError if the row's variant is one the generator no longer knows."""
    try:
        variant = Variant.from_dict(json.loads(row.variant))
    except (TypeError, ValueError) as e:
        raise ValueError(f"variant {row.variant_name!r} is not one the generator knows: {e}") from None
    bucket = Bucket(row.family, row.dtype, row.head_dim, bool(row.causal), bool(row.gqa),
                    row.seqlen_q, row.seqlen_k, row.batch_heads, row.mask or "")
    prov = Provenance(row.gpu_name, row.compute_capability, row.sm_count, row.driver, row.cuda,
                      row.torch_version, row.triton_version, row.flashtune_version,
                      row.template_hash, row.found_at, row.source)
    return Record(row.gpu, bucket, variant, row.median_ms, row.throughput, row.unit, row.max_err,
                  prov, tuple((str(n), float(ms)) for n, ms in json.loads(row.runner_ups)))


def _is_busy(e: Exception) -> bool:
    msg = str(getattr(e, "orig", e)).lower()
    return any(s in msg for s in ("database is locked", "database is busy", "deadlock detected",
                                  "could not serialize"))


class TunedDB:
    """The tuned DB at `url` (None: FLASHTUNE_DB, else the SQLite file in the cache folder).

    Nothing is opened until the first call; the first call creates or migrates the schema
    (alembic upgrade head). Every failure is a DBError naming the URL (password masked).
    """

    def __init__(self, url: str | None = None):
        self.url = resolve_url(url)
        self._engine = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"TunedDB({safe_url(self.url)!r})"

    @property
    def display_url(self) -> str:
        return safe_url(self.url)

    # -- connection ------------------------------------------------------------------------
    def _open(self):
        if self._engine is not None:
            return self._engine
        with self._lock:
            if self._engine is None:
                # processes opening one new SQLite file at once race for it (journal_mode=WAL
                # and the schema's creation take its lock; the WAL switch can answer "database
                # is locked" without waiting out busy_timeout): a busy open is tried again, as
                # a busy write is
                self._engine = self._retrying(self._connect, "reach")
        return self._engine

    def _connect(self):
        engine = self._create_engine()
        try:
            migrate.upgrade(engine, self.url)
        except BaseException:
            engine.dispose()
            raise
        return engine

    def _retrying(self, fn, what: str):
        """fn() again while another process holds the database's lock, for up to _RETRY_FOR_S;
        any other failure, or the lock past that, a DBError naming the URL."""
        deadline = time.monotonic() + _RETRY_FOR_S
        delay = 0.01
        while True:
            try:
                return fn()
            except DBError:
                raise
            except (ArgumentError, NoSuchModuleError, ImportError) as e:
                raise DBError(f"cannot open tuned DB {self.display_url}: {e}") from None
            except OSError as e:  # e.g. the SQLite file's folder cannot be created
                raise DBError(f"cannot open tuned DB {self.display_url}: {e}") from None
            except OperationalError as e:
                if not _is_busy(e) or time.monotonic() > deadline:
                    raise DBError(f"cannot {what} tuned DB {self.display_url}: {e.orig}"
                                  ) from None
            except DBAPIError as e:
                raise DBError(f"cannot {what} tuned DB {self.display_url}: {e.orig}") from None
            time.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 0.5)

    def _create_engine(self):
        path = sqlite_path(self.url)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        u = make_url(self.url)
        if u.get_backend_name() == "sqlite":
            engine = create_engine(u, connect_args={"timeout": _SQLITE_BUSY_MS / 1000})
            _sqlite_setup(engine, wal=path is not None)
            return engine
        args = {"connect_timeout": 10} if u.get_backend_name() == "postgresql" else {}
        return create_engine(u, connect_args=args, pool_pre_ping=True)

    def _write(self, fn):
        """Run fn(conn) in a write transaction, retrying while another writer holds the lock."""
        engine = self._open()

        def attempt():
            with engine.connect().execution_options(flashtune_write=True) as conn, conn.begin():
                return fn(conn)
        result = self._retrying(attempt, "write")
        notify_write()
        return result

    def _read(self, stmt) -> list[TunedRow]:
        engine = self._open()
        from sqlalchemy.orm import Session
        try:
            with Session(engine) as s:
                return list(s.scalars(stmt))
        except DBAPIError as e:
            raise DBError(f"cannot read tuned DB {self.display_url}: {e.orig}") from None

    # -- the contract ----------------------------------------------------------------------
    def put(self, record: Record) -> None:
        """Insert or replace the row of record's natural key (gpu, family, bucket key)."""
        self.put_many([record])

    def put_many(self, records) -> int:
        """put() for many records, in one transaction. Returns how many were written."""
        rows = [_row_values(r.check()) for r in records]
        if rows:
            self._write(lambda conn: _upsert(conn, rows))
        return len(rows)

    def get(self, gpu, bucket: Bucket) -> Record | None:
        rows = self._read(select(TunedRow).where(
            TunedRow.gpu == gpu_slug(gpu), TunedRow.family == bucket.family,
            TunedRow.bucket_key == bucket.key))
        return self._decode(rows[0]) if rows else None

    def records(self, gpu=None, family: str | None = None, *, strict: bool = True) -> list[Record]:
        """The records (of one GPU / kernel family), in bucket order. A row whose variant the
        generator no longer knows raises DBError (strict) or is logged and skipped."""
        stmt = select(TunedRow)
        if gpu is not None:
            stmt = stmt.where(TunedRow.gpu == gpu_slug(gpu))
        if family is not None:
            stmt = stmt.where(TunedRow.family == family)
        stmt = stmt.order_by(TunedRow.gpu, TunedRow.family, TunedRow.dtype, TunedRow.head_dim,
                             TunedRow.causal, TunedRow.gqa, TunedRow.seqlen_q, TunedRow.seqlen_k,
                             TunedRow.batch_heads, TunedRow.mask)
        out = []
        for row in self._read(stmt):
            try:
                out.append(self._decode(row))
            except DBError as e:
                if strict:
                    raise
                log.warning("%s; skipped", e)
        return out

    def _decode(self, row: TunedRow) -> Record:
        try:
            return _record_of(row)
        except ValueError as e:
            raise DBError(f"tuned DB {self.display_url}, row {row.id} ({row.gpu} {row.family} "
                          f"bucket {row.bucket_key[:12]}): {e}") from None

    def delete(self, gpu, bucket: Bucket) -> bool:
        """Remove the row of (gpu, bucket); True if there was one."""
        from sqlalchemy import delete
        stmt = delete(TunedRow).where(TunedRow.gpu == gpu_slug(gpu),
                                      TunedRow.family == bucket.family,
                                      TunedRow.bucket_key == bucket.key)
        return self._write(lambda conn: conn.execute(stmt).rowcount) > 0

    def dispose(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None


def _upsert(conn, rows: list[dict]) -> None:
    name = conn.dialect.name
    keys = ["gpu", "family", "bucket_key"]
    if name in ("postgresql", "sqlite"):
        if name == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert
        for row in rows:
            stmt = insert(TunedRow).values(**row)
            stmt = stmt.on_conflict_do_update(
                index_elements=keys, set_={k: stmt.excluded[k] for k in row if k not in keys})
            conn.execute(stmt)
        return
    # other databases: update, else insert, inside the caller's transaction
    from sqlalchemy import insert, update
    for row in rows:
        where = [getattr(TunedRow, k) == row[k] for k in keys]
        if conn.execute(update(TunedRow).where(*where).values(**row)).rowcount == 0:
            conn.execute(insert(TunedRow).values(**row))


def _sqlite_setup(engine, wal: bool) -> None:
    """pysqlite defers BEGIN until the first write, which lets two writers deadlock and keeps
    DDL outside transactions; take over transaction control (the SQLAlchemy-documented recipe)."""

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout={_SQLITE_BUSY_MS}")
        if wal:  # readers never block the writer, and the writer never blocks readers
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn):
        write = conn.get_execution_options().get("flashtune_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")
