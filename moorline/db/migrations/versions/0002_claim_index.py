"""Claim index per lane and tenant: ``(status, lane, tenant_id, priority DESC, not_before, id)``.

It replaces ``ix_runs_claim`` (``status, lane, priority, not_before``), which it makes redundant.

The claim finds the tenants with queued runs in a lane by skipping through this index, then
reads only each chosen tenant's next runs in claim order, so its cost follows the number of
tenants waiting, not the length of the backlog.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 13:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_runs_lane_tenant",
        "runs",
        ["status", "lane", "tenant_id", sa.text("priority DESC"), "not_before", "id"],
        unique=False,
    )
    op.drop_index("ix_runs_claim", table_name="runs")


def downgrade() -> None:
    op.create_index(
        "ix_runs_claim", "runs", ["status", "lane", "priority", "not_before"], unique=False
    )
    op.drop_index("ix_runs_lane_tenant", table_name="runs")
