"""Rows for the dispatch contract tests, written straight into the schema.

The claim, lease and reaper tests must not depend on the runs repository, so they insert the
rows a run would have after enqueue themselves, and read back what they assert on.
"""

import uuid
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from sqlalchemy import Select, delete, func, insert, select, text, update

from moorline.db.manager import DatabaseManager
from moorline.db.repos.records import Fence
from moorline.db.schema import events, runs, tenants
from moorline.types import RunId, RunStatus, TenantId

WIDE_OPEN = "wide_open"
"""A plan name the tests map to a cap so large it never binds."""

NO_CAP: dict[str, int] = {WIDE_OPEN: 1_000_000}


async def no_caps() -> dict[str, int]:
    """``NO_CAP`` as a worker asks for it (``Worker(tenant_caps=no_caps)``)."""
    return NO_CAP


INSERT_CHUNK = 500


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


async def create_tenant(db: DatabaseManager, plan: str = WIDE_OPEN) -> TenantId:
    tenant_id = TenantId(str(uuid.uuid4()))
    now = datetime.now(UTC)
    async with db.transaction() as conn:
        await conn.execute(
            insert(tenants).values(
                id=tenant_id, name=unique("tenant"), plan=plan, created_at=now, updated_at=now
            )
        )
    return tenant_id


async def add_runs(
    db: DatabaseManager,
    tenant_id: TenantId,
    lane: str,
    count: int,
    *,
    priority: int = 0,
    not_before: datetime | None = None,
    max_attempts: int = 3,
    spacing: timedelta = timedelta(microseconds=10),
    workflow: str = "noop",
    ids: Sequence[RunId] | None = None,
) -> list[RunId]:
    """Insert ``count`` queued runs, their ``not_before`` increasing in insertion order.

    The default ``not_before`` lies in the past, so the runs are claimable at once whatever
    the clock difference between the test process and the database. ``ids``: the runs' ids,
    stored in that order (new random ones by default).
    """
    start = not_before if not_before is not None else datetime.now(UTC) - timedelta(hours=1)
    now = datetime.now(UTC)
    if ids is None:
        ids = [RunId(str(uuid.uuid4())) for _ in range(count)]
    if len(ids) != count:
        raise ValueError(f"{len(ids)} ids for {count} runs")
    rows = [
        {
            "id": run_id,
            "tenant_id": tenant_id,
            "workflow": workflow,
            "status": RunStatus.QUEUED.value,
            "lane": lane,
            "priority": priority,
            "attempt": 0,
            "max_attempts": max_attempts,
            "not_before": start + spacing * index,
            "input_hash": "0" * 64,
            "input": {},
            "created_at": now,
            "updated_at": now,
            "prompt_tokens": 0,
            "completion_tokens": 0,
        }
        for index, run_id in enumerate(ids)
    ]
    for offset in range(0, len(rows), INSERT_CHUNK):
        async with db.transaction() as conn:
            await conn.execute(insert(runs), rows[offset : offset + INSERT_CHUNK])
    return list(ids)


def lock_run(run_id: str, *, nowait: bool = False) -> Select[tuple[str]]:
    """The run's row, locked ``FOR UPDATE`` (``NOWAIT``: refused at once if another holds it)."""
    return select(runs.c.id).where(runs.c.id == run_id).with_for_update(nowait=nowait)


async def waits_for_a_lock(db: DatabaseManager, statement: str) -> bool:
    """Whether a statement whose text is LIKE ``statement`` is waiting for a row lock.

    PostgreSQL says so; on MariaDB a statement still in progress is taken as waiting (the
    tests' statements take milliseconds, and a lock wait may come before the transaction
    shows in ``innodb_trx``).
    """
    if db.backend.name == "postgresql":
        query = (
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND datname = current_database() AND query LIKE :statement"
        )
    else:
        query = (
            "SELECT count(*) FROM information_schema.processlist"
            " WHERE db = DATABASE() AND info LIKE :statement"
        )
    async with db.connect() as conn:
        return bool((await conn.execute(text(query), {"statement": statement})).scalar_one())


async def statuses(db: DatabaseManager, run_ids: Sequence[str]) -> dict[str, tuple[str, int]]:
    """run id → (status, attempt)."""
    async with db.connect() as conn:
        rows = await conn.execute(
            select(runs.c.id, runs.c.status, runs.c.attempt).where(runs.c.id.in_(list(run_ids)))
        )
        return {row.id: (row.status, row.attempt) for row in rows}


async def running_per_tenant(db: DatabaseManager, tenant_ids: Sequence[str]) -> Counter[str]:
    async with db.connect() as conn:
        rows = await conn.execute(
            select(runs.c.tenant_id, func.count())
            .where(runs.c.status == RunStatus.RUNNING.value, runs.c.tenant_id.in_(tenant_ids))
            .group_by(runs.c.tenant_id)
        )
        return Counter({tenant_id: count for tenant_id, count in rows})


async def event_counts(
    db: DatabaseManager, run_ids: Sequence[str], event_type: str
) -> Counter[str]:
    async with db.connect() as conn:
        rows = await conn.execute(
            select(events.c.run_id, func.count())
            .where(events.c.run_id.in_(list(run_ids)), events.c.type == event_type)
            .group_by(events.c.run_id)
        )
        return Counter({run_id: count for run_id, count in rows})


async def event_types(db: DatabaseManager, run_id: str) -> list[str]:
    async with db.connect() as conn:
        rows = await conn.execute(
            select(events.c.type).where(events.c.run_id == run_id).order_by(events.c.seq)
        )
        return list(rows.scalars())


async def requeue_all(db: DatabaseManager, tenant_id: TenantId) -> None:
    """Put every run of the tenant back to ``queued``, as if each had been released."""
    async with db.transaction() as conn:
        await conn.execute(
            update(runs)
            .where(runs.c.tenant_id == tenant_id)
            .values(status=RunStatus.QUEUED.value, lease_owner=None, lease_expires_at=None)
        )


async def finish(db: DatabaseManager, fence: Fence) -> bool:
    """End a claimed run ``succeeded`` under its fence (what the runs repository will do)."""
    async with db.transaction() as conn:
        result = await conn.execute(
            update(runs).where(fence.clause()).values(status=RunStatus.SUCCEEDED.value)
        )
    return result.rowcount == 1


async def set_lease_expiry(db: DatabaseManager, run_ids: Sequence[str], plus_s: float) -> None:
    """Move the leases of ``run_ids`` to database time + ``plus_s`` (negative: expired)."""
    async with db.transaction() as conn:
        await conn.execute(
            update(runs)
            .where(runs.c.id.in_(list(run_ids)))
            .values(lease_expires_at=db.backend.now(plus_s=plus_s))
        )


async def purge_tenant(db: DatabaseManager, tenant_id: TenantId) -> None:
    """Delete a tenant's runs and events, so later tests in the module do not see them."""
    async with db.transaction() as conn:
        run_ids = select(runs.c.id).where(runs.c.tenant_id == tenant_id).scalar_subquery()
        await conn.execute(delete(events).where(events.c.run_id.in_(run_ids)))
        await conn.execute(delete(runs).where(runs.c.tenant_id == tenant_id))
        await conn.execute(delete(tenants).where(tenants.c.id == tenant_id))


class Tenants:
    """Tenants a test created, purged with their runs when the test ends."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db
        self.created: list[TenantId] = []

    async def new(self, plan: str = WIDE_OPEN) -> TenantId:
        tenant_id = await create_tenant(self._db, plan)
        self.created.append(tenant_id)
        return tenant_id

    async def purge(self) -> None:
        for tenant_id in self.created:
            await purge_tenant(self._db, tenant_id)
