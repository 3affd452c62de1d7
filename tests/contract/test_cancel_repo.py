"""Cancellation in the database, on every backend: ``RunsRepo.request_cancel`` per status, and
what a recorded cancel does to every other transition (steps, interrupts, heartbeats, finishes,
release, claims, the reaper). Also the stops ``cancelled`` and ``timed_out`` as outcomes.
"""

import asyncio
import random
from collections import Counter
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import select, update

from moorline.db.manager import DatabaseManager
from moorline.db.repos.events import EventsRepo
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.queue import Claim, QueueRepo
from moorline.db.repos.records import Run
from moorline.db.repos.runs import Failed, NewRun, Outcome, RunsRepo, Stopped, Succeeded
from moorline.db.repos.steps import CancelRequested, LeaseLost, StepsRepo
from moorline.db.schema import runs, steps
from moorline.errors import RunFinished, RunNotFound
from moorline.types import JSONObject, RunId, RunStatus, TenantId
from tests.contract.queue_helpers import NO_CAP, Tenants, event_types, set_lease_expiry, unique

TTL_S = 30.0
CALL = "0" * 64


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


class Setup:
    """One tenant, one lane, and the repositories a cancel touches."""

    def __init__(self, db: DatabaseManager, tenant: TenantId) -> None:
        self.db = db
        self.tenant = tenant
        self.lane = unique("lane")
        self.runs = RunsRepo(db)
        self.queue = QueueRepo(db)
        self.steps = StepsRepo(db)

    async def submit(self, count: int = 1) -> list[RunId]:
        new = [
            NewRun(tenant_id=self.tenant, workflow="noop", input={"i": i}, lane=self.lane)
            for i in range(count)
        ]
        return [run.run_id for run in await self.runs.submit_many(new)]

    async def claim(self, limit: int = 1) -> list[Claim]:
        return await self.queue.claim_batch(
            self.lane, unique("owner"), limit=limit, lease_ttl_s=TTL_S, tenant_caps=NO_CAP
        )

    async def running(self) -> Claim:
        await self.submit()
        [claim] = await self.claim()
        return claim

    async def get(self, run_id: RunId) -> Run:
        run = await self.runs.get(run_id)
        assert run is not None
        return run


@pytest.fixture
async def setup(db: DatabaseManager, tenants: Tenants) -> Setup:
    return Setup(db, await tenants.new())


async def test_a_queued_run_ends_cancelled_at_once_and_is_never_claimed(setup: Setup) -> None:
    [run_id] = await setup.submit()
    returned = await setup.runs.request_cancel(setup.tenant, run_id)
    stored = await setup.get(run_id)
    assert returned == stored
    assert stored.status is RunStatus.CANCELLED
    assert stored.cancel_requested_at is not None
    assert stored.finished_at == stored.cancel_requested_at
    assert stored.elapsed_time is None  # it never started
    assert await event_types(setup.db, run_id) == ["queued", "cancelled"]
    [cancelled] = [e for e in await EventsRepo(setup.db).list(run_id) if e.type == "cancelled"]
    assert cancelled.data == {"reason": "cancelled"}
    assert await setup.claim() == []


async def test_a_pending_run_ends_cancelled_at_once_and_is_never_enqueued(setup: Setup) -> None:
    [pending] = await setup.runs.insert_pending(
        [NewRun(tenant_id=setup.tenant, workflow="noop", input={}, lane=setup.lane)]
    )
    cancelled = await setup.runs.request_cancel(setup.tenant, pending.run_id)
    assert cancelled.status is RunStatus.CANCELLED
    assert await setup.runs.enqueue([pending.run_id]) == []
    assert (await setup.get(pending.run_id)).status is RunStatus.CANCELLED


async def test_a_running_run_keeps_running_with_its_request_recorded(setup: Setup) -> None:
    claim = await setup.running()
    run_id = claim.fence.run_id
    first = await setup.runs.request_cancel(setup.tenant, run_id)
    assert first.status is RunStatus.RUNNING
    assert first.lease_owner == claim.fence.owner
    assert first.cancel_requested_at is not None
    assert await setup.get(run_id) == first
    # Asking again changes nothing: the request keeps its first time.
    again = await setup.runs.request_cancel(setup.tenant, run_id)
    assert again.cancel_requested_at == first.cancel_requested_at
    assert await event_types(setup.db, run_id) == ["queued", "started"]
    # The heartbeat keeps the lease and reports the request to the worker.
    renewal = await setup.queue.renew_leases([claim.fence], TTL_S)
    assert renewal.renewed == {(run_id, claim.fence.attempt)}
    assert renewal.cancel_requested == {run_id}


async def test_a_heartbeat_reports_only_the_runs_with_a_request(setup: Setup) -> None:
    await setup.submit(3)
    claims = await setup.claim(limit=3)
    asked = claims[1].fence.run_id
    await setup.runs.request_cancel(setup.tenant, asked)
    renewal = await setup.queue.renew_leases([c.fence for c in claims], TTL_S)
    assert len(renewal.renewed) == 3
    assert renewal.cancel_requested == {asked}


async def test_a_finished_run_refuses_with_run_finished(setup: Setup) -> None:
    for status in (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.TIMED_OUT, RunStatus.CANCELLED):
        claim = await setup.running()
        outcomes: dict[RunStatus, Outcome] = {
            RunStatus.SUCCEEDED: Succeeded(fence=claim.fence, output=1),
            RunStatus.FAILED: Failed(fence=claim.fence, error={"m": "x"}, retry_delay_s=None),
            RunStatus.TIMED_OUT: Stopped(fence=claim.fence, status=RunStatus.TIMED_OUT),
            RunStatus.CANCELLED: Stopped(fence=claim.fence, status=RunStatus.CANCELLED),
        }
        assert await setup.runs.finish_many([outcomes[status]]) == [True]
        before = await setup.get(claim.fence.run_id)
        with pytest.raises(RunFinished, match=f"already ended {status.value}") as refused:
            await setup.runs.request_cancel(setup.tenant, claim.fence.run_id)
        assert (refused.value.code, refused.value.status) == ("run_finished", 409)
        assert await setup.get(claim.fence.run_id) == before


async def test_a_rate_limited_run_refuses_with_run_finished(setup: Setup) -> None:
    [pending] = await setup.runs.insert_pending(
        [NewRun(tenant_id=setup.tenant, workflow="noop", input={}, lane=setup.lane)]
    )
    assert await setup.runs.mark_rate_limited(pending.run_id, {"reason": "quota"})
    with pytest.raises(RunFinished):
        await setup.runs.request_cancel(setup.tenant, pending.run_id)


async def test_another_tenants_run_is_not_found_and_unchanged(
    setup: Setup, tenants: Tenants
) -> None:
    [run_id] = await setup.submit()
    stranger = await tenants.new()
    with pytest.raises(RunNotFound) as refused:
        await setup.runs.request_cancel(stranger, run_id)
    assert refused.value.code == "run_not_found"
    with pytest.raises(RunNotFound):
        await setup.runs.request_cancel(setup.tenant, RunId("no-such-run"))
    assert (await setup.get(run_id)).status is RunStatus.QUEUED


async def test_no_step_or_interrupt_starts_after_the_request_but_a_running_step_finishes(
    setup: Setup,
) -> None:
    claim = await setup.running()
    fence = claim.fence
    await setup.steps.start(fence, "in-flight", "f", CALL)
    await setup.runs.request_cancel(setup.tenant, fence.run_id)
    with pytest.raises(CancelRequested):
        await setup.steps.start(fence, "next", "f", CALL)
    with pytest.raises(CancelRequested):
        await setup.steps.insert_new(fence, "next", "f", CALL)
    with pytest.raises(CancelRequested):
        await InterruptsRepo(setup.db).open(fence, "permission:1", "deploy", {}, 60.0)
    # The step that was running records its result: nothing is thrown away.
    await setup.steps.succeed(fence, "in-flight", {"kept": True})
    recorded = await setup.steps.list(fence.run_id)
    assert [(s.key, s.status.value, s.output) for s in recorded] == [
        ("in-flight", "succeeded", {"kept": True})
    ]
    assert await InterruptsRepo(setup.db).pending_for_run(fence.run_id) == []
    # A stale fence is still reported as a lost lease, not as a cancel.
    await setup.queue.release(fence)
    with pytest.raises(LeaseLost):
        await setup.steps.start(fence, "next", "f", CALL)
    with pytest.raises(LeaseLost):
        await setup.steps.insert_new(fence, "next", "f", CALL)


@pytest.mark.parametrize("how", ["start", "insert_new"])
async def test_steps_that_started_are_dated_before_the_request(setup: Setup, how: str) -> None:
    """Step starts racing a cancel: each one either committed before it or was refused.

    Both ways a step starts: ``start`` (lock, read, insert) and the engine's one-statement
    ``insert_new``.
    """
    claim = await setup.running()
    fence = claim.fence
    refused: list[str] = []
    halfway = asyncio.Event()
    begin = setup.steps.start if how == "start" else setup.steps.insert_new

    async def start_steps() -> None:
        for i in range(1000):
            try:
                await begin(fence, f"s{i}", "f", CALL)
            except CancelRequested:
                refused.append(f"s{i}")
                return
            if i == 10:
                halfway.set()

    starter = asyncio.create_task(start_steps())
    await halfway.wait()
    run = await setup.runs.request_cancel(setup.tenant, fence.run_id)
    await asyncio.wait_for(starter, 30)
    assert refused, "the starter ran through without meeting the cancel"
    requested_at = run.cancel_requested_at
    assert requested_at is not None
    started = [s.started_at for s in await setup.steps.list(fence.run_id)]
    assert len(started) > 10
    assert max(started) <= requested_at


async def test_a_returned_workflows_success_wins_over_a_request(setup: Setup) -> None:
    # The code ran to its end, every side effect done: its output is the truth.
    claim = await setup.running()
    requested = await setup.runs.request_cancel(setup.tenant, claim.fence.run_id)
    done = Succeeded(fence=claim.fence, output={"done": True})
    assert await setup.runs.finish_many([done]) == [True]
    stored = await setup.get(claim.fence.run_id)
    assert (stored.status, stored.output) == (RunStatus.SUCCEEDED, {"done": True})
    assert stored.cancel_requested_at == requested.cancel_requested_at
    assert await event_types(setup.db, claim.fence.run_id) == ["queued", "started", "succeeded"]
    with pytest.raises(RunFinished):
        await setup.runs.request_cancel(setup.tenant, claim.fence.run_id)


async def test_any_other_outcome_of_a_run_with_a_request_ends_it_cancelled(setup: Setup) -> None:
    for outcome in ("retrying", "failed", "timed_out"):
        claim = await setup.running()
        fence = claim.fence
        requested = await setup.runs.request_cancel(setup.tenant, fence.run_id)
        error: JSONObject = {"message": "x"}
        written: dict[str, Outcome] = {
            "retrying": Failed(fence=fence, error=error, retry_delay_s=0.0),
            "failed": Failed(fence=fence, error=error, retry_delay_s=None),
            "timed_out": Stopped(fence=fence, status=RunStatus.TIMED_OUT, error=error),
        }
        assert await setup.runs.finish_many([written[outcome]]) == [True], outcome
        stored = await setup.get(fence.run_id)
        assert stored.status is RunStatus.CANCELLED, outcome
        assert stored.output is None
        assert stored.cancel_requested_at == requested.cancel_requested_at
        assert stored.lease_owner is None
        assert stored.finished_at is not None and stored.elapsed_time is not None
        assert await event_types(setup.db, fence.run_id) == ["queued", "started", "cancelled"]
    assert await setup.claim() == []


async def test_a_stop_seen_only_through_the_store_is_dated_when_written(setup: Setup) -> None:
    claim = await setup.running()
    stop = Stopped(fence=claim.fence, status=RunStatus.CANCELLED)
    assert await setup.runs.finish_many([stop]) == [True]
    stored = await setup.get(claim.fence.run_id)
    assert stored.status is RunStatus.CANCELLED
    assert stored.cancel_requested_at == stored.finished_at
    # The fence is spent: writing the stop again applies nothing.
    assert await setup.runs.finish_many([stop]) == [False]


async def test_a_hard_time_limit_ends_the_run_timed_out_with_its_error(setup: Setup) -> None:
    claim = await setup.running()
    error: JSONObject = {"type": "TimeLimitExceeded", "message": "late", "reason": "timeout"}
    stop = Stopped(fence=claim.fence, status=RunStatus.TIMED_OUT, error=error)
    assert await setup.runs.finish_many([stop]) == [True]
    stored = await setup.get(claim.fence.run_id)
    assert (stored.status, stored.error, stored.cancel_requested_at) == (
        RunStatus.TIMED_OUT,
        error,
        None,
    )
    events = await EventsRepo(setup.db).list(claim.fence.run_id)
    assert [(e.type, e.data) for e in events][-1] == ("timed_out", error)
    with pytest.raises(ValueError, match="cancelled or timed_out"):
        Stopped(fence=claim.fence, status=RunStatus.FAILED)


async def test_release_at_shutdown_ends_a_run_with_a_request_cancelled(setup: Setup) -> None:
    asked = await setup.submit(2)
    claims = await setup.claim(limit=2)
    by_id = {c.fence.run_id: c for c in claims}
    cancel_me, kept = by_id[asked[0]], by_id[asked[1]]
    await setup.runs.request_cancel(setup.tenant, cancel_me.fence.run_id)
    assert await setup.queue.release(cancel_me.fence)
    assert await setup.queue.release(kept.fence)
    assert (await setup.get(cancel_me.fence.run_id)).status is RunStatus.CANCELLED
    assert (await setup.get(kept.fence.run_id)).status is RunStatus.QUEUED
    assert (await event_types(setup.db, cancel_me.fence.run_id))[-1] == "cancelled"
    assert (await event_types(setup.db, kept.fence.run_id))[-1] == "released"
    # Only the run without a request comes back.
    [again] = await setup.claim(limit=2)
    assert again.fence.run_id == kept.fence.run_id


async def test_the_reaper_ends_an_expired_run_with_a_request_cancelled(setup: Setup) -> None:
    claim = await setup.running()
    await setup.runs.request_cancel(setup.tenant, claim.fence.run_id)
    await set_lease_expiry(setup.db, [claim.fence.run_id], -5.0)
    [reaped] = await setup.queue.reap_expired()
    assert reaped.status is RunStatus.CANCELLED
    assert (await setup.get(claim.fence.run_id)).status is RunStatus.CANCELLED
    assert await setup.claim() == []


async def test_claims_never_take_a_queued_run_with_a_request(setup: Setup) -> None:
    """Belt and braces: no transition leaves such a row, and claims would skip one anyway."""
    asked, free = await setup.submit(2)
    now = (await setup.get(asked)).created_at
    async with setup.db.transaction() as conn:
        await conn.execute(update(runs).where(runs.c.id == asked).values(cancel_requested_at=now))
    [claim] = await setup.claim(limit=2)
    assert claim.fence.run_id == free
    async with setup.db.connect() as conn:
        status = (await conn.execute(select(runs.c.status).where(runs.c.id == asked))).scalar()
    assert status == RunStatus.QUEUED.value


async def test_concurrent_requests_record_one_cancel(setup: Setup) -> None:
    run_ids = await setup.submit(20)
    claims = await setup.claim(limit=10)
    results = await asyncio.gather(
        *(setup.runs.request_cancel(setup.tenant, run_id) for run_id in run_ids for _ in (1, 2)),
        return_exceptions=True,
    )
    # Queued runs: one request cancels, the other finds it finished (in either order).
    running = {c.fence.run_id for c in claims}
    for run_id, pair in zip(run_ids, zip(results[::2], results[1::2], strict=True), strict=True):
        kinds = sorted(type(result).__name__ for result in pair)
        if run_id in running:
            assert kinds == ["Run", "Run"], pair
            first, second = pair
            assert isinstance(first, Run) and isinstance(second, Run)
            assert first.cancel_requested_at == second.cancel_requested_at
        else:
            assert kinds == ["Run", "RunFinished"], pair
    async with setup.db.connect() as conn:
        rows = await conn.execute(
            select(steps.c.run_id).where(steps.c.run_id.in_(run_ids))  # none started
        )
        assert rows.first() is None
    for run_id in run_ids:
        cancelled = (await event_types(setup.db, run_id)).count("cancelled")
        assert cancelled == (0 if run_id in running else 1)


LATE_CANCEL_RACES = 1_000
RACES_AT_ONCE = 50


async def test_a_cancel_racing_a_success_never_erases_it(setup: Setup) -> None:
    """The workflow has returned; its success and a cancel race 1,000 times: success stands."""
    rng = random.Random(20261128)
    order: Counter[str] = Counter()
    for _ in range(LATE_CANCEL_RACES // RACES_AT_ONCE):
        await setup.submit(RACES_AT_ONCE)
        claims = await setup.claim(limit=RACES_AT_ONCE)
        assert len(claims) == RACES_AT_ONCE

        async def race(claim: Claim) -> None:
            run_id = claim.fence.run_id
            done = Succeeded(fence=claim.fence, output={"run": run_id})

            async def cancel() -> str:
                try:
                    await setup.runs.request_cancel(setup.tenant, run_id)
                except RunFinished:
                    return "refused"
                return "requested"

            async def finish() -> str:
                assert await setup.runs.finish_many([done]) == [True]
                return "finished"

            first, second = (cancel, finish) if rng.random() < 0.5 else (finish, cancel)
            answers = await asyncio.gather(first(), second())
            order["cancel " + next(a for a in answers if a != "finished")] += 1

        await asyncio.gather(*(race(claim) for claim in claims))
        for claim in claims:
            stored = await setup.get(claim.fence.run_id)
            assert stored.status is RunStatus.SUCCEEDED, stored
            assert stored.output == {"run": claim.fence.run_id}
    assert sum(order.values()) == LATE_CANCEL_RACES
    assert order["cancel requested"] > 0 and order["cancel refused"] > 0, order
