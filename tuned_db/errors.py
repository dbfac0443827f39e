"""Errors of the tuned DB and the shipped tables: each names the file or the URL at fault."""
from __future__ import annotations


class TunedDBError(RuntimeError):
    """Base class: the dispatcher catches this, logs it and falls back to the next level."""


class DBError(TunedDBError):
    """A database URL cannot be opened, reached, migrated or read."""


class TableError(TunedDBError):
    """A tuned table file is missing, corrupt, or of an unknown schema version."""


def safe_url(url) -> str:
    """The URL with its password masked, for messages and logs."""
    try:
        from sqlalchemy.engine import make_url
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 -- an unparseable URL is shown as given
        return str(url)
