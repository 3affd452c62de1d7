"""Child runs on every backend: one child per key, limits, waking parents, orphans."""

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from moorline.db.manager import DatabaseManager
from moorline.db.repos.children import ChildLimitExceeded, ChildrenRepo, NewChild
from moorline.db.repos.parking import ParkingRepo, Wait, WaitKind
from moorline.db.repos.queue import Claim, QueueRepo
from moorline.db.repos.runs import Failed, RunsRepo
from moorline.types import JSONObject, RunStatus
from tests.contract.queue_helpers import (
    NO_CAP,
    Tenants,
    add_runs,
    lock_run,
    unique,
    waits_for_a_lock,
)
from tests.helpers import wait_for

TTL_S = 30.0


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


async def parent_claim(db: DatabaseManager, tenants: Tenants) -> Claim:
    lane = unique("lane")
    await add_runs(db, await tenants.new(), lane, 1)
    [claim] = await QueueRepo(db).claim_batch(
        lane, "w", limit=1, lease_ttl_s=TTL_S, tenant_caps=NO_CAP
    )
    return claim


def child(key: str) -> NewChild:
    return NewChild(key=key, workflow="echo", input={"k": key}, max_attempts=3, timeout_s=None)


async def test_a_key_starts_one_child_however_often_it_is_asked(
    db: DatabaseManager, tenants: Tenants
) -> None:
    claim = await parent_claim(db, tenants)
    repo = ChildrenRepo(db)
    first = await repo.start(claim.fence, claim.run, child("a"), max_children=10, max_depth=5)
    again = await repo.start(claim.fence, claim.run, child("a"), max_children=10, max_depth=5)
    assert first.run_id == again.run_id
    assert (first.parent_run_id, first.child_key, first.depth) == (claim.run.run_id, "a", 1)
    assert (first.tenant_id, first.lane, first.status) == (
        claim.run.tenant_id,
        claim.run.lane,
        RunStatus.QUEUED,
    )
    assert [c.run_id for c in await repo.list(claim.run.run_id)] == [first.run_id]


async def test_limits_on_count_and_depth(db: DatabaseManager, tenants: Tenants) -> None:
    claim = await parent_claim(db, tenants)
    repo = ChildrenRepo(db)
    await repo.start(claim.fence, claim.run, child("a"), max_children=1, max_depth=5)
    with pytest.raises(ChildLimitExceeded):
        await repo.start(claim.fence, claim.run, child("b"), max_children=1, max_depth=5)
    deep = replace(claim.run, depth=5)
    with pytest.raises(ChildLimitExceeded):
        await repo.start(claim.fence, deep, child("c"), max_children=10, max_depth=5)


async def test_a_parent_waiting_for_its_children_is_woken_when_the_last_one_ends(
    db: DatabaseManager, tenants: Tenants
) -> None:
    claim = await parent_claim(db, tenants)
    repo, runs = ChildrenRepo(db), RunsRepo(db)
    kids = [
        await repo.start(claim.fence, claim.run, child(k), max_children=10, max_depth=5)
        for k in ("a", "b")
    ]
    wait = Wait(kind=WaitKind.CHILDREN, until=None, children=tuple(k.run_id for k in kids))
    assert await ParkingRepo(db).park(claim.fence, wait)
    tenant = claim.run.tenant_id
    ended = [await runs.request_cancel(tenant, kids[0].run_id)]
    assert await repo.wake_parents(ended) == set()  # one is left
    ended = [await runs.request_cancel(tenant, kids[1].run_id)]
    assert await repo.wake_parents(ended) == {claim.run.lane}
    parent = await runs.get(claim.run.run_id)
    assert parent is not None and parent.status is RunStatus.QUEUED


async def test_a_park_is_refused_when_every_awaited_child_ended(
    db: DatabaseManager, tenants: Tenants
) -> None:
    claim = await parent_claim(db, tenants)
    repo = ChildrenRepo(db)
    kid = await repo.start(claim.fence, claim.run, child("a"), max_children=10, max_depth=5)
    await RunsRepo(db).request_cancel(claim.run.tenant_id, kid.run_id)
    wait = Wait(kind=WaitKind.CHILDREN, until=None, children=(kid.run_id,))
    assert not await ParkingRepo(db).park(claim.fence, wait)


async def test_a_parent_marks_its_children_awaited_in_id_order(
    db: DatabaseManager, tenants: Tenants
) -> None:
    # A slot handoff that ends several children locks them in id order; a parent marking them
    # awaited in another order (an index's) could deadlock with it.
    if not db.backend.capabilities.row_locks:
        pytest.skip("SQLite's one write lock has no order")
    claim = await parent_claim(db, tenants)
    repo = ChildrenRepo(db)
    kids = [
        await repo.start(claim.fence, claim.run, child(key), max_children=10, max_depth=5)
        for key in "abcdef"
    ]
    ids = sorted(kid.run_id for kid in kids)
    # All but the first (in id order) have ended: an index of the children by status meets
    # them before it.
    for run_id in ids[1:]:
        await RunsRepo(db).request_cancel(claim.run.tenant_id, run_id)

    wait = Wait(kind=WaitKind.CHILDREN, until=None, children=tuple(ids[::-1]))
    async with db.transaction() as handoff:
        await handoff.execute(lock_run(ids[0]))
        park = asyncio.create_task(ParkingRepo(db).park(claim.fence, wait))
        await wait_for(lambda: waits_for_a_lock(db, "%parent_run_id%"), message="the park to wait")
        # Waiting for the first child in id order, the parent holds none of the others.
        for run_id in ids[1:]:
            await handoff.execute(lock_run(run_id, nowait=True))
    assert await park


async def test_the_backstop_wakes_parents_and_finds_orphans(
    db: DatabaseManager, tenants: Tenants
) -> None:
    claim = await parent_claim(db, tenants)
    repo, runs = ChildrenRepo(db), RunsRepo(db)
    kid = await repo.start(claim.fence, claim.run, child("a"), max_children=10, max_depth=5)
    wait = Wait(kind=WaitKind.CHILDREN, until=None, children=(kid.run_id,))
    assert await ParkingRepo(db).park(claim.fence, wait)
    await runs.request_cancel(claim.run.tenant_id, kid.run_id)  # nobody woke the parent
    assert claim.run.lane in await repo.wake_ready_parents()
    # The parent fails while its attached child is queued: the child is an orphan, a
    # detached one is not.
    other = await parent_claim(db, tenants)
    orphan = await repo.start(other.fence, other.run, child("x"), max_children=10, max_depth=5)
    kept = replace(child("y"), detached=True)
    free = await repo.start(other.fence, other.run, kept, max_children=10, max_depth=5)
    assert orphan.run_id not in [o.run_id for o in await repo.orphans()]  # parent still runs
    error: JSONObject = {"type": "ValueError", "message": "boom", "reason": "non-retryable"}
    assert await runs.finish_many([Failed(fence=other.fence, error=error, retry_delay_s=None)])
    found = [o.run_id for o in await repo.orphans()]
    assert orphan.run_id in found and free.run_id not in found
