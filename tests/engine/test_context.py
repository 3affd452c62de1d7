"""The workflow Context on every backend: steps, events, permissions, messages, cancellation.

Runs are claimed for real (``QueueRepo.claim_batch``) and executed by direct runner calls; a
reclaim is simulated by putting the run back to ``queued`` and claiming it again, which fences
the earlier attempt out exactly as the reaper would.
"""

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Any

import pytest
from sqlalchemy import update

from moorline import Cancelled, Context, Decision, Moorline
from moorline.db.manager import DatabaseManager
from moorline.db.repos.events import EventsRepo
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.queue import Claim, QueueRepo
from moorline.db.repos.records import Interrupt
from moorline.db.repos.steps import StepMismatch, StepsRepo
from moorline.db.schema import runs
from moorline.dispatch.retry import RetryPolicy
from moorline.engine.context import NotInStep
from moorline.engine.runner import WorkflowRunner
from moorline.errors import CancelRequested, LeaseLost
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.settings import Settings
from moorline.types import JSONObject, JSONValue, RunId, StepStatus
from moorline.worker.worker import Worker
from tests.contract.queue_helpers import (
    NO_CAP,
    Tenants,
    add_runs,
    event_types,
    no_caps,
    requeue_all,
    statuses,
    unique,
)
from tests.contract.statements import data_statements
from tests.helpers import wait_for

Workflow = Callable[..., Any]


class WatchedStore(InMemoryRuntimeStore):
    """The in-memory store, counting the waits for a decision that have begun."""

    def __init__(self) -> None:
        super().__init__()
        self.interrupt_waits = 0

    async def wait_interrupt(
        self, run_id: RunId, interrupt_id: str, timeout_s: float
    ) -> JSONObject | None:
        self.interrupt_waits += 1
        return await super().wait_interrupt(run_id, interrupt_id, timeout_s)


class Harness:
    """One tenant, one lane, an app to register workflows on, and claims by hand."""

    def __init__(self, db: DatabaseManager, settings: Settings, tenants: Tenants) -> None:
        self.db = db
        self.tenants = tenants
        self.app = Moorline(settings)
        self.store = WatchedStore()
        self.runner = WorkflowRunner(self.app, db=db, store=self.store, settings=settings)
        self.lane = unique("lane")
        self.queue = QueueRepo(db)
        self.interrupts = InterruptsRepo(db)

    async def new_run(self, workflow: str) -> RunId:
        [run_id] = await add_runs(self.db, await self.tenants.new(), self.lane, 1)
        async with self.db.transaction() as conn:
            await conn.execute(update(runs).where(runs.c.id == run_id).values(workflow=workflow))
        return run_id

    async def claim(self) -> Claim:
        [claim] = await self.queue.claim_batch(
            self.lane, unique("owner"), limit=1, lease_ttl_s=30.0, tenant_caps=NO_CAP
        )
        return claim

    async def reclaim(self) -> Claim:
        """Take the run from its current attempt and claim it again (attempt + 1)."""
        await requeue_all(self.db, self.tenants.created[-1])
        return await self.claim()

    async def pending(self, run_id: RunId) -> Interrupt:
        async def one() -> list[Interrupt]:
            return await self.interrupts.pending_for_run(run_id)

        [interrupt] = await wait_for(one, message="a pending interrupt")
        return interrupt

    async def decide(self, run_id: RunId, approved: bool, data: dict[str, JSONValue]) -> None:
        interrupt = await self.pending(run_id)
        reason = "approved" if approved else "denied"
        await self.interrupts.resolve(
            run_id, interrupt.interrupt_id, approved=approved, reason=reason, data=data
        )
        await self.store.resolve_interrupt(
            run_id, interrupt.interrupt_id, {"approved": approved, "reason": reason}
        )


@pytest.fixture
async def harness(db: DatabaseManager, settings: Settings) -> AsyncIterator[Harness]:
    tenants = Tenants(db)
    made = Harness(db, settings, tenants)
    yield made
    await made.store.close()
    await tenants.purge()


async def test_a_finished_step_is_not_rerun_after_a_reclaim(harness: Harness) -> None:
    calls: list[str] = []
    keys: list[str] = []

    def fetch(n: int) -> dict[str, int]:
        calls.append("fetch")
        return {"n": n * 2}

    @harness.app.workflow("two_steps")
    async def two_steps(ctx: Context) -> JSONValue:
        first = await ctx.step("fetch", fetch, 21)

        async def post() -> str:
            keys.append(ctx.idempotency_key())
            if ctx.attempt == 1:
                raise ConnectionError("the worker died mid-call")
            return "posted"

        second = await ctx.step("post", post)
        return {"first": first, "second": second}

    run_id = await harness.new_run("two_steps")
    with pytest.raises(ConnectionError):
        await harness.runner.run(await harness.claim())
    output = await harness.runner.run(await harness.reclaim())
    assert output == {"first": {"n": 42}, "second": "posted"}
    assert calls == ["fetch"]
    assert keys == [f"{run_id}:post", f"{run_id}:post"]


async def test_a_replay_that_calls_differently_fails_as_non_deterministic(
    harness: Harness,
) -> None:
    def double(n: int) -> int:
        return n * 2

    @harness.app.workflow("drifting")
    async def drifting(ctx: Context) -> JSONValue:
        result = await ctx.step("double", double, ctx.attempt)
        if ctx.attempt == 1:
            raise ConnectionError("crash after the step")
        return result

    await harness.new_run("drifting")
    with pytest.raises(ConnectionError):
        await harness.runner.run(await harness.claim())
    with pytest.raises(StepMismatch, match="non-deterministic") as caught:
        await harness.runner.run(await harness.reclaim())
    assert not RetryPolicy().is_retryable(caught.value)


async def test_a_sync_step_runs_in_a_thread_while_the_loop_keeps_going(
    harness: Harness,
) -> None:
    entered, release = threading.Event(), threading.Event()
    seen_keys: list[str] = []

    @harness.app.workflow("blocking")
    async def blocking(ctx: Context) -> JSONValue:
        def block() -> str:
            seen_keys.append(ctx.idempotency_key())
            entered.set()
            return "released" if release.wait(10) else "timed out"

        return await ctx.step("block", block)

    run_id = await harness.new_run("blocking")
    task = asyncio.create_task(harness.runner.run(await harness.claim()))

    async def is_entered() -> bool:
        return entered.is_set()

    # This loop is free while the step blocks in its thread: wait_for can poll.
    await wait_for(is_entered, message="the sync step to start")
    assert not task.done()
    release.set()
    assert await asyncio.wait_for(task, 10) == "released"
    assert seen_keys == [f"{run_id}:block"]


async def test_a_step_is_retried_with_backoff_within_the_attempt(harness: Harness) -> None:
    tries: list[int] = []

    def flaky() -> str:
        tries.append(1)
        if len(tries) < 3:
            raise TimeoutError("provider busy")
        return "ok"

    def broken() -> str:
        raise ValueError("never works")

    @harness.app.workflow("flaky")
    async def flaky_workflow(ctx: Context) -> JSONValue:
        first = await ctx.step("flaky", flaky, retries=2, backoff=0.01)
        return [first, await ctx.step("broken", broken, retries=1, backoff=0.0)]

    await harness.new_run("flaky")
    with pytest.raises(ValueError, match="never works"):
        await harness.runner.run(await harness.claim())
    assert len(tries) == 3


async def test_idempotency_key_outside_a_step_is_an_error(harness: Harness) -> None:
    @harness.app.workflow("no_step")
    async def no_step(ctx: Context) -> JSONValue:
        return ctx.idempotency_key()

    await harness.new_run("no_step")
    with pytest.raises(NotInStep, match="only available inside a step"):
        await harness.runner.run(await harness.claim())


async def test_a_step_result_must_be_json(harness: Harness) -> None:
    @harness.app.workflow("not_json")
    async def not_json(ctx: Context) -> JSONValue:
        return await ctx.step("set", lambda: {1, 2})

    await harness.new_run("not_json")
    with pytest.raises(TypeError, match="JSON-serialisable"):
        await harness.runner.run(await harness.claim())


async def test_emit_writes_events_in_order_and_nothing_after_the_lease_is_lost(
    harness: Harness,
) -> None:
    gate = asyncio.Event()

    @harness.app.workflow("emitter")
    async def emitter(ctx: Context) -> JSONValue:
        for i in range(3):
            await ctx.emit("delta", {"i": i})
        await gate.wait()
        await ctx.emit("late", {})
        return "unreachable"

    run_id = await harness.new_run("emitter")
    subscription = await harness.store.subscribe_events(run_id)
    task = asyncio.create_task(harness.runner.run(await harness.claim()))
    events = EventsRepo(harness.db)

    async def deltas() -> bool:
        return sum(e.type == "delta" for e in await events.list(run_id)) == 3

    await wait_for(deltas, message="three delta events")
    await requeue_all(harness.db, harness.tenants.created[-1])
    gate.set()
    with pytest.raises(LeaseLost):
        await asyncio.wait_for(task, 10)
    stored = await events.list(run_id)
    assert [(e.type, e.data) for e in stored] == [("started", {})] + [
        ("delta", {"i": i}) for i in range(3)
    ]
    live = [await asyncio.wait_for(anext(subscription), 5) for _ in range(3)]
    assert [(e["seq"], e["data"]) for e in live] == [(2, {"i": 0}), (3, {"i": 1}), (4, {"i": 2})]
    await subscription.close()


async def test_a_workflows_except_exception_around_a_step_cannot_swallow_a_lost_lease(
    harness: Harness,
) -> None:
    gate = asyncio.Event()
    swallowed: list[BaseException] = []
    after: list[str] = []

    async def work() -> JSONValue:
        return "done"

    @harness.app.workflow("swallower")
    async def swallower(ctx: Context) -> JSONValue:
        await gate.wait()
        try:
            await ctx.step("work", work)
        except Exception as exc:  # what user code may write: it must not see the stop
            swallowed.append(exc)
        after.append("went on")
        return "swallowed"

    await harness.new_run("swallower")
    task = asyncio.create_task(harness.runner.run(await harness.claim()))
    await harness.reclaim()
    gate.set()
    with pytest.raises(LeaseLost):
        await asyncio.wait_for(task, 10)
    assert swallowed == []
    assert after == []


def test_the_attempt_stops_are_not_exceptions() -> None:
    # A workflow's ``except Exception`` lets them through, as it does asyncio.CancelledError.
    for stop in (LeaseLost, CancelRequested, Cancelled):
        assert issubclass(stop, BaseException)
        assert not issubclass(stop, Exception)


def permission_workflow(harness: Harness, timeout: float | None = 10.0) -> list[Decision]:
    decisions: list[Decision] = []

    @harness.app.workflow("ask")
    async def ask(ctx: Context) -> JSONValue:
        decision = await ctx.request_permission("post_comment", {"pr": 7}, timeout=timeout)
        decisions.append(decision)
        if ctx.attempt == 1 and decision.approved:
            raise ConnectionError("crash after the decision")
        return asdict(decision)

    return decisions


@pytest.mark.parametrize("approved", [True, False])
async def test_request_permission_returns_the_persons_decision(
    harness: Harness, approved: bool
) -> None:
    permission_workflow(harness)
    run_id = await harness.new_run("ask")
    task = asyncio.create_task(harness.runner.run(await harness.claim()))
    await harness.decide(run_id, approved, {"note": "ok" if approved else "no"})
    if approved:
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(task, 10)
        # The replay finds the same interrupt and its recorded decision, without waiting.
        output = await asyncio.wait_for(harness.runner.run(await harness.reclaim()), 5)
        assert output == {"approved": True, "reason": "approved", "data": {"note": "ok"}}
    else:
        output = await asyncio.wait_for(task, 10)
        assert output == {"approved": False, "reason": "denied", "data": {"note": "no"}}
    assert await harness.interrupts.pending_for_run(run_id) == []


async def test_a_decision_signalled_through_the_store_is_read_once_from_the_database(
    harness: Harness,
) -> None:
    permission_workflow(harness)
    run_id = await harness.new_run("ask")
    task = asyncio.create_task(harness.runner.run(await harness.claim()))
    interrupt = await harness.pending(run_id)

    # Past its first read of the database, which would find a decision stored before.
    async def waiting_in_the_store() -> bool:
        return harness.store.interrupt_waits > 0

    await wait_for(waiting_in_the_store, message="the workflow waiting in the store")
    await harness.interrupts.resolve(
        run_id, interrupt.interrupt_id, approved=False, reason="denied", data=None
    )
    with data_statements(harness.db, "interrupts") as sent:
        await harness.store.resolve_interrupt(
            run_id, interrupt.interrupt_id, {"approved": False, "reason": "denied"}
        )
        output = await asyncio.wait_for(task, 10)
    assert output == {"approved": False, "reason": "denied", "data": None}
    assert [statement.split()[0].upper() for statement in sent] == ["SELECT"]


async def test_request_permission_times_out_as_a_persisted_denial(harness: Harness) -> None:
    permission_workflow(harness, timeout=0.3)
    run_id = await harness.new_run("ask")
    output = await asyncio.wait_for(harness.runner.run(await harness.claim()), 10)
    assert output == {"approved": False, "reason": "timeout", "data": None}
    # The replay gets the same decision from the database.
    replayed = await asyncio.wait_for(harness.runner.run(await harness.reclaim()), 5)
    assert replayed == output
    assert await harness.interrupts.pending_for_run(run_id) == []


async def test_a_cancel_ends_a_permission_wait_and_stops_the_run(harness: Harness) -> None:
    decisions = permission_workflow(harness)
    run_id = await harness.new_run("ask")
    task = asyncio.create_task(harness.runner.run(await harness.claim()))
    await harness.pending(run_id)
    await harness.store.request_cancel(run_id)
    with pytest.raises(Cancelled):
        await asyncio.wait_for(task, 10)
    assert decisions == [Decision(approved=False, reason="cancelled", data=None)]


async def test_a_store_shutdown_ends_a_permission_wait(harness: Harness) -> None:
    permission_workflow(harness)
    run_id = await harness.new_run("ask")
    task = asyncio.create_task(harness.runner.run(await harness.claim()))
    await harness.pending(run_id)
    await harness.store.shutdown()
    output = await asyncio.wait_for(task, 10)
    assert output == {"approved": False, "reason": "shutdown", "data": None}


async def test_a_cancel_raises_cancelled_at_the_next_step(harness: Harness) -> None:
    gate = asyncio.Event()
    ran: list[str] = []
    seen: list[bool] = []

    @harness.app.workflow("cancellable")
    async def cancellable(ctx: Context) -> JSONValue:
        await ctx.step("one", ran.append, "one")
        await gate.wait()
        try:
            await ctx.step("two", ran.append, "two")
        except Exception:  # Cancelled is no Exception: this must not catch it
            seen.append(False)
        except Cancelled:
            seen.append(ctx.cancelled)
            raise
        return "unreachable"

    run_id = await harness.new_run("cancellable")
    task = asyncio.create_task(harness.runner.run(await harness.claim()))

    async def one_ran() -> bool:
        return ran == ["one"]

    await wait_for(one_ran, message="the first step")
    await harness.store.request_cancel(run_id)
    gate.set()
    with pytest.raises(Cancelled):
        await asyncio.wait_for(task, 10)
    assert ran == ["one"]
    assert seen == [True]


@pytest.mark.parametrize("step_start_after", [0.0, 0.05])
async def test_a_worker_writes_nothing_for_an_attempt_that_lost_its_lease(
    harness: Harness, settings: Settings, step_start_after: float
) -> None:
    gate = asyncio.Event()
    ran: list[str] = []

    @harness.app.workflow("stolen")
    async def stolen(ctx: Context) -> JSONValue:
        await ctx.step("one", ran.append, "one")
        await gate.wait()
        await ctx.step("two", ran.append, "two")
        return ctx.attempt

    run_id = await harness.new_run("stolen")
    deferring = settings.model_copy(update={"step_start_after": step_start_after})
    runner = WorkflowRunner(harness.app, db=harness.db, store=harness.store, settings=deferring)
    worker = Worker(
        harness.db,
        runner,
        lanes={harness.lane: 1},
        lease_ttl_s=30.0,
        tenant_caps=no_caps,
        poll_interval_s=0.05,
    )
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    try:

        async def one_recorded() -> bool:
            # Its checkpoint committed, not only its function run: a requeue in between would
            # leave attempt 1 no step to record, and attempt 2 would rightly run it again.
            step = await StepsRepo(harness.db).get(run_id, "one")
            return ran == ["one"] and step is not None and step.status is StepStatus.SUCCEEDED

        await wait_for(one_recorded, message="the first step's checkpoint")
        # Taken from attempt 1 (as by the reaper); the worker's only slot is still busy.
        await requeue_all(harness.db, harness.tenants.created[-1])
        gate.set()

        async def finished() -> bool:
            return (await statuses(harness.db, [run_id]))[run_id][0] == "succeeded"

        await wait_for(finished, message="the second attempt to succeed")
    finally:
        stop.set()
        await asyncio.wait_for(running, 10)
    # Attempt 1 stopped at its next step without an outcome; attempt 2 replayed step one.
    # Step two's start written first, attempt 1 never called its function. Deferred, it may
    # have (the worker's own clock still vouched for a lease taken from it early, as no reaper
    # would) and recorded nothing: the record found the fence gone. Whether it did depends on
    # whether the attempt's own event flush found the fence gone first.
    if step_start_after == 0:
        assert ran == ["one", "two"]
    else:
        assert ran in (["one", "two"], ["one", "two", "two"])
    two = await StepsRepo(harness.db).get(run_id, "two")
    assert two is not None and (two.status, two.attempt) == (StepStatus.SUCCEEDED, 2)
    types = await event_types(harness.db, run_id)
    # Attempt 1's progress events of step one may have been written before it lost the run
    # (by their timer); nothing after that.
    assert [t for t in types if not t.startswith("step_")] == ["started", "started", "succeeded"]
    assert types[-3:] == ["step_started", "step_finished", "succeeded"]  # step two
