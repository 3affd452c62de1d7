"""Workers claim only the workflows they serve: ``workers``, and ``workflow`` in the claim index.

- ``workers``: one row per live worker process (lanes with slots, the workflows it serves),
  renewed with its heartbeat and expiring with the lease TTL, so the API can report queued runs
  that no live worker serves.
- ``ix_runs_lane_tenant`` gains ``workflow`` as its last column: the claim filters on the
  served workflows while walking the index entries it reads anyway, and the unserved runs are
  counted from the index alone.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-28 08:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql, postgresql

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of moorline.db.types as of this revision (see 0001).
UTC_DATETIME = sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
JSON_DOCUMENT = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")

CLAIM_COLUMNS: list[str | sa.TextClause] = [
    "status",
    "lane",
    "tenant_id",
    sa.text("priority DESC"),
    "not_before",
    "id",
]


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("id", sa.String(length=255), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("lanes", JSON_DOCUMENT, nullable=False),
        sa.Column("workflows", JSON_DOCUMENT, nullable=True),
        sa.Column("started_at", UTC_DATETIME, nullable=False),
        sa.Column("last_seen_at", UTC_DATETIME, nullable=False),
        sa.Column("expires_at", UTC_DATETIME, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
    )
    op.drop_index("ix_runs_lane_tenant", table_name="runs")
    op.create_index("ix_runs_lane_tenant", "runs", [*CLAIM_COLUMNS, "workflow"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_runs_lane_tenant", table_name="runs")
    op.create_index("ix_runs_lane_tenant", "runs", CLAIM_COLUMNS, unique=False)
    op.drop_table("workers")
