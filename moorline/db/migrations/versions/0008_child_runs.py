"""Child runs: a run's parent, its key among the parent's children, depth, detached, awaited;
and ``emits``, the ``ctx.emit`` calls a parked run's replay skips.

``(parent_run_id, child_key)`` is unique, so a parent replayed after a crash finds the child it
started instead of starting a second one; ``ix_runs_parent`` serves a parent's joins, the
cancel cascade and the listing of its children.

Revision ID: 0008
Revises: 0006
Create Date: 2026-11-28 08:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("parent_run_id", sa.String(36), nullable=True))
    op.add_column("runs", sa.Column("child_key", sa.String(255), nullable=True))
    op.add_column("runs", sa.Column("depth", sa.Integer(), nullable=False, server_default="0"))
    for flag in ("detached", "awaited"):
        op.add_column("runs", sa.Column(flag, sa.Integer(), nullable=False, server_default="0"))
    # Not of child runs, but of the same session: the emits a parked run's replay skips.
    op.add_column("runs", sa.Column("emits", sa.Integer(), nullable=False, server_default="0"))
    op.create_index("ix_runs_parent_key", "runs", ["parent_run_id", "child_key"], unique=True)
    op.create_index("ix_runs_parent", "runs", ["parent_run_id", "status"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_runs_parent", table_name="runs")
    op.drop_index("ix_runs_parent_key", table_name="runs")
    for column in ("emits", "awaited", "detached", "depth", "child_key", "parent_run_id"):
        op.drop_column("runs", column)
