"""tasks: the run-time rule of a task's early adapter release policy (adapter_release_rule)

Tasks from before this revision have no rule ("none"): their fraction alone decides, as before.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-07 21:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("adapter_release_rule", sa.String(length=32), nullable=False, server_default="none")
        )


def downgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_column("adapter_release_rule")
