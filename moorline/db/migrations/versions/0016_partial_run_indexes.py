"""Partial run indexes: four indexes of ``runs`` leave out the rows their column is NULL in.

``ix_runs_parent``, ``ix_runs_conversation``, ``ix_runs_lease`` and ``ix_runs_finished`` are
only ever searched for rows with their column set (a parent's children, a conversation's runs,
expired leases, finished runs), which most runs have no value for until they end. Partial,
they cost a run's insert and its claim, outcome and other status changes nothing; whole,
each of those moved an entry in each. PostgreSQL only (SQLite rebuilds its indexes from the
schema at start; MariaDB has no partial indexes, so its indexes stay as they are). Each index
is rebuilt, which holds writes to ``runs`` meanwhile.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-30 07:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | Sequence[str] | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXES = (
    ("ix_runs_parent", ["parent_run_id", "status"], "parent_run_id"),
    ("ix_runs_conversation", ["tenant_id", "conversation_id", "status"], "conversation_id"),
    ("ix_runs_lease", ["status", "lease_expires_at"], "lease_expires_at"),
    ("ix_runs_finished", ["finished_at", "id"], "finished_at"),
)


def _rebuild(*, partial: bool) -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for name, columns, column in INDEXES:
        op.drop_index(name, table_name="runs")
        where = sa.text(f"{column} IS NOT NULL") if partial else None
        op.create_index(name, "runs", columns, unique=False, postgresql_where=where)


def upgrade() -> None:
    _rebuild(partial=True)


def downgrade() -> None:
    _rebuild(partial=False)
