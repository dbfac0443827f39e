"""Bring a tuned DB to the newest schema (alembic upgrade head), safely from several processes."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from sqlalchemy import text

from .errors import DBError, safe_url

MIGRATIONS = Path(__file__).parent / "migrations"
# pg_advisory_xact_lock key: serializes concurrent first-use migrations on one PostgreSQL DB
_PG_LOCK = 0x666C617368  # "flash"


def _config():
    from alembic.config import Config
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


@lru_cache(maxsize=None)
def head() -> str:
    from alembic.script import ScriptDirectory
    return ScriptDirectory.from_config(_config()).get_current_head()


def current(conn) -> str | None:
    from alembic.runtime.migration import MigrationContext
    return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine, url) -> None:
    """alembic upgrade head on `engine`. A no-op (one read) when already at head. Concurrent
    callers serialize on the write lock (SQLite: BEGIN IMMEDIATE; PostgreSQL: an advisory lock
    held by the migrating transaction), so exactly one creates the schema."""
    from alembic import command
    from alembic.util import CommandError

    with engine.connect() as conn:
        rev = current(conn)
    if rev == head():
        return
    try:
        with engine.connect().execution_options(flashtune_write=True) as conn, conn.begin():
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK})
            cfg = _config()
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
    except CommandError as e:
        raise DBError(f"tuned DB {safe_url(url)} has schema revision {rev!r}, which this "
                      f"flashtune does not know (it knows up to {head()!r}): upgrade flashtune "
                      f"or point FLASHTUNE_DB elsewhere ({e})") from None
