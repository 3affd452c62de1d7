"""Traces: ``runs.trace_context``, the trigger's W3C trace context the worker's spans join.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-28 14:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0015"
down_revision: str | Sequence[str] | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON_DOCUMENT = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    # Nullable, no default: adding it rewrites no row on any backend.
    op.add_column("runs", sa.Column("trace_context", JSON_DOCUMENT, nullable=True))


def downgrade() -> None:
    op.drop_column("runs", "trace_context")
