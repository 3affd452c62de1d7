"""The operators' view of the workers, on every backend (issue 20, item 5).

Every worker process keeps a ``workers`` row; the view lists live and dead ones (a row whose
expiry passed by database time), with the runs each holds read from ``runs.lease_owner``, and
a dead row is pruned once it is :data:`PRUNE_AFTER_S` past its expiry.
"""

from collections.abc import AsyncIterator, Sequence

import pytest
from sqlalchemy import update

from moorline.db.manager import DatabaseManager
from moorline.db.repos.workers import (
    HELD_IDS_LISTED,
    PRUNE_AFTER_S,
    ListedWorker,
    WorkerEntry,
    WorkersRepo,
)
from moorline.db.schema import runs, workers
from moorline.types import RunId, RunStatus
from tests.contract.queue_helpers import Tenants, add_runs, unique

TTL_S = 30.0


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


def entry(lanes: dict[str, int], workflows: list[str] | None, *, pid: int = 1) -> WorkerEntry:
    return WorkerEntry(
        worker_id=unique("worker"),
        host=unique("host"),
        pid=pid,
        lanes=lanes,
        workflows=workflows,
        version="1.2.3",
    )


async def hold(db: DatabaseManager, owner: str, run_ids: Sequence[RunId]) -> None:
    """Put queued runs in ``running`` under ``owner``'s lease, as its claim would."""
    async with db.transaction() as conn:
        await conn.execute(
            update(runs)
            .where(runs.c.id.in_(run_ids))
            .values(
                status=RunStatus.RUNNING.value,
                attempt=1,
                lease_owner=owner,
                lease_expires_at=db.backend.now(plus_s=TTL_S),
                started_at=db.backend.now(),
            )
        )


async def listed(repo: WorkersRepo, *entries: WorkerEntry) -> dict[str, ListedWorker]:
    ids = {item.worker_id for item in entries}
    return {
        w.worker.entry.worker_id: w for w in await repo.listing() if w.worker.entry.worker_id in ids
    }


async def test_the_listing_shows_live_and_dead_workers_with_the_runs_they_hold(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = WorkersRepo(db)
    tenant = await tenants.new()
    lane = unique("lane")
    live = entry({lane: 60, "other": 2}, ["alpha", "beta"])
    idle = entry({lane: 1}, None)
    dead = entry({lane: 4}, ["alpha"])
    await repo.beat(live, TTL_S)
    await repo.beat(idle, TTL_S)
    await repo.beat(dead, -1.0)  # its last beat was more than a TTL ago
    many = await add_runs(db, tenant, lane, HELD_IDS_LISTED + 5, workflow="alpha")
    await hold(db, live.worker_id, many)
    dead_runs = await add_runs(db, tenant, lane, 2, workflow="alpha")
    await hold(db, dead.worker_id, dead_runs)
    await add_runs(db, tenant, lane, 3, workflow="alpha")  # queued: nobody holds them

    found = await listed(repo, live, idle, dead)
    assert set(found) == {live.worker_id, idle.worker_id, dead.worker_id}
    assert (found[live.worker_id].alive, found[idle.worker_id].alive) == (True, True)
    assert found[dead.worker_id].alive is False
    assert found[live.worker_id].worker.entry == live
    assert found[live.worker_id].worker.entry.version == "1.2.3"
    # The count is exact; the ids are the first ones, in id order.
    assert found[live.worker_id].held == len(many)
    assert found[live.worker_id].held_ids == tuple(sorted(many)[:HELD_IDS_LISTED])
    assert (found[idle.worker_id].held, found[idle.worker_id].held_ids) == (0, ())
    # A dead worker keeps its runs until the reaper takes them back: the view says so.
    assert (found[dead.worker_id].held, set(found[dead.worker_id].held_ids)) == (2, set(dead_runs))
    assert found[live.worker_id].last_seen_age_s < TTL_S
    assert found[live.worker_id].worker.started_at <= found[live.worker_id].worker.last_seen_at
    # Live ones come first.
    order = [w.worker.entry.worker_id for w in await repo.listing()]
    assert order.index(dead.worker_id) > max(
        order.index(live.worker_id), order.index(idle.worker_id)
    )

    # A run that leaves ``running`` is no longer held.
    async with db.transaction() as conn:
        await conn.execute(
            update(runs)
            .where(runs.c.id == many[0])
            .values(status=RunStatus.SUCCEEDED.value, lease_owner=None, lease_expires_at=None)
        )
    assert (await listed(repo, live))[live.worker_id].held == len(many) - 1
    for item in (live, idle, dead):
        await repo.leave(item.worker_id)


async def test_one_worker_with_every_run_it_holds(db: DatabaseManager, tenants: Tenants) -> None:
    repo = WorkersRepo(db)
    tenant = await tenants.new()
    lane = unique("lane")
    worker, other = entry({lane: 3}, ["alpha"]), entry({lane: 3}, ["alpha"])
    await repo.beat(worker, TTL_S)
    await repo.beat(other, TTL_S)
    mine = await add_runs(db, tenant, lane, 3, workflow="alpha")
    await hold(db, worker.worker_id, mine)
    await hold(db, other.worker_id, await add_runs(db, tenant, lane, 1, workflow="alpha"))

    found = await repo.get(worker.worker_id)
    assert found is not None
    view, held = found
    assert (view.worker.entry, view.alive, view.held) == (worker, True, 3)
    assert [run.run_id for run in held] == sorted(mine)
    assert {(run.tenant_id, run.workflow, run.lane, run.attempt) for run in held} == {
        (tenant, "alpha", lane, 1)
    }
    assert all(run.started_at is not None and run.lease_expires_at is not None for run in held)
    assert await repo.get(unique("worker")) is None
    await repo.leave(worker.worker_id)
    await repo.leave(other.worker_id)


async def test_a_dead_row_is_kept_a_day_then_pruned_by_any_beat(db: DatabaseManager) -> None:
    repo = WorkersRepo(db)
    recent = entry({"lane": 1}, None)
    ancient = entry({"lane": 1}, None)
    beating = entry({"lane": 1}, None)
    await repo.beat(recent, -60.0)
    await repo.beat(ancient, -60.0)
    async with db.transaction() as conn:  # it died a day ago (a beat would prune itself)
        await conn.execute(
            update(workers)
            .where(workers.c.id == ancient.worker_id)
            .values(expires_at=db.backend.now(plus_s=-PRUNE_AFTER_S - 60.0))
        )
    assert set(await listed(repo, recent, ancient)) == {recent.worker_id, ancient.worker_id}
    await repo.beat(beating, TTL_S)
    found = await listed(repo, recent, ancient, beating)
    assert set(found) == {recent.worker_id, beating.worker_id}
    assert found[recent.worker_id].alive is False
    # A worker that comes back (a pause past the TTL) is live again on its next beat.
    await repo.beat(recent, TTL_S)
    assert (await listed(repo, recent))[recent.worker_id].alive is True
    for item in (recent, beating):
        await repo.leave(item.worker_id)
