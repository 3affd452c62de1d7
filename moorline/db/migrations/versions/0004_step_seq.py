"""``steps.seq``: the order in which a run's steps first started.

Timestamps tie (SQLite keeps milliseconds), so listings sorted by ``(started_at, key)`` showed
two steps of one millisecond by name. Steps stored before this revision keep ``seq`` NULL and
sort first, by ``(started_at, key)`` as before.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-28 05:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("steps", sa.Column("seq", sa.Integer(), nullable=True))
    op.create_index("ix_steps_run_seq", "steps", ["run_id", "seq"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_steps_run_seq", table_name="steps")
    op.drop_column("steps", "seq")
