"""Served workflows on every backend: claims filter on them; unserved queued runs are counted.

Issue 15, item 1: workers claimed by lane whatever the workflow, so in a rolling deploy a worker
whose app lacked a workflow claimed its runs and failed them for good.
"""

from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import event

from moorline.db.manager import DatabaseManager
from moorline.db.repos.queue import Claim, QueueRepo
from moorline.db.repos.workers import WorkerEntry, WorkersRepo
from tests.contract.queue_helpers import (
    NO_CAP,
    WIDE_OPEN,
    Tenants,
    add_runs,
    statuses,
    unique,
)

TTL_S = 30.0


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


def ids(claims: list[Claim]) -> list[str]:
    return [claim.run.run_id for claim in claims]


def entry(lanes: dict[str, int], workflows: list[str] | None) -> WorkerEntry:
    return WorkerEntry(
        worker_id=unique("worker"), host="host", pid=1, lanes=lanes, workflows=workflows
    )


async def test_a_claim_takes_only_the_workflows_it_serves(
    db: DatabaseManager, tenants: Tenants
) -> None:
    queue = QueueRepo(db)
    mixed, other_only = await tenants.new(), await tenants.new()
    lane = unique("lane")
    # The unserved runs come first in claim order (higher priority, older).
    beta = await add_runs(db, mixed, lane, 3, priority=100, workflow="beta")
    alpha = await add_runs(db, mixed, lane, 2, workflow="alpha")
    beta += await add_runs(db, other_only, lane, 2, workflow="beta")

    async def claim(workflows: list[str]) -> list[Claim]:
        """Claims until one finds nothing (a batch may stop at one tenant's runs)."""
        claimed: list[Claim] = []
        for _ in range(10):
            batch = await queue.claim_batch(
                lane, "w", limit=10, lease_ttl_s=TTL_S, tenant_caps=NO_CAP, workflows=workflows
            )
            if not batch:
                break
            claimed += batch
        return claimed

    assert await claim([]) == []
    assert sorted(ids(await claim(["alpha", "gamma"]))) == sorted(alpha)
    assert {status for status, _ in (await statuses(db, beta)).values()} == {"queued"}
    assert await claim(["alpha"]) == []
    assert sorted(ids(await claim(["beta"]))) == sorted(beta)


async def test_many_served_workflows_and_tenants_still_claim_everything(
    db: DatabaseManager, tenants: Tenants
) -> None:
    """A large app binds many names per claim read: the reads are cut to fit the drivers."""
    queue = QueueRepo(db)
    lane = unique("lane")
    wanted = []
    for _ in range(30):
        wanted += await add_runs(db, await tenants.new(), lane, 1, workflow="alpha")
    served = ["alpha", *(f"filler_{index}" for index in range(2000))]
    # Each tenant's cap is one: the allotment spreads the batch over all thirty.
    claimed = await queue.claim_batch(
        lane, "w", limit=30, lease_ttl_s=TTL_S, tenant_caps={WIDE_OPEN: 1}, workflows=served
    )
    assert sorted(ids(claimed)) == sorted(wanted)


async def test_live_workers_are_listed_until_they_leave_or_expire(db: DatabaseManager) -> None:
    repo = WorkersRepo(db)
    staying = entry({"lane_a": 2}, ["alpha"])
    leaving = entry({"lane_a": 1}, None)
    expired = entry({"lane_a": 1}, ["beta"])
    await repo.beat(staying, TTL_S)
    await repo.beat(staying, TTL_S)  # a renewal, not a second row
    await repo.beat(leaving, TTL_S)
    await repo.beat(expired, -1.0)
    live = {worker.entry.worker_id: worker for worker in await repo.live()}
    assert staying.worker_id in live and leaving.worker_id in live
    assert expired.worker_id not in live
    assert live[staying.worker_id].entry == staying
    assert live[staying.worker_id].serves("lane_a", "alpha")
    assert not live[staying.worker_id].serves("lane_a", "beta")
    assert not live[staying.worker_id].serves("lane_b", "alpha")
    assert live[leaving.worker_id].serves("lane_a", "anything")
    assert await repo.leave(leaving.worker_id)
    assert not await repo.leave(leaving.worker_id)
    assert leaving.worker_id not in {worker.entry.worker_id for worker in await repo.live()}
    await repo.leave(staying.worker_id)


async def test_queued_runs_no_live_worker_serves_are_unserved(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = WorkersRepo(db)
    tenant = await tenants.new()
    lane, other_lane = unique("lane"), unique("lane")
    await add_runs(db, tenant, lane, 2, workflow="alpha")
    await add_runs(db, tenant, lane, 3, workflow="beta")
    await add_runs(db, tenant, other_lane, 1, workflow="alpha")

    def mine(found: dict[tuple[str, str], int]) -> dict[tuple[str, str], int]:
        return {key: n for key, n in found.items() if key[0] in (lane, other_lane)}

    # No worker at all: every queued run is unserved.
    assert mine(await repo.unserved()) == {
        (lane, "alpha"): 2,
        (lane, "beta"): 3,
        (other_lane, "alpha"): 1,
    }
    alpha_worker = entry({lane: 4}, ["alpha"])
    await repo.beat(alpha_worker, TTL_S)
    # A dead worker's row (expired) serves nothing.
    await repo.beat(entry({lane: 4, other_lane: 1}, ["beta", "alpha"]), -1.0)
    assert mine(await repo.unserved()) == {(lane, "beta"): 3, (other_lane, "alpha"): 1}
    any_worker = entry({other_lane: 1}, None)
    await repo.beat(any_worker, TTL_S)
    assert mine(await repo.unserved()) == {(lane, "beta"): 3}
    await repo.leave(alpha_worker.worker_id)
    await repo.leave(any_worker.worker_id)


EXPLAIN = {"sqlite": "EXPLAIN QUERY PLAN ", "postgresql": "EXPLAIN ", "mysql": "EXPLAIN "}
"""How each database shows a plan (the syntax differs; what is asserted does not)."""
SORTS = ("TEMP B-TREE", "Sort", "filesort")
"""How each database says a read sorts its rows instead of walking an index in order."""


async def test_the_filtered_claim_walks_the_claim_index_without_sorting(
    db: DatabaseManager, tenants: Tenants
) -> None:
    """``workflow`` ends ``ix_runs_lane_tenant``: the filtered reads stay on it, in order."""
    lane = unique("lane")
    for _ in range(3):
        tenant = await tenants.new()
        for workflow in ("alpha", "beta", "gamma"):
            await add_runs(db, tenant, lane, 200, workflow=workflow)
    statement = db.backend.analyze_statement(("runs", "tenants"))
    async with db.engine.connect() as conn:
        await conn.exec_driver_sql(statement)
        await conn.commit()
    captured: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, sql: str, parameters: Any, *_: Any) -> None:
        if "workflow IN" in sql:
            captured.append((sql, parameters))

    engine = db.engine.sync_engine
    event.listen(engine, "before_cursor_execute", capture)
    try:
        claimed = await QueueRepo(db).claim_batch(
            lane, "w", limit=10, lease_ttl_s=TTL_S, tenant_caps=NO_CAP, workflows=["beta"]
        )
    finally:
        event.remove(engine, "before_cursor_execute", capture)
    assert len(claimed) == 10 and {claim.run.workflow for claim in claimed} == {"beta"}
    assert captured
    async with db.engine.connect() as conn:
        if db.backend.name == "postgresql":
            # A planner may prefer a scan of a table this small; the question is whether the
            # index can serve the read in order, not which of the two is cheaper at 1,800 rows.
            await conn.exec_driver_sql("SET enable_seqscan = off")
        for sql, parameters in captured:
            plan = await conn.exec_driver_sql(EXPLAIN[db.backend.name] + sql, parameters)
            text = " ".join(" ".join(str(value) for value in row) for row in plan)
            assert "ix_runs_lane_tenant" in text, text
            assert not any(sort in text for sort in SORTS), text
        await conn.rollback()
