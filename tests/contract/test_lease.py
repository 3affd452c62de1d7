"""Leases on every backend: renewal, release, fencing, and the heartbeat-versus-reap race."""

import asyncio
import random
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import replace
from typing import TypeVar

import pytest
from sqlalchemy import select

from moorline.db.manager import DatabaseManager
from moorline.db.repos.queue import Claim, QueueRepo
from moorline.db.schema import runs
from moorline.types import Attempt, RunId, RunStatus
from tests.contract.queue_helpers import (
    NO_CAP,
    Tenants,
    add_runs,
    event_types,
    lock_run,
    set_lease_expiry,
    statuses,
    unique,
    waits_for_a_lock,
)
from tests.helpers import FULL_SIZE, wait_for

RACE_TRIALS = 1_000 if FULL_SIZE else 400
"""Heartbeat-versus-reap trials per backend: issue 3's 1,000 with ``MOORLINE_FULL=1``."""
RACE_SPREAD_S = 0.002
"""Leases are set to expire within ±2 ms of the instant both statements are sent."""

TTL_S = 30.0

T = TypeVar("T")


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


async def claim_one(queue: QueueRepo, lane: str, owner: str = "worker") -> Claim:
    [claim] = await queue.claim_batch(lane, owner, limit=1, lease_ttl_s=TTL_S, tenant_caps=NO_CAP)
    return claim


async def lease_left_s(db: DatabaseManager, run_id: str) -> float:
    async with db.connect() as conn:
        expires, now = (
            await conn.execute(
                select(runs.c.lease_expires_at, db.backend.now()).where(runs.c.id == run_id)
            )
        ).one()
    return float((expires - now).total_seconds())


async def test_renew_extends_the_lease_by_database_time(
    db: DatabaseManager, tenants: Tenants
) -> None:
    queue = QueueRepo(db)
    lane = unique("lane")
    await add_runs(db, await tenants.new(), lane, 1)
    claim = await claim_one(queue, lane)
    await set_lease_expiry(db, [claim.run.run_id], 1.0)
    assert await lease_left_s(db, claim.run.run_id) < 2
    assert await queue.renew_lease(claim.fence, 60.0)
    assert 55 < await lease_left_s(db, claim.run.run_id) <= 60


async def test_renew_is_fenced_by_run_attempt_and_owner(
    db: DatabaseManager, tenants: Tenants
) -> None:
    queue = QueueRepo(db)
    lane = unique("lane")
    await add_runs(db, await tenants.new(), lane, 1)
    fence = (await claim_one(queue, lane)).fence
    assert not await queue.renew_lease(replace(fence, attempt=Attempt(fence.attempt + 1)), TTL_S)
    assert not await queue.renew_lease(replace(fence, owner="someone-else"), TTL_S)
    assert await queue.renew_lease(fence, TTL_S)


async def test_a_late_heartbeat_keeps_an_unreaped_lease(
    db: DatabaseManager, tenants: Tenants
) -> None:
    # Expired but not yet reaped is still the owner's: renewing it wins, and the reaper that
    # comes after finds nothing to take.
    queue = QueueRepo(db)
    lane = unique("lane")
    await add_runs(db, await tenants.new(), lane, 1)
    claim = await claim_one(queue, lane)
    await set_lease_expiry(db, [claim.run.run_id], -5.0)
    assert await queue.renew_lease(claim.fence, TTL_S)
    assert await queue.reap_expired() == []


async def test_release_requeues_at_once_and_fences_the_old_attempt(
    db: DatabaseManager, tenants: Tenants
) -> None:
    queue = QueueRepo(db)
    lane = unique("lane")
    [run_id] = await add_runs(db, await tenants.new(), lane, 1)
    first = await claim_one(queue, lane, "leaving")
    assert await queue.release(first.fence)
    assert await statuses(db, [run_id]) == {run_id: ("queued", 1)}
    assert not await queue.release(first.fence)
    assert not await queue.renew_lease(first.fence, TTL_S)
    # Claimable by another worker at once, under a new attempt.
    second = await claim_one(queue, lane, "staying")
    assert (second.run.run_id, second.fence.attempt) == (run_id, 2)
    assert not await queue.renew_lease(first.fence, TTL_S)
    assert await queue.renew_lease(second.fence, TTL_S)
    assert await event_types(db, run_id) == ["started", "released", "started"]


async def test_a_reclaimed_lease_rejects_the_zombie(db: DatabaseManager, tenants: Tenants) -> None:
    queue = QueueRepo(db)
    lane = unique("lane")
    [run_id] = await add_runs(db, await tenants.new(), lane, 1)
    zombie = await claim_one(queue, lane, "paused")
    await set_lease_expiry(db, [run_id], -1.0)
    [reaped] = await queue.reap_expired()
    assert (reaped.run_id, reaped.status) == (run_id, RunStatus.QUEUED)
    assert not await queue.renew_lease(zombie.fence, TTL_S)
    successor = await claim_one(queue, lane, "fresh")
    assert successor.fence.attempt == zombie.fence.attempt + 1
    assert not await queue.renew_lease(zombie.fence, TTL_S)
    assert not await queue.release(zombie.fence)


async def test_a_heartbeat_locks_its_runs_in_id_order(
    db: DatabaseManager, tenants: Tenants
) -> None:
    # A slot handoff locks the runs it ends in id order. A heartbeat over the same runs that
    # locked them in another order could hold one the handoff waits for while it waits for
    # one the handoff holds: a deadlock, which the database breaks by failing one of them.
    if not db.backend.capabilities.row_locks:
        pytest.skip("SQLite's one write lock has no order")
    queue = QueueRepo(db)
    lane = unique("lane")
    ids = sorted(RunId(str(uuid.uuid4())) for _ in range(8))
    # Stored largest id first: a scan in storage order meets the runs in reverse id order.
    await add_runs(db, await tenants.new(), lane, len(ids), ids=ids[::-1])
    claims = await queue.claim_batch(
        lane, "w", limit=len(ids), lease_ttl_s=TTL_S, tenant_caps=NO_CAP
    )
    assert len(claims) == len(ids)

    async with db.transaction() as handoff:
        await handoff.execute(lock_run(ids[0]))
        beat = asyncio.create_task(queue.renew_leases([c.fence for c in claims], TTL_S))
        await wait_for(
            lambda: waits_for_a_lock(db, "%lease_owner%"), message="the heartbeat to wait"
        )
        # Waiting for the first run in id order, the heartbeat holds none of the others.
        for run_id in ids[1:]:
            await handoff.execute(lock_run(run_id, nowait=True))
    renewal = await beat
    assert renewal.renewed == {(c.fence.run_id, c.fence.attempt) for c in claims}


async def late(call: Awaitable[T], delay_s: float) -> T:
    """``call`` after ``delay_s`` of head start for the other side (jitter, not synchronisation)."""
    await asyncio.sleep(delay_s)
    return await call


async def reap_duration_s(queue: QueueRepo) -> float:
    """The median time of an empty reaper pass on this backend, under this interpreter.

    The reaper reads before it writes, so with equal starts the heartbeat's single statement
    lands first in nearly every trial; skewing starts by up to one reaper pass either way makes
    both orders (and every overlap between them) happen, however slow tracing makes the code.
    """
    durations = []
    for _ in range(9):
        started = time.perf_counter()
        await queue.reap_expired()
        durations.append(time.perf_counter() - started)
    return statistics.median(durations)


# Untraced by coverage: its trials repeat paths other tests cover, and tracing would double
# their cost (and slow one side of the race more than the other).
@pytest.mark.no_cover
async def test_heartbeat_and_reap_at_the_expiry_instant_exactly_one_wins(
    db: DatabaseManager, tenants: Tenants
) -> None:
    queue = QueueRepo(db)
    lane = unique("lane")
    [run_id] = await add_runs(db, await tenants.new(), lane, 1, max_attempts=1_000_000)
    rng = random.Random(3)
    claim = await claim_one(queue, lane)
    skew_s = 1.5 * await reap_duration_s(queue)
    wins = {"heartbeat": 0, "reaper": 0}
    for trial in range(RACE_TRIALS):
        await set_lease_expiry(db, [run_id], rng.uniform(-RACE_SPREAD_S, RACE_SPREAD_S))
        skew = rng.uniform(-skew_s, skew_s)
        renewed, reaped = await asyncio.gather(
            late(queue.renew_lease(claim.fence, TTL_S), max(skew, 0.0)),
            late(queue.reap_expired(), max(-skew, 0.0)),
        )
        took = [r.run_id for r in reaped]
        assert renewed != (took == [run_id]), f"trial {trial}: renewed={renewed} reaped={took}"
        status, attempt = (await statuses(db, [run_id]))[run_id]
        if renewed:
            wins["heartbeat"] += 1
            assert (status, attempt) == ("running", claim.fence.attempt)
        else:
            wins["reaper"] += 1
            assert (status, attempt) == ("queued", claim.fence.attempt)
            claim = await claim_one(queue, lane)
    # Both sides must have won sometimes, or the race was not a race.
    assert wins["heartbeat"] > 0 and wins["reaper"] > 0, wins
