"""The workers view: ``workers.version``, the Moorline version each worker process runs.

The other fields the view shows were there already (host, pid, lanes with slots, served
workflows, started, last seen, expiry); the runs a worker holds are read from
``runs.lease_owner``, which is the worker's id. A worker of an older version leaves the column
null, so a rolling deploy shows which processes still run the old code.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-28 11:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("version", sa.String(length=64), nullable=True))


def downgrade() -> None:
    op.drop_column("workers", "version")
