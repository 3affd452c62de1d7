"""Schedules: a tenant's recurring triggers (a cron expression in a time zone, or an interval).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28 11:45:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql, postgresql

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of moorline.db.types as of this revision (see env.py FROZEN_TYPES).
UTC_DATETIME = sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
JSON_DOCUMENT = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "schedules",
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("tenant_id", sa.String(36), nullable=False),
        sa.Column("workflow", sa.String(200), nullable=False),
        sa.Column("input", JSON_DOCUMENT, nullable=False),
        sa.Column("cron", sa.String(200), nullable=True),
        sa.Column("every_s", sa.Integer(), nullable=True),
        sa.Column("timezone", sa.String(64), nullable=False),
        sa.Column("catch_up", sa.String(8), nullable=False),
        sa.Column("paused", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("next_at", UTC_DATETIME, nullable=False),
        sa.Column("last_fired_at", UTC_DATETIME, nullable=True),
        sa.Column("last_run_id", sa.String(36), nullable=True),
        sa.Column("last_error", JSON_DOCUMENT, nullable=True),
        sa.Column("fired", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("refused", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("created_at", UTC_DATETIME, nullable=False),
        sa.Column("updated_at", UTC_DATETIME, nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name="fk_schedules_tenant_id_tenants",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_schedules"),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
    )
    op.create_index("ix_schedules_tenant_id_created_at", "schedules", ["tenant_id", "created_at"])
    op.create_index("ix_schedules_paused_next_at", "schedules", ["paused", "next_at"])
    op.create_index("ix_schedules_last_run_id", "schedules", ["last_run_id"])


def downgrade() -> None:
    # Its indexes go with it (MySQL refuses to drop the tenant index first: the foreign key
    # needs it).
    op.drop_table("schedules")
