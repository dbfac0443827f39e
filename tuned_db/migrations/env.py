"""Alembic environment of the tuned DB.

flashtune runs it in-process (tuned_db/migrate.py passes an open connection in
config.attributes["connection"]). It also works from the alembic command line:

    alembic -c tuned_db/alembic.ini -x url=sqlite:////path/to/tuned.db upgrade head

(without -x url, FLASHTUNE_DB, then the default SQLite file in the cache folder).
"""
from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from flashtune.tuned_db.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    from flashtune.tuned_db.store import resolve_url
    return context.get_x_argument(as_dictionary=True).get("url") or resolve_url(None)


def _run(connection) -> None:
    # render_as_batch: SQLite alters tables by copying them; later migrations need it
    context.configure(connection=connection, target_metadata=target_metadata,
                      render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
elif config.attributes.get("connection") is not None:
    _run(config.attributes["connection"])
else:
    engine = create_engine(_url())
    with engine.begin() as conn:
        _run(conn)
    engine.dispose()
