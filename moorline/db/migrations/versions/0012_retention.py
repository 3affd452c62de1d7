"""Retention: ``ix_runs_finished`` (finished runs oldest first) and ``retention_tallies``.

The cleaner walks the index in ``(finished_at, id)`` order, one bounded chunk per batch, and
``/metrics`` reads the oldest finished run from its first entry. The tallies keep what the
cleaner deleted, so ``moorline_runs_total`` stays a counter once runs are deleted.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-28 11:45:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_runs_finished", "runs", ["finished_at", "id"], unique=False)
    op.create_table(
        "retention_tallies",
        sa.Column("table_name", sa.String(64), nullable=False),
        sa.Column("lane", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("deleted", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("table_name", "lane", "status", name=op.f("pk_retention_tallies")),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
    )


def downgrade() -> None:
    op.drop_table("retention_tallies")
    op.drop_index("ix_runs_finished", table_name="runs")
