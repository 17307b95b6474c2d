"""Alembic environment of the adapter store.

The URL comes from, in order: a connection handed over in `config.attributes["connection"]`
(the server and tests), `config.attributes["url"]`, then VALORA_DATABASE_URL (command line use).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from services.adapter_store.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.attributes.get("url")
    if url:
        return url
    from services.adapter_store.config import StoreSettings

    return StoreSettings().database_url


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
    else:
        engine = create_engine(_url(), poolclass=pool.NullPool)
        with engine.connect() as conn:
            _run(conn)
        engine.dispose()
