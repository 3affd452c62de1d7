"""The scrape-time reads of ``/metrics``, on every backend."""

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import insert

from moorline.db.manager import DatabaseManager
from moorline.db.repos.gauges import Gauges
from moorline.db.repos.queue import QueueRepo
from moorline.db.schema import interrupts
from moorline.types import RunId
from tests.contract.queue_helpers import NO_CAP, Tenants, add_runs, unique


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


async def _interrupt(db: DatabaseManager, run_id: RunId, status: str = "pending") -> None:
    now = datetime.now(UTC)
    async with db.transaction() as conn:
        await conn.execute(
            insert(interrupts).values(
                id=str(uuid.uuid4()),
                run_id=run_id,
                key=unique("interrupt"),
                action="post_comment",
                data={},
                status=status,
                attempt=1,
                created_at=now,
                expires_at=now + timedelta(minutes=5),
            )
        )


async def test_runs_are_counted_per_lane_and_status(db: DatabaseManager, tenants: Tenants) -> None:
    gauges = Gauges(db)
    tenant = await tenants.new()
    lane, other = unique("lane"), unique("lane")
    await add_runs(db, tenant, lane, 4)
    await add_runs(db, tenant, other, 1)
    await QueueRepo(db).claim_batch(lane, "worker", limit=3, lease_ttl_s=30.0, tenant_caps=NO_CAP)
    counted = await gauges.runs_by_lane_and_status()
    assert counted[(lane, "queued")] == 1
    assert counted[(lane, "running")] == 3
    assert counted[(other, "queued")] == 1
    assert (other, "running") not in counted


async def test_only_the_pending_interrupts_of_running_runs_count(
    db: DatabaseManager, tenants: Tenants
) -> None:
    gauges = Gauges(db)
    tenant = await tenants.new()
    lane = unique("lane")
    running, queued = await add_runs(db, tenant, lane, 2)
    await QueueRepo(db).claim_batch(lane, "worker", limit=1, lease_ttl_s=30.0, tenant_caps=NO_CAP)
    before = await gauges.pending_interrupts()
    await _interrupt(db, running)
    await _interrupt(db, running, status="approved")
    await _interrupt(db, queued)  # left pending by an attempt that ended: nobody waits on it
    assert await gauges.pending_interrupts() == before + 1
