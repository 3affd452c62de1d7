"""LLM usage: tokens and cost per step, per run, and per tenant, day, workflow and model.

``steps.usage`` holds a step's model calls by model; the runs gain the cached tokens, the cost
and what replays saved; ``llm_usage`` keeps a tenant's totals per UTC day, workflow and model,
added to in the transaction of the checkpoint that counts them.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-28 14:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON_DOCUMENT = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.add_column("steps", sa.Column("usage", JSON_DOCUMENT, nullable=True))
    op.add_column(
        "runs", sa.Column("cached_tokens", sa.Integer(), nullable=False, server_default="0")
    )
    op.add_column("runs", sa.Column("cost", sa.Double(), nullable=False, server_default="0"))
    op.add_column(
        "runs", sa.Column("saved_tokens", sa.Integer(), nullable=False, server_default="0")
    )
    op.add_column("runs", sa.Column("saved_cost", sa.Double(), nullable=False, server_default="0"))
    op.create_table(
        "llm_usage",
        sa.Column("tenant_id", sa.String(36), nullable=False),
        sa.Column("day", sa.String(10), nullable=False),
        sa.Column("workflow", sa.String(200), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("failed_requests", sa.BigInteger(), nullable=False),
        sa.Column("cost", sa.Double(), nullable=False),
        sa.Column("saved_tokens", sa.BigInteger(), nullable=False),
        sa.Column("saved_cost", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name="fk_llm_usage_tenant_id_tenants",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("tenant_id", "day", "workflow", "model", name="pk_llm_usage"),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
    )


def downgrade() -> None:
    op.drop_table("llm_usage")
    op.drop_column("runs", "saved_cost")
    op.drop_column("runs", "saved_tokens")
    op.drop_column("runs", "cost")
    op.drop_column("runs", "cached_tokens")
    op.drop_column("steps", "usage")
