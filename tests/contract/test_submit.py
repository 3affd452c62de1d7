"""Group commit of submissions on every backend: few transactions, each caller its own answer."""

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import event, func, select

from moorline.admission.triggers import Trigger, new_run_of
from moorline.db.manager import DatabaseManager
from moorline.db.repos.quotas import QuotaClaim, QuotasRepo
from moorline.db.repos.records import Run
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.db.schema import events, runs
from moorline.dispatch.submit import Submitter
from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.errors import ConversationBusy, IdempotencyConflict
from moorline.plans import COMMUNITY_LANE, DEFAULT_PLANS, for_edition
from moorline.settings import Edition
from moorline.types import JSONObject, RunStatus, TenantId
from tests.contract.queue_helpers import Tenants, unique

CONCURRENT = 500


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


def new_run(tenant: TenantId, lane: str, index: int, key: str | None = None) -> NewRun:
    return NewRun(
        tenant_id=tenant, workflow="noop", input={"i": index}, lane=lane, idempotency_key=key
    )


async def stored_counts(db: DatabaseManager, tenant: TenantId) -> tuple[int, int]:
    """(queued runs, queued events) of the tenant."""
    async with db.connect() as conn:
        queued = (
            await conn.execute(
                select(func.count()).where(
                    runs.c.tenant_id == tenant, runs.c.status == RunStatus.QUEUED.value
                )
            )
        ).scalar_one()
        queued_events = (
            await conn.execute(
                select(func.count())
                .select_from(events.join(runs, runs.c.id == events.c.run_id))
                .where(runs.c.tenant_id == tenant, events.c.type == "queued")
            )
        ).scalar_one()
    return queued, queued_events


async def test_concurrent_submits_share_few_transactions(
    db: DatabaseManager, tenants: Tenants
) -> None:
    tenant = await tenants.new()
    lanes = [unique("lane"), unique("lane")]
    woken: list[set[str]] = []
    submitter = Submitter(RunsRepo(db), max_batch=256, on_enqueued=woken.append)
    try:
        results = await asyncio.gather(
            *(submitter.submit(new_run(tenant, lanes[i % 2], i)) for i in range(CONCURRENT))
        )
    finally:
        await submitter.close()
    # Every caller got its own run: its own input, its own lane, a distinct id.
    assert [run.input for run in results] == [{"i": i} for i in range(CONCURRENT)]
    assert [run.lane for run in results] == [lanes[i % 2] for i in range(CONCURRENT)]
    assert len({run.run_id for run in results}) == CONCURRENT
    assert {run.status for run in results} == {RunStatus.QUEUED}
    assert await stored_counts(db, tenant) == (CONCURRENT, CONCURRENT)
    # Far fewer transactions than runs: batches of up to 256.
    assert submitter.runs_written == CONCURRENT
    assert 2 <= submitter.batches_written <= 10
    assert len(woken) == submitter.batches_written
    assert set().union(*woken) == set(lanes)


async def test_a_conflicting_key_fails_only_its_caller(
    db: DatabaseManager, tenants: Tenants
) -> None:
    tenant = await tenants.new()
    lane = unique("lane")
    repo = RunsRepo(db)
    [taken] = await repo.submit_many([new_run(tenant, lane, -1, key="taken")])
    submitter = Submitter(repo)
    try:
        results = await asyncio.gather(
            *(
                submitter.submit(new_run(tenant, lane, i, key="taken" if i == 7 else f"k{i}"))
                for i in range(20)
            ),
            return_exceptions=True,
        )
    finally:
        await submitter.close()
    conflict = results.pop(7)
    assert isinstance(conflict, IdempotencyConflict)
    stored = [result for result in results if isinstance(result, Run)]
    assert len(stored) == 19
    assert [run.idempotency_key for run in stored] == [f"k{i}" for i in range(20) if i != 7]
    got = await repo.get_many([run.run_id for run in stored])
    assert {run.status for run in got.values()} == {RunStatus.QUEUED} and len(got) == 19
    assert await repo.find_by_idempotency_key(tenant, "taken") == taken
    assert await stored_counts(db, tenant) == (20, 20)


async def test_close_writes_what_was_submitted_then_refuses(
    db: DatabaseManager, tenants: Tenants
) -> None:
    tenant = await tenants.new()
    lane = unique("lane")
    submitter = Submitter(RunsRepo(db), max_batch=4)
    # Tasks start in order: every submit is queued before close puts its stop marker.
    *results, _ = await asyncio.gather(
        *(submitter.submit(new_run(tenant, lane, i)) for i in range(10)), submitter.close()
    )
    assert [run.input for run in results if isinstance(run, Run)] == [{"i": i} for i in range(10)]
    assert submitter.batches_written >= 3  # no batch above max_batch
    with pytest.raises(RuntimeError, match="closed"):
        await submitter.submit(new_run(tenant, lane, 99))
    await submitter.close()  # closing twice is harmless
    assert await stored_counts(db, tenant) == (10, 10)


async def test_a_cancelled_caller_and_a_failing_hook_do_not_stop_the_writer(
    db: DatabaseManager, tenants: Tenants
) -> None:
    tenant = await tenants.new()
    lane = unique("lane")

    def broken_hook(lanes: set[str]) -> None:
        raise RuntimeError("hook failed")

    submitter = Submitter(RunsRepo(db), on_enqueued=broken_hook)
    gone = asyncio.create_task(submitter.submit(new_run(tenant, lane, 0)))

    async def cancel_gone() -> None:
        gone.cancel()

    try:
        # Tasks start in order: both submissions are queued, then the first caller gives up,
        # all before the writer task (created by the first submission) takes its batch.
        kept, _ = await asyncio.gather(submitter.submit(new_run(tenant, lane, 1)), cancel_gone())
        assert kept.input == {"i": 1}
        assert (await submitter.submit(new_run(tenant, lane, 2))).input == {"i": 2}
    finally:
        await submitter.close()
    assert gone.cancelled()
    # The cancelled caller's run was dropped before its batch was written.
    assert await stored_counts(db, tenant) == (2, 2)


REFUSAL: JSONObject = {"code": "quota_exceeded", "message": "used up"}


def claim(day: str, limit: int) -> QuotaClaim:
    return QuotaClaim(day=day, limit=limit, refusal=REFUSAL)


async def test_quota_claims_admit_exactly_the_limit_in_the_runs_transactions(
    db: DatabaseManager, tenants: Tenants
) -> None:
    tenant, other = await tenants.new(), await tenants.new()
    lane = unique("lane")
    woken: list[set[str]] = []
    submitter = Submitter(RunsRepo(db), max_batch=16, on_enqueued=woken.append)
    try:
        results = await asyncio.gather(
            *(
                submitter.submit(
                    new_run(tenant, lane, i, key=f"k{i}"), quota=claim("2031-01-01", 25)
                )
                for i in range(120)
            ),
            # Another tenant's claims and an unclaimed run share the batches, not the counter.
            *(
                submitter.submit(new_run(other, lane, i), quota=claim("2031-01-01", 3))
                for i in range(5)
            ),
            submitter.submit(new_run(other, lane, 99)),
        )
    finally:
        await submitter.close()
    mine, theirs, unclaimed = results[:120], results[120:125], results[125]
    # The first 25 submitted got the units (batches in order); the rest were stored refused.
    assert [run.status for run in mine] == [RunStatus.QUEUED] * 25 + [RunStatus.RATE_LIMITED] * 95
    assert [run.status for run in theirs] == [RunStatus.QUEUED] * 3 + [RunStatus.RATE_LIMITED] * 2
    assert unclaimed.status is RunStatus.QUEUED
    quotas = QuotasRepo(db)
    assert await quotas.used(tenant, "2031-01-01") == 25
    assert await quotas.used(other, "2031-01-01") == 3
    assert await stored_counts(db, tenant) == (25, 25)  # no event for a refused run
    refused = await RunsRepo(db).get_many([run.run_id for run in mine[25:]])
    for run in mine[25:]:
        assert refused[run.run_id] == run  # returned as stored
        assert run.error == REFUSAL and run.idempotency_key is None
        assert run.finished_at == run.created_at
    assert [run.idempotency_key for run in mine[:25]] == [f"k{i}" for i in range(25)]
    # Queued runs too are returned as stored (their time came with the quota's statement).
    queued = await RunsRepo(db).get_many([run.run_id for run in mine[:25]])
    assert [queued[run.run_id] for run in mine[:25]] == mine[:25]
    # Batches whose runs were all refused woke nobody.
    assert set().union(*woken) == {lane} and len(woken) < submitter.batches_written


async def test_queue_all_answers_each_run_in_order_with_its_own_error(
    db: DatabaseManager, tenants: Tenants
) -> None:
    tenant = await tenants.new()
    lane = unique("lane")
    repo = RunsRepo(db)
    await repo.submit_many([new_run(tenant, lane, -1, key="taken")])
    submitter = Submitter(repo, max_batch=64)
    try:
        queued = await submitter.queue_all(
            [
                (
                    new_run(tenant, lane, i, key="taken" if i == 100 else None),
                    claim("2031-01-02", 150),
                    None,
                )
                for i in range(200)
            ]
        )
        outcomes = await queued
    finally:
        await submitter.close()
    conflict = outcomes.pop(100)
    assert isinstance(conflict, IdempotencyConflict)
    stored = [outcome for outcome in outcomes if isinstance(outcome, Run)]
    assert [run.input for run in stored] == [{"i": i} for i in range(200) if i != 100]
    # The units went in the order given (the refused key's run took none).
    statuses = [run.status for run in stored]
    assert statuses == [RunStatus.QUEUED] * 150 + [RunStatus.RATE_LIMITED] * 49
    assert await QuotasRepo(db).used(tenant, "2031-01-02") == 150
    # Batches of 64 in the order given; the one with the taken key was retried run by run.
    assert submitter.runs_written == 199
    assert submitter.batches_written == 3 + 63
    with pytest.raises(RuntimeError, match="closed"):
        await submitter.queue_all([(new_run(tenant, lane, 0), None, None)])


async def test_concurrent_submitters_never_pass_the_quota(
    db: DatabaseManager, tenants: Tenants
) -> None:
    """Two submitters stand for two API processes: they share the counter only."""
    tenant = await tenants.new()
    lane = unique("lane")
    first, second = Submitter(RunsRepo(db), max_batch=8), Submitter(RunsRepo(db), max_batch=8)
    try:
        results = await asyncio.gather(
            *(
                (first if i % 2 else second).submit(
                    new_run(tenant, lane, i), quota=claim("2031-02-01", 40)
                )
                for i in range(150)
            )
        )
    finally:
        await first.close()
        await second.close()
    statuses = [run.status for run in results]
    assert statuses.count(RunStatus.QUEUED) == 40
    assert statuses.count(RunStatus.RATE_LIMITED) == 110
    assert await QuotasRepo(db).used(tenant, "2031-02-01") == 40
    # The day's counter existed already for the second day's first batch: a counter at its
    # limit refuses; another day starts again.
    [late] = await RunsRepo(db).submit_many(
        [new_run(tenant, lane, 0)], quotas=[claim("2031-02-01", 40)]
    )
    assert late.status is RunStatus.RATE_LIMITED
    [next_day] = await RunsRepo(db).submit_many(
        [new_run(tenant, lane, 0)], quotas=[claim("2031-02-02", 40)]
    )
    assert next_day.status is RunStatus.QUEUED
    assert await QuotasRepo(db).used(tenant, "2031-02-02") == 1


async def test_a_batch_that_fails_takes_no_unit(db: DatabaseManager, tenants: Tenants) -> None:
    tenant = await tenants.new()
    lane = unique("lane")
    repo = RunsRepo(db)
    await repo.submit_many([new_run(tenant, lane, -1, key="taken")])
    busy = NewRun(tenant_id=tenant, workflow="noop", input={}, lane=lane, conversation_id="c")
    await repo.submit_many([busy])
    for failing, error in (
        (new_run(tenant, lane, 0, key="taken"), IdempotencyConflict),
        (replace(busy, run_id=None), ConversationBusy),
    ):
        with pytest.raises(error):
            await repo.submit_many(
                [new_run(tenant, lane, 1), failing], quotas=[claim("2031-03-01", 5)] * 2
            )
    assert await QuotasRepo(db).used(tenant, "2031-03-01") == 0
    assert await stored_counts(db, tenant) == (2, 2)
    # Through the submitter, the failing run alone is refused; the others get their units.
    submitter = Submitter(repo)
    try:
        results = await asyncio.gather(
            submitter.submit(new_run(tenant, lane, 1), quota=claim("2031-03-01", 5)),
            submitter.submit(new_run(tenant, lane, 2, key="taken"), quota=claim("2031-03-01", 5)),
            submitter.submit(new_run(tenant, lane, 3), quota=claim("2031-03-01", 5)),
            return_exceptions=True,
        )
    finally:
        await submitter.close()
    assert isinstance(results[1], IdempotencyConflict)
    assert [run.status for run in (results[0], results[2]) if isinstance(run, Run)] == [
        RunStatus.QUEUED
    ] * 2
    assert await QuotasRepo(db).used(tenant, "2031-03-01") == 2


async def test_one_counters_units_and_its_runs_are_one_statement_where_they_can_be(
    db: DatabaseManager, tenants: Tenants
) -> None:
    tenant = await tenants.new()
    lane, day = unique("lane"), "2031-04-01"
    repo = RunsRepo(db)
    sent: list[str] = []

    def count(_conn: Any, _cursor: Any, sql: str, *_: Any) -> None:
        sent.append(sql)

    async def submit(count_: int, limit: int) -> list[Run]:
        sent.clear()
        batch = [new_run(tenant, lane, i) for i in range(count_)]
        event.listen(db.engine.sync_engine, "before_cursor_execute", count)
        try:
            return await repo.submit_many(batch, quotas=[claim(day, limit)] * count_)
        finally:
            event.remove(db.engine.sync_engine, "before_cursor_execute", count)

    # The day's first unit: no counter row yet, so the transaction creates it.
    [first] = await submit(1, 10)
    assert first.status is RunStatus.QUEUED
    # The counter exists and holds the units: on PostgreSQL one statement takes them and
    # stores the runs with their events.
    made = await submit(3, 10)
    assert [run.status for run in made] == [RunStatus.QUEUED] * 3
    if db.backend.capabilities.one_statement_submit:
        assert len(sent) == 1, sent
    assert await QuotasRepo(db).used(tenant, day) == 4
    # 6 left for 8 runs: the statement writes nothing, and the transaction takes what is left.
    late = await submit(8, 10)
    assert [run.status for run in late] == [RunStatus.QUEUED] * 6 + [RunStatus.RATE_LIMITED] * 2
    assert await QuotasRepo(db).used(tenant, day) == 10
    assert await stored_counts(db, tenant) == (10, 10)
    # Every path returns its runs as stored.
    returned = [first, *made, *late]
    stored = await repo.get_many([run.run_id for run in returned])
    assert [stored[run.run_id] for run in returned] == returned


def test_a_triggers_run_takes_lane_and_priority_from_the_plan() -> None:
    app = Moorline()

    @app.workflow("review_pr", max_attempts=5)
    async def review_pr(ctx: Context, pr: int) -> None:
        return None

    tenant = TenantId("t-1")
    trigger = Trigger(
        tenant_id=tenant,
        plan=DEFAULT_PLANS["team"],
        rate_identity="key",
        workflow=app.get("review_pr"),
        input={"pr": 1},
        idempotency_key="delivery-1",
        delay_s=2.0,
    )
    new = new_run_of(trigger)
    assert (new.lane, new.priority, new.max_attempts) == ("workflow_team", 50, 5)
    assert (new.tenant_id, new.workflow, new.input) == (tenant, "review_pr", {"pr": 1})
    assert (new.idempotency_key, new.delay_s) == ("delivery-1", 2.0)
    community = for_edition(DEFAULT_PLANS, Edition.COMMUNITY)
    routed = {
        name: new_run_of(replace(trigger, plan=plan)).lane for name, plan in community.items()
    }
    assert set(routed.values()) == {COMMUNITY_LANE}


async def test_a_trace_context_is_stored_with_its_run_and_read_back(
    db: DatabaseManager, tenants: Tenants
) -> None:
    # Each caller's own context, though the Submitter writes them in one batch.
    tenant, lane = await tenants.new(), unique("lane")
    contexts: list[JSONObject] = [
        {"traceparent": f"00-{i:032x}-{i + 1:016x}-01", "tracestate": f"k=v{i}"} for i in range(3)
    ]
    submitter = Submitter(RunsRepo(db), max_batch=256)
    try:
        results = await asyncio.gather(
            *(
                submitter.submit(replace(new_run(tenant, lane, i), trace_context=context))
                for i, context in enumerate([*contexts, None])
            )
        )
    finally:
        await submitter.close()
    assert [run.trace_context for run in results] == [*contexts, None]
    repo = RunsRepo(db)
    stored = [await repo.get(run.run_id) for run in results]
    assert [run.trace_context if run else "gone" for run in stored] == [*contexts, None]
