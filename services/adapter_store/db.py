"""Engine creation and migrations of the registry database."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import structlog
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.orm import Session, sessionmaker

ALEMBIC_INI = Path(__file__).with_name("alembic.ini")
# Any constant works: replicas starting together take turns migrating (PostgreSQL only).
_MIGRATION_LOCK_ID = 0x76616C6F  # "valo"

log = structlog.get_logger()


def make_engine(url: str, connect_timeout_s: float = 5.0, statement_timeout_s: float = 30.0) -> Engine:
    """An engine for `url`. SQLite gets a busy timeout, foreign keys, and BEGIN IMMEDIATE so
    concurrent writers queue instead of failing on a read-to-write lock upgrade. PostgreSQL gets
    a connect timeout, a server-side statement timeout and a bounded wait for a pooled
    connection, so a black-holed database fails calls (UNAVAILABLE) instead of freezing them."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record):
            dbapi_conn.isolation_level = None  # let SQLAlchemy's "begin" event issue BEGIN
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn):
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    return create_engine(
        url,
        pool_pre_ping=True,
        pool_size=8,
        max_overflow=8,
        pool_timeout=max(1.0, connect_timeout_s),
        connect_args={
            "connect_timeout": max(1, math.ceil(connect_timeout_s)),
            "options": f"-c statement_timeout={int(statement_timeout_s * 1000)}",
        },
    )


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str | None = None) -> Config:
    cfg = Config(str(ALEMBIC_INI))
    cfg.set_main_option("script_location", str(ALEMBIC_INI.parent / "migrations"))
    if url:
        cfg.attributes["url"] = url
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """`alembic upgrade head` on the engine's database (blocking). On PostgreSQL an advisory
    lock serialises replicas that start at the same time."""
    cfg = alembic_config()
    logging.getLogger("alembic").setLevel(logging.WARNING)
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": _MIGRATION_LOCK_ID})
        before = MigrationContext.configure(conn).get_current_revision()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
        after = MigrationContext.configure(conn).get_current_revision()
    if before != after:
        log.info(
            "migrated",
            database=engine.url.render_as_string(hide_password=True),
            from_revision=before,
            to_revision=after,
        )
