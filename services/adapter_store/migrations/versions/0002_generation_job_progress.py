"""generation jobs: progress, message, runner; PENDING instead of QUEUED; claim index

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 09:05:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("generation_jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("progress", sa.Float(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("message", sa.Text(), nullable=False, server_default=""))
        batch_op.add_column(sa.Column("runner", sa.String(length=128), nullable=False, server_default=""))
        batch_op.create_index(batch_op.f("ix_generation_jobs_state_created_at"), ["state", "created_at"], unique=False)
    op.execute("UPDATE generation_jobs SET state = 'PENDING' WHERE state = 'QUEUED'")


def downgrade() -> None:
    op.execute("UPDATE generation_jobs SET state = 'QUEUED' WHERE state = 'PENDING'")
    with op.batch_alter_table("generation_jobs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_generation_jobs_state_created_at"))
        batch_op.drop_column("runner")
        batch_op.drop_column("message")
        batch_op.drop_column("progress")
