"""The tuned DB: records of the winning variant per (GPU, kernel family, bucket), the shipped
per-GPU tables, and their import/export.

`TunedDB` pulls in SQLAlchemy, so it is imported on first use: `import flashtune` (and the
dispatcher, when no user DB exists) never loads it.
"""
from .errors import DBError, TableError, TunedDBError
from .record import Provenance, Record

__all__ = ["TunedDB", "Record", "Provenance", "TunedDBError", "DBError", "TableError"]


def __getattr__(name):
    if name == "TunedDB":
        from .store import TunedDB
        return TunedDB
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
