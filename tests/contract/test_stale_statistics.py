"""The hot statements keep their plans when the planner's statistics are wrong (issue 19).

A drain on PostgreSQL ran at a third of its speed on a young table: with statistics taken
when few runs were queued or running, the planner read a tenant's whole backlog through
another index and sorted it, once per claim, and found a finished batch's runs through a
status index instead of their ids. Here the statistics are made wrong on purpose: the runs
table is analysed while every run has ended (and kept from being analysed again), then
thousands of runs are queued or running.
"""

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import event, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.manager import DatabaseManager
from moorline.db.repos.claims import ClaimRequest
from moorline.db.repos.handoffs import HandoffsRepo
from moorline.db.repos.queue import QueueRepo
from moorline.db.repos.records import Fence
from moorline.db.repos.run_finishes import Succeeded
from moorline.db.repos.runs import RunsRepo
from moorline.db.schema import runs
from moorline.types import Attempt, RunId, RunStatus, TenantId
from tests.contract.queue_helpers import NO_CAP, Tenants, add_runs, unique

BACKLOG = 2_000
OWNER = "stale-stats-worker"

EXPLAIN = {"sqlite": "EXPLAIN QUERY PLAN ", "postgresql": "EXPLAIN ", "mysql": "EXPLAIN "}
SORTS = ("TEMP B-TREE", "Sort", "filesort")
"""How each database says a read sorts its rows instead of walking an index in order."""

PRIMARY_KEY = {"sqlite": "sqlite_autoindex_runs_1", "postgresql": "pk_runs", "mysql": "PRIMARY"}
"""The runs table's primary key in each database's plans."""

STATUS_INDEXES = (
    "ix_runs_lease",
    "ix_runs_status_created",
    "ix_runs_wake",
    "ix_runs_lane_tenant",
)
"""The indexes that lead with the status: a batch of runs found by id needs none of them."""


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


async def analysed_while_idle(db: DatabaseManager, tenant: TenantId, lane: str) -> None:
    """Statistics saying that no run is queued or running, kept while the test changes that.

    ``BACKLOG`` runs, all ended, are analysed; PostgreSQL's autovacuum is then kept off the
    table (this module's own database), so that it cannot refresh them mid-test.
    """
    ended = await add_runs(db, tenant, lane, BACKLOG)
    async with db.transaction() as conn:
        stmt = update(runs).where(runs.c.id.in_(ended)).values(status=RunStatus.SUCCEEDED.value)
        await conn.execute(stmt)
    async with db.engine.connect() as conn:
        await conn.exec_driver_sql(db.backend.analyze_statement(("runs",)))
        if db.backend.name == "postgresql":
            await conn.exec_driver_sql("ALTER TABLE runs SET (autovacuum_enabled = false)")
        await conn.commit()


async def started(db: DatabaseManager, run_ids: list[RunId]) -> None:
    """Mark ``run_ids`` running under ``OWNER``'s first attempt, as a claim would."""
    async with db.transaction() as conn:
        stmt = (
            update(runs)
            .where(runs.c.id.in_(run_ids))
            .values(
                status=RunStatus.RUNNING.value,
                attempt=1,
                lease_owner=OWNER,
                started_at=datetime.now(UTC),
            )
        )
        await conn.execute(stmt)


async def forget_statistics(db: DatabaseManager) -> None:
    """SQLite: no planner statistics, as in a database never analysed (the others keep theirs:
    their claim UPDATE names its rows by id alone, whatever the planner knows).

    On the connection the claims use: each SQLite connection loads the statistics once.
    """
    if db.backend.name != "sqlite":
        return
    async with db.transaction() as conn:
        named = text("SELECT count(*) FROM sqlite_master WHERE name = 'sqlite_stat1'")
        if await conn.scalar(named):
            await conn.exec_driver_sql("DELETE FROM sqlite_stat1")
        await conn.exec_driver_sql("ANALYZE sqlite_schema")  # reloads what is left: nothing


@contextmanager
def statements_on_runs(db: DatabaseManager) -> Iterator[list[tuple[str, Any]]]:
    """The reads and writes of ``runs`` sent while inside, with their parameters."""
    captured: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, sql: str, parameters: Any, *_: Any) -> None:
        if "runs" in sql and not sql.lstrip().upper().startswith(("INSERT", "SET")):
            captured.append((sql, parameters))

    engine = db.engine.sync_engine
    event.listen(engine, "before_cursor_execute", capture)
    try:
        yield captured
    finally:
        event.remove(engine, "before_cursor_execute", capture)


async def plans(
    db: DatabaseManager, conn: AsyncConnection, statements: list[tuple[str, Any]]
) -> list[str]:
    """Each statement's plan, on one line, as ``conn`` would run it now."""
    found = []
    for sql, parameters in statements:
        plan = await conn.exec_driver_sql(EXPLAIN[db.backend.name] + sql, parameters)
        found.append(" ".join(" ".join(str(value) for value in row) for row in plan))
    return found


async def test_a_claim_reads_a_backlog_in_index_order_whatever_the_statistics_say(
    db: DatabaseManager, tenants: Tenants
) -> None:
    tenant, lane = await tenants.new(), unique("lane")
    await analysed_while_idle(db, tenant, lane)
    queued = await add_runs(db, tenant, lane, BACKLOG)
    repo = QueueRepo(db)
    request = ClaimRequest(
        lane=lane, owner=OWNER, limit=8, lease_ttl_s=30.0, tenant_caps=NO_CAP, workflows=["noop"]
    )
    async with db.write_transaction() as conn:
        with statements_on_runs(db) as captured:
            batch = await repo.claim_txn(conn, request)
        # In the claim's own transaction: what it set for its reads holds for the plans.
        found = await plans(db, conn, [(sql, p) for sql, p in captured if "queued" in str(p)])
    # The first eight queued, in order: the claim did read the backlog.
    assert [claim.run.run_id for claim in batch.claims] == queued[:8]
    assert found
    for plan in found:
        assert "ix_runs_lane_tenant" in plan, plan
        assert not any(sort in plan for sort in SORTS), plan


@pytest.mark.parametrize("outcomes_apply", [True, False], ids=["ending", "stale"])
async def test_a_handoffs_claim_reads_a_backlog_in_index_order_whatever_the_statistics_say(
    db: DatabaseManager, tenants: Tenants, outcomes_apply: bool
) -> None:
    # The outcomes' lock sets the index order for the claim after it (on PostgreSQL, in place
    # of a SET LOCAL of its own): also when it finds none of their runs still running.
    tenant, lane = await tenants.new(), unique("lane")
    await analysed_while_idle(db, tenant, lane)
    running = await add_runs(db, tenant, lane, 8)
    await started(db, running)
    queued = await add_runs(db, tenant, lane, BACKLOG)
    attempt = Attempt(1 if outcomes_apply else 2)  # a later attempt's fence holds nothing
    outcomes = [
        Succeeded(fence=Fence(run_id=run_id, attempt=attempt, owner=OWNER), output=None)
        for run_id in running
    ]
    request = ClaimRequest(
        lane=lane, owner=OWNER, limit=8, lease_ttl_s=30.0, tenant_caps=NO_CAP, workflows=["noop"]
    )
    async with db.write_transaction() as conn:
        with statements_on_runs(db) as captured:
            applied, batch = await HandoffsRepo(db).finish_and_claim_txn(conn, outcomes, request)
        found = await plans(db, conn, [(sql, p) for sql, p in captured if "queued" in str(p)])
    assert applied == [outcomes_apply] * 8
    assert [claim.run.run_id for claim in batch.claims] == queued[:8]
    assert found
    for plan in found:
        assert "ix_runs_lane_tenant" in plan, plan
        assert not any(sort in plan for sort in SORTS), plan


async def test_a_claim_behind_a_backlog_finds_its_runs_by_id_with_no_statistics(
    db: DatabaseManager, tenants: Tenants
) -> None:
    # A young database has no statistics at all: SQLite's claim UPDATE then walked the lane's
    # whole backlog through ix_runs_lane_tenant, testing each entry against the ids its
    # subquery chose (a claim's cost grew with the backlog), instead of finding them by id.
    tenant, lane = await tenants.new(), unique("lane")
    await add_runs(db, tenant, lane, BACKLOG)
    await forget_statistics(db)
    request = ClaimRequest(
        lane=lane, owner=OWNER, limit=8, lease_ttl_s=30.0, tenant_caps=NO_CAP, workflows=["noop"]
    )
    async with db.write_transaction() as conn:
        with statements_on_runs(db) as captured:
            batch = await QueueRepo(db).claim_txn(conn, request)
        updates = [(sql, p) for sql, p in captured if "UPDATE runs" in sql]
        found = await plans(db, conn, updates)
    assert len(batch.claims) == 8
    assert found
    for plan in found:
        assert PRIMARY_KEY[db.backend.name] in plan, plan


async def test_a_batch_of_outcomes_finds_its_runs_by_id_whatever_the_statistics_say(
    db: DatabaseManager, tenants: Tenants
) -> None:
    tenant, lane = await tenants.new(), unique("lane")
    await analysed_while_idle(db, tenant, lane)
    running = await add_runs(db, tenant, lane, BACKLOG)
    await started(db, running)
    outcomes = [
        Succeeded(fence=Fence(run_id=run_id, attempt=Attempt(1), owner=OWNER), output=None)
        for run_id in running[:8]
    ]
    with statements_on_runs(db) as captured:
        applied = await RunsRepo(db).finish_many(outcomes)
    assert applied == [True] * 8
    async with db.engine.connect() as conn:
        found = await plans(db, conn, captured)
        await conn.rollback()
    assert found
    for plan in found:
        assert not any(index in plan for index in STATUS_INDEXES), plan
