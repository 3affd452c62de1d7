"""Rows for the retention tests: old finished runs with a row in every table keyed by run id."""

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import func, insert, select

from moorline.db.manager import DatabaseManager
from moorline.db.repos.retention import RUN_TABLES, RetentionPolicy, RetentionRepo
from moorline.db.schema import events, interrupts, messages, runs, steps
from moorline.types import RunId, RunStatus, TenantId
from tests.contract.queue_helpers import unique

KEEP_30 = RetentionPolicy(default_days=30.0)
LANE = "workflow"


def _run_row(
    tenant: TenantId,
    *,
    status: RunStatus,
    finished_days_ago: float | None,
    parent: RunId | None = None,
) -> dict[str, Any]:
    now = datetime.now(UTC)
    finished = None if finished_days_ago is None else now - timedelta(days=finished_days_ago)
    created = (finished or now) - timedelta(seconds=5)
    return {
        "id": str(uuid.uuid4()),
        "tenant_id": tenant,
        "workflow": "noop",
        "status": status.value,
        "lane": LANE,
        "priority": 0,
        "attempt": 1,
        "max_attempts": 3,
        "not_before": created,
        "input_hash": "0" * 64,
        "input": {},
        "created_at": created,
        "updated_at": finished or now,
        "finished_at": finished,
        "parent_run_id": parent,
        "child_key": None if parent is None else unique("key"),
        "depth": 0 if parent is None else 1,
    }


async def add_runs(
    db: DatabaseManager,
    tenant: TenantId,
    count: int,
    *,
    status: RunStatus = RunStatus.SUCCEEDED,
    finished_days_ago: float | None = 40.0,
    parent: RunId | None = None,
) -> list[RunId]:
    """``count`` runs, each with one step, two events, one interrupt and one message."""
    rows = [
        _run_row(tenant, status=status, finished_days_ago=finished_days_ago, parent=parent)
        for _ in range(count)
    ]
    now = datetime.now(UTC)
    ids = [RunId(row["id"]) for row in rows]
    async with db.transaction() as conn:
        await conn.execute(insert(runs), rows)
        await conn.execute(
            insert(steps),
            [
                {
                    "run_id": run_id,
                    "key": "s",
                    "status": "succeeded",
                    "attempt": 1,
                    "function": "f",
                    "call_hash": "0" * 64,
                    "output": {"x": 1},
                    "started_at": now,
                    "finished_at": now,
                    "seq": 1,
                }
                for run_id in ids
            ],
        )
        await conn.execute(
            insert(events),
            [
                {
                    "run_id": run_id,
                    "seq": seq,
                    "type": "t",
                    "attempt": 1,
                    "data": {},
                    "created_at": now,
                }
                for run_id in ids
                for seq in (1, 2)
            ],
        )
        await conn.execute(
            insert(interrupts),
            [
                {
                    "id": str(uuid.uuid4()),
                    "run_id": run_id,
                    "key": "i",
                    "action": "a",
                    "data": {},
                    "status": "approved",
                    "attempt": 1,
                    "created_at": now,
                    "expires_at": now,
                }
                for run_id in ids
            ],
        )
        await conn.execute(
            insert(messages),
            [{"run_id": run_id, "seq": 1, "content": "hi", "created_at": now} for run_id in ids],
        )
    return ids


async def rows_of(db: DatabaseManager, run_ids: Sequence[str]) -> dict[str, int]:
    """Table name → rows of ``run_ids`` left in it."""
    found = {}
    async with db.connect() as conn:
        count = select(func.count()).where(runs.c.id.in_(list(run_ids)))
        found["runs"] = (await conn.execute(count)).scalar_one()
        for table in RUN_TABLES:
            stmt = select(func.count()).where(table.c.run_id.in_(list(run_ids)))
            found[table.name] = (await conn.execute(stmt)).scalar_one()
    return found


async def clean_all(
    db: DatabaseManager, policy: RetentionPolicy = KEEP_30, limit: int = 500
) -> list[int]:
    """Batches until the end of the old runs; the runs each deleted."""
    repo, after, deleted = RetentionRepo(db), None, []
    while True:
        batch = await repo.delete_batch(policy, after=after, limit=limit)
        deleted.append(batch.runs)
        if batch.next is None:
            return deleted
        after = batch.next
