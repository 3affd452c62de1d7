"""Parking on every backend: a park and what ends the wait serialise on the run's row.

Whichever commits first, the other sees it: a decision or a message recorded before the park
makes the park refuse (the workflow goes on in memory); one recorded after it re-queues the
run. The race trials run both at once and check that no run is left waiting for something
that has already arrived.
"""

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select

from moorline.db.manager import DatabaseManager
from moorline.db.repos.events import EventsRepo
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.messages import MessagesRepo
from moorline.db.repos.parking import ParkingRepo, Wait, WaitKind
from moorline.db.repos.queue import QueueRepo
from moorline.db.repos.records import Fence, InterruptStatus
from moorline.db.repos.runs import RunsRepo
from moorline.db.schema import runs
from moorline.errors import CancelRequested, LeaseLost
from moorline.types import RunStatus, TenantId
from tests.contract.queue_helpers import NO_CAP, Tenants, add_runs, unique
from tests.helpers import FULL_SIZE

TTL_S = 30.0
TRIALS = 1_000 if FULL_SIZE else 40
"""Decision-against-park races per backend (the issue's 1,000 behind ``make test-full``)."""

LATER = timedelta(hours=1)


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


async def claimed(db: DatabaseManager, tenant: TenantId, count: int = 1) -> list[Fence]:
    lane = unique("lane")
    await add_runs(db, tenant, lane, count)
    claims = await QueueRepo(db).claim_batch(
        lane, "worker", limit=count, lease_ttl_s=TTL_S, tenant_caps=NO_CAP
    )
    assert len(claims) == count
    return [claim.fence for claim in claims]


async def row(db: DatabaseManager, run_id: str) -> dict[str, Any]:
    async with db.connect() as conn:
        found = await conn.execute(select(runs).where(runs.c.id == run_id))
        return dict(found.mappings().one())


def later() -> datetime:
    return datetime.now(UTC) + LATER


async def test_a_park_frees_the_lease_and_records_what_the_run_waits_for(
    db: DatabaseManager, tenants: Tenants
) -> None:
    [fence] = await claimed(db, await tenants.new())
    until = later()
    assert await ParkingRepo(db).park(fence, Wait(kind=WaitKind.SLEEP, until=until))
    parked = await row(db, fence.run_id)
    assert parked["status"] == RunStatus.WAITING.value
    assert parked["lease_owner"] is None and parked["lease_expires_at"] is None
    assert parked["waiting_for"] == {"kind": "sleep", "until": until.isoformat()}
    assert abs((parked["wake_at"] - until).total_seconds()) < 0.001
    [waiting] = [e for e in await EventsRepo(db).list(fence.run_id) if e.type == "waiting"]
    assert waiting.data == parked["waiting_for"]
    # The attempt is over: its fence no longer holds.
    with pytest.raises(LeaseLost):
        await ParkingRepo(db).park(fence, Wait(kind=WaitKind.SLEEP, until=until))


async def test_a_decision_before_the_park_refuses_it_and_one_after_requeues_the_run(
    db: DatabaseManager, tenants: Tenants
) -> None:
    interrupts, parking = InterruptsRepo(db), ParkingRepo(db)
    first, second = await claimed(db, await tenants.new(), 2)
    for fence in (first, second):
        await interrupts.open(fence, "permission:1", "ship", {}, 3600)
    early = (await interrupts.pending_for_run(first.run_id))[0]
    await interrupts.resolve(
        first.run_id, early.interrupt_id, approved=True, reason="approved", data=None
    )
    wait = Wait(kind=WaitKind.PERMISSION, until=later(), interrupt_id=early.interrupt_id)
    assert not await parking.park(first, wait)
    assert (await row(db, first.run_id))["status"] == RunStatus.RUNNING.value

    late = (await interrupts.pending_for_run(second.run_id))[0]
    wait = Wait(kind=WaitKind.PERMISSION, until=later(), interrupt_id=late.interrupt_id)
    assert await parking.park(second, wait)
    await interrupts.resolve(
        second.run_id, late.interrupt_id, approved=False, reason="denied", data=None
    )
    resumed = await row(db, second.run_id)
    assert resumed["status"] == RunStatus.QUEUED.value
    assert resumed["resumes"] == 1 and resumed["waiting_for"] is None
    [event] = [e for e in await EventsRepo(db).list(second.run_id) if e.type == "resumed"]
    assert event.data == {"reason": "decision", "waited_for": "permission"}


async def test_a_message_before_the_park_refuses_it_and_one_after_requeues_the_run(
    db: DatabaseManager, tenants: Tenants
) -> None:
    tenant = await tenants.new()
    inbox, parking = MessagesRepo(db), ParkingRepo(db)
    first, second = await claimed(db, tenant, 2)
    await inbox.post(tenant, first.run_id, "early")
    assert not await parking.park(first, Wait(kind=WaitKind.MESSAGE, until=None))
    assert await parking.park(second, Wait(kind=WaitKind.MESSAGE, until=None))
    posted = await inbox.post(tenant, second.run_id, "late")
    assert posted.resumed_lane is not None
    assert (await row(db, second.run_id))["status"] == RunStatus.QUEUED.value


async def test_a_run_waiting_for_a_decision_refuses_messages(
    db: DatabaseManager, tenants: Tenants
) -> None:
    from moorline.errors import RunNotInteractive

    tenant = await tenants.new()
    [fence] = await claimed(db, tenant)
    assert await ParkingRepo(db).park(fence, Wait(kind=WaitKind.SLEEP, until=later()))
    with pytest.raises(RunNotInteractive):
        await MessagesRepo(db).post(tenant, fence.run_id, "hello")


async def test_a_cancelled_run_does_not_park(db: DatabaseManager, tenants: Tenants) -> None:
    tenant = await tenants.new()
    [fence] = await claimed(db, tenant)
    await RunsRepo(db).request_cancel(tenant, fence.run_id)
    with pytest.raises(CancelRequested):
        await ParkingRepo(db).park(fence, Wait(kind=WaitKind.SLEEP, until=later()))


async def test_a_decision_racing_the_park_is_never_lost(
    db: DatabaseManager, tenants: Tenants
) -> None:
    """Park and decide at once, many times: the run either never parked or was re-queued."""
    interrupts, parking = InterruptsRepo(db), ParkingRepo(db)
    fences = await claimed(db, await tenants.new(), TRIALS)
    outcomes: dict[str, int] = {"refused": 0, "requeued": 0}
    for fence in fences:
        opened = await interrupts.open(fence, "permission:1", "ship", {}, 3600)
        wait = Wait(kind=WaitKind.PERMISSION, until=later(), interrupt_id=opened.interrupt_id)
        parked, decided = await asyncio.gather(
            parking.park(fence, wait),
            interrupts.resolve(
                fence.run_id, opened.interrupt_id, approved=True, reason="approved", data=None
            ),
        )
        assert decided.status is InterruptStatus.APPROVED
        status = (await row(db, fence.run_id))["status"]
        if parked:
            assert status == RunStatus.QUEUED.value, "parked, then left waiting after a decision"
            outcomes["requeued"] += 1
        else:
            assert status == RunStatus.RUNNING.value
            outcomes["refused"] += 1
    assert sum(outcomes.values()) == TRIALS


async def test_a_resumed_run_is_claimed_ahead_of_runs_queued_after_it(
    db: DatabaseManager, tenants: Tenants
) -> None:
    tenant = await tenants.new()
    queue, parking = QueueRepo(db), ParkingRepo(db)
    lane = unique("lane")
    [parked_id] = await add_runs(db, tenant, lane, 1)
    [claim] = await queue.claim_batch(lane, "w", limit=1, lease_ttl_s=TTL_S, tenant_caps=NO_CAP)
    assert claim.fence.run_id == parked_id
    assert await parking.park(claim.fence, Wait(kind=WaitKind.MESSAGE, until=None))
    await add_runs(db, tenant, lane, 3)  # queued while the first one waits
    posted = await MessagesRepo(db).post(tenant, claim.fence.run_id, "back")
    assert posted.resumed_lane == lane
    [first] = await queue.claim_batch(lane, "w", limit=1, lease_ttl_s=TTL_S, tenant_caps=NO_CAP)
    assert first.fence.run_id == parked_id
    assert first.fence.attempt == 2 and first.run.resumes == 1
