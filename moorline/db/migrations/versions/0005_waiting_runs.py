"""Waiting runs: what a parked run waits for, its timer, its resumptions and its deadline.

``waiting_for`` and ``wake_at`` describe a ``waiting`` run (NULL otherwise); ``resumes`` counts
the times a run left ``waiting``, so the attempt budget does not count resumptions;
``deadline_at`` is the run's optional wall-clock limit, waits included. ``ix_runs_wake`` serves
the timer sweep (waiting runs whose timer is due).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-28 08:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql, postgresql

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Revisions spell their types out (as 0001 does), never importing them from the live schema.
UTC_DATETIME = sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
JSON_DOCUMENT = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.add_column("runs", sa.Column("waiting_for", JSON_DOCUMENT, nullable=True))
    op.add_column("runs", sa.Column("wake_at", UTC_DATETIME, nullable=True))
    op.add_column("runs", sa.Column("resumes", sa.Integer(), nullable=False, server_default="0"))
    op.add_column("runs", sa.Column("deadline_at", UTC_DATETIME, nullable=True))
    op.create_index("ix_runs_wake", "runs", ["status", "wake_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_runs_wake", table_name="runs")
    op.drop_column("runs", "deadline_at")
    op.drop_column("runs", "resumes")
    op.drop_column("runs", "wake_at")
    op.drop_column("runs", "waiting_for")
