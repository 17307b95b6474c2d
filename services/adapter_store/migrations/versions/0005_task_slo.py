"""tasks: a latency objective (slo_ms) and the SLO class it counts under

Tasks from before this revision have no objective (slo_ms 0, slo_class ''): the scheduler treats
their requests as it did before.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("slo_ms", sa.Float(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("slo_class", sa.String(length=63), nullable=False, server_default=""))
        batch_op.create_index(batch_op.f("ix_tasks_slo_class"), ["slo_class"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_tasks_slo_class"))
        batch_op.drop_column("slo_class")
        batch_op.drop_column("slo_ms")
