"""Alembic's head matches the SQLAlchemy models (SQLite here; PostgreSQL in the integration suite)."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from services.adapter_store import db
from services.adapter_store.models import Base


def test_upgrade_head_matches_models(tmp_path):
    engine = db.make_engine(f"sqlite:///{tmp_path / 'm.db'}")
    try:
        db.upgrade(engine)
        with engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata) == []
        tables = set(inspect(engine).get_table_names())
        assert {
            "adapters",
            "adapter_versions",
            "aliases",
            "tasks",
            "fused_adapter_members",
            "tile_tables",
            "generation_jobs",
            "alembic_version",
        } <= tables
    finally:
        engine.dispose()
