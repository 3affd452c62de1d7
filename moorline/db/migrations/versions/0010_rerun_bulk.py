"""Re-runs and bulk actions: ``runs.rerun_of``, ``bulk_jobs`` and ``bulk_job_runs``.

- ``runs.rerun_of``: the run a re-run was started from (``POST /v1/runs/{id}/rerun``).
- ``bulk_jobs``: one row per bulk cancel or retry, with its progress; ``(scope,
  idempotency_key)`` is unique, so a request sent twice finds the first one's job.
- ``bulk_job_runs``: the runs a job acts on, fixed when it is created, each with its outcome
  once acted on (NULL before): a batch acts on its runs and writes their outcomes in one
  transaction.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-28 12:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql, postgresql

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of moorline.db.types as of this revision (see 0001).
UTC_DATETIME = sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
JSON_DOCUMENT = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.add_column("runs", sa.Column("rerun_of", sa.String(36), nullable=True))
    op.create_table(
        "bulk_jobs",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("scope", sa.String(length=36), nullable=False),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("filters", JSON_DOCUMENT, nullable=False),
        sa.Column("idempotency_key", sa.String(length=255), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("done", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("failed", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("created_at", UTC_DATETIME, nullable=False),
        sa.Column("updated_at", UTC_DATETIME, nullable=False),
        sa.Column("finished_at", UTC_DATETIME, nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_bulk_jobs")),
        sa.UniqueConstraint(
            "scope", "idempotency_key", name=op.f("uq_bulk_jobs_scope_idempotency_key")
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
    )
    op.create_index("ix_bulk_jobs_state", "bulk_jobs", ["state", "created_at"], unique=False)
    op.create_table(
        "bulk_job_runs",
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("run_id", sa.String(length=36), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=True),
        sa.Column("reason", sa.String(length=64), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["bulk_jobs.id"],
            name=op.f("fk_bulk_job_runs_job_id_bulk_jobs"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_bulk_job_runs_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", "run_id", name=op.f("pk_bulk_job_runs")),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
    )
    op.create_index(
        "ix_bulk_job_runs_todo", "bulk_job_runs", ["job_id", "outcome", "run_id"], unique=False
    )
    op.create_index("ix_bulk_job_runs_run_id", "bulk_job_runs", ["run_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_bulk_job_runs_todo", table_name="bulk_job_runs")
    op.drop_table("bulk_job_runs")
    op.drop_index("ix_bulk_jobs_state", table_name="bulk_jobs")
    op.drop_table("bulk_jobs")
    op.drop_column("runs", "rerun_of")
