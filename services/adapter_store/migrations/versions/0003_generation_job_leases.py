"""generation jobs: claim leases (lease_id, lease_expires_at) and an attempt counter

RUNNING rows from before this revision have no lease (lease_expires_at NULL); the store treats
that as expired, so those jobs (stuck since their runner died) are requeued at the next claim.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("generation_jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("lease_id", sa.String(length=64), nullable=False, server_default=""))
        batch_op.add_column(sa.Column("lease_expires_at", sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"))
    # A job that was claimed before has had one attempt.
    op.execute("UPDATE generation_jobs SET attempts = 1 WHERE state IN ('RUNNING', 'SUCCEEDED', 'FAILED')")


def downgrade() -> None:
    with op.batch_alter_table("generation_jobs", schema=None) as batch_op:
        batch_op.drop_column("attempts")
        batch_op.drop_column("lease_expires_at")
        batch_op.drop_column("lease_id")
