"""Indexes of the admin's run listing across tenants (the dashboard's run table).

``ix_runs_created`` (``created_at, id``) serves the newest-first listing of every tenant's runs
and its keyset cursor; ``ix_runs_status_created`` (``status, created_at, id``) serves the same
listing filtered on a status, so a rare status is found without reading the common ones.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 18:00:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_runs_created", "runs", ["created_at", "id"], unique=False)
    op.create_index("ix_runs_status_created", "runs", ["status", "created_at", "id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_runs_status_created", table_name="runs")
    op.drop_index("ix_runs_created", table_name="runs")
