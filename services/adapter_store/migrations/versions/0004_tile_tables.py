"""tile tables: one ATMM tile table (JSON) per GPU name/arch and dtype replaces the unused
per-entry tile_entries table

tile_entries was never written, so nothing is carried over.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tile_tables",
        sa.Column("gpu_name", sa.String(length=128), nullable=False),
        sa.Column("gpu_arch", sa.String(length=32), nullable=False),
        sa.Column("dtype", sa.String(length=16), nullable=False),
        sa.Column("table_json", sa.Text(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("gpu_name", "gpu_arch", "dtype", name=op.f("pk_tile_tables")),
    )
    op.drop_table("tile_entries")


def downgrade() -> None:
    op.create_table(
        "tile_entries",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("gpu_name", sa.String(length=128), nullable=False),
        sa.Column("gpu_arch", sa.String(length=32), nullable=False),
        sa.Column("dtype", sa.String(length=16), nullable=False),
        sa.Column("op", sa.String(length=32), nullable=False),
        sa.Column("shape_bucket", sa.String(length=128), nullable=False),
        sa.Column("tile_config_id", sa.Integer(), nullable=False),
        sa.Column("measured_us", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tile_entries")),
        sa.UniqueConstraint(
            "gpu_name",
            "gpu_arch",
            "dtype",
            "op",
            "shape_bucket",
            name=op.f("uq_tile_entries_gpu_name_gpu_arch_dtype_op_shape_bucket"),
        ),
    )
    op.drop_table("tile_tables")
