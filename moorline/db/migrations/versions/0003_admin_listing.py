"""Indexes of the run listings the dashboard pages through, at any depth and on any filter.

- ``ix_runs_created`` (``created_at, id``): every tenant's runs, newest first (the admin's
  listing), and its keyset cursor.
- ``ix_runs_status_created`` and ``ix_runs_workflow_created``: the same listing filtered on a
  status or a workflow, so a rare one is found without reading past the common ones.
- ``ix_runs_tenant_status`` grows from ``(tenant_id, status)`` to ``(tenant_id, status,
  created_at, id)``: a tenant's listing filtered on a status is one index range. Without it,
  SQLite (which plans without statistics) walks ``ix_runs_status_created`` for that query,
  reading other tenants' runs of that status. The concurrency cap's count still uses its
  prefix.

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
    op.create_index(
        "ix_runs_workflow_created", "runs", ["workflow", "created_at", "id"], unique=False
    )
    op.drop_index("ix_runs_tenant_status", table_name="runs")
    op.create_index(
        "ix_runs_tenant_status", "runs", ["tenant_id", "status", "created_at", "id"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_runs_tenant_status", table_name="runs")
    op.create_index("ix_runs_tenant_status", "runs", ["tenant_id", "status"], unique=False)
    op.drop_index("ix_runs_workflow_created", table_name="runs")
    op.drop_index("ix_runs_status_created", table_name="runs")
    op.drop_index("ix_runs_created", table_name="runs")
