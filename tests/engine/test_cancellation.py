"""Cancellation and time limits through a real Worker, on every backend and its runtime store.

The embedded backend (SQLite) runs with the in-memory store, the server databases with Redis,
as deployed. Cancels go through ``cancel_run`` (database first, then the store's signal), or
through ``RunsRepo.request_cancel`` alone to play a lost signal, which the heartbeat must make
up for.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from moorline import Cancelled, Context, Decision, Moorline, SoftTimeLimitExceeded
from moorline.db.manager import DatabaseManager
from moorline.db.repos.events import EventsRepo
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.records import DecisionReason, Interrupt, Run
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.db.repos.steps import StepsRepo
from moorline.dispatch.cancel import cancel_run
from moorline.engine.events import PROGRESS_EVENT_TYPES
from moorline.engine.inbox import Inbox
from moorline.engine.runner import WorkflowRunner
from moorline.runtime.base import RuntimeStore
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.settings import Settings
from moorline.types import JSONValue, RunId, RunStatus, TenantId
from moorline.worker.worker import Worker
from tests.conftest import CAPABILITIES
from tests.contract.queue_helpers import Tenants, event_types, no_caps, unique
from tests.helpers import until_interactive, wait_for
from tests.runtime.conftest import delete_keys, keys_without_ttl, make_redis_store
from tests.servers import require_server, unique_name

LONG_GRACE_S = 30.0
"""A grace no test waits out: a run that ends before it was stopped by its own check."""

HEARTBEAT_TTL_S = 3.0
"""Lease TTL of the heartbeat test: a renewal (and a cancel report) every second. At 1.5 s a
CI machine loaded by the suite once left a renewal late enough that the attempt fenced
itself off, and the run then waited for the reaper instead of ending by its cancel."""

FOREVER_S = 3600.0


@pytest.fixture
async def store(backend: str) -> AsyncIterator[RuntimeStore]:
    """The embedded database's in-memory store, or Redis (a fresh prefix) for a server one."""
    if "embedded" in CAPABILITIES[backend]:
        memory = InMemoryRuntimeStore()
        yield memory
        await memory.close()
        return
    require_server("redis")
    prefix = unique_name("mo_test")
    redis = make_redis_store(prefix)
    try:
        yield redis
    finally:
        client = redis.client
        try:
            assert await keys_without_ttl(client, prefix) == []
            await delete_keys(client, prefix)
        finally:
            await redis.close()


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


class Bench:
    """An app to register workflows on, a tenant and a lane, and a worker serving them."""

    def __init__(
        self, db: DatabaseManager, store: RuntimeStore, settings: Settings, tenant: TenantId
    ) -> None:
        self.db = db
        self.store = store
        self.settings = settings
        self.tenant = tenant
        self.app = Moorline(settings)
        self.lane = unique("lane")
        self.runs = RunsRepo(db)
        self.steps = StepsRepo(db)

    async def submit(self, workflow: str, **changes: Any) -> RunId:
        new = NewRun(tenant_id=self.tenant, workflow=workflow, input={}, lane=self.lane, **changes)
        [run] = await self.runs.submit_many([new])
        return run.run_id

    def worker(self, *, cancel_grace_s: float = LONG_GRACE_S, lease_ttl_s: float = 30.0) -> Worker:
        settings = self.settings.model_copy(update={"cancel_grace": cancel_grace_s})
        runner = WorkflowRunner(self.app, db=self.db, store=self.store, settings=settings)
        return Worker(
            self.db,
            runner,
            lanes={self.lane: 4},
            lease_ttl_s=lease_ttl_s,
            tenant_caps=no_caps,
            poll_interval_s=0.05,
        )

    async def finished(self, run_id: RunId, timeout_s: float = 15.0) -> Run:
        async def ended() -> Run | None:
            run = await self.runs.get(run_id)
            return run if run is not None and run.status.is_terminal else None

        run = await wait_for(ended, timeout_s=timeout_s, message=f"run {run_id} to end")
        assert run is not None
        return run

    async def step_keys(self, run_id: RunId) -> list[tuple[str, str]]:
        return [(s.key, s.status.value) for s in await self.steps.list(run_id)]


@pytest.fixture
async def bench(
    db: DatabaseManager, store: RuntimeStore, settings: Settings, tenants: Tenants
) -> Bench:
    return Bench(db, store, settings, await tenants.new())


class Serving:
    """A Worker running in this loop until the block ends."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Worker:
        self.task = asyncio.create_task(self.worker.run(self.stop))
        return self.worker

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        assert self.task is not None
        await asyncio.wait_for(self.task, 30)


def note(seen: list[str]) -> Callable[[str], str]:
    def record(key: str) -> str:
        seen.append(key)
        return key

    return record


async def test_a_run_cancelled_mid_step_ends_cancelled_and_its_next_step_never_starts(
    bench: Bench,
) -> None:
    ran: list[str] = []
    in_step, gate = asyncio.Event(), asyncio.Event()
    seen: list[bool] = []

    async def slow() -> str:
        in_step.set()
        await gate.wait()
        ran.append("two")
        return "two"

    @bench.app.workflow("three_steps")
    async def three_steps(ctx: Context) -> JSONValue:
        await ctx.step("one", note(ran), "one")
        await ctx.step("two", slow)
        try:
            await ctx.step("three", note(ran), "three")
        except Cancelled:
            seen.append(ctx.cancelled)
            raise
        return "unreachable"

    run_id = await bench.submit("three_steps")
    async with Serving(bench.worker()):
        await asyncio.wait_for(in_step.wait(), 10)
        requested = await cancel_run(bench.runs, bench.store, bench.tenant, run_id)
        assert requested.status is RunStatus.RUNNING
        assert requested.cancel_requested_at is not None
        released = time.monotonic()
        gate.set()
        run = await bench.finished(run_id)
    assert run.status is RunStatus.CANCELLED
    assert time.monotonic() - released < LONG_GRACE_S / 3  # its own check, not the grace
    assert ran == ["one", "two"]
    assert seen == [True]
    # The step in flight kept its result; the next one never started.
    assert await bench.step_keys(run_id) == [("one", "succeeded"), ("two", "succeeded")]
    # Step progress events are buffered and may or may not be written before the outcome.
    written = [t for t in await event_types(bench.db, run_id) if t not in PROGRESS_EVENT_TYPES]
    assert written == ["queued", "started", "cancelled"]
    assert run.cancel_requested_at == requested.cancel_requested_at


async def test_a_message_drain_after_the_cancel_raises_cancelled(bench: Bench) -> None:
    drained: list[list[str]] = []
    started, posted = asyncio.Event(), asyncio.Event()
    first_drained, gate = asyncio.Event(), asyncio.Event()

    @bench.app.workflow("chat")
    async def chat(ctx: Context) -> JSONValue:
        started.set()
        await posted.wait()
        drained.append(await ctx.drain_messages())
        first_drained.set()
        await gate.wait()
        drained.append(await ctx.drain_messages())
        return "unreachable"

    run_id = await bench.submit("chat")
    assert bench.tenant is not None
    inbox = Inbox(bench.db, bench.store)
    async with Serving(bench.worker()):
        await asyncio.wait_for(started.wait(), 10)
        await until_interactive(bench.store, run_id, run_id)
        await inbox.post_message(bench.tenant, run_id, "hello")
        posted.set()
        await asyncio.wait_for(first_drained.wait(), 10)
        await cancel_run(bench.runs, bench.store, bench.tenant, run_id)
        await inbox.post_message(bench.tenant, run_id, "too late")
        gate.set()
        run = await bench.finished(run_id)
    assert run.status is RunStatus.CANCELLED
    assert drained == [["hello"]]
    # The drain refused: what came after the cancel stays undelivered.
    listed = await inbox.list_messages(bench.tenant, run_id)
    assert [(m.content, m.delivered_attempt) for m in listed] == [("hello", 1), ("too late", None)]


async def test_a_cancel_whose_signal_is_lost_lands_with_the_next_heartbeat(bench: Bench) -> None:
    decisions: list[Decision] = []
    ran: list[str] = []

    @bench.app.workflow("asks")
    async def asks(ctx: Context) -> JSONValue:
        await ctx.step("before", note(ran), "before")
        decisions.append(await ctx.request_permission("deploy", {"to": "prod"}, timeout=60))
        await ctx.step("after", note(ran), "after")
        return "unreachable"

    run_id = await bench.submit("asks")
    interrupts = InterruptsRepo(bench.db)
    async with Serving(bench.worker(lease_ttl_s=HEARTBEAT_TTL_S)):

        async def asking() -> list[Interrupt]:
            return await interrupts.pending_for_run(run_id)

        [pending] = await wait_for(asking, message="the permission request")
        # Recorded in the database only: the store never hears of it.
        await bench.runs.request_cancel(bench.tenant, run_id)
        assert not await bench.store.is_cancelled(run_id)
        asked = time.monotonic()
        run = await bench.finished(run_id)
    assert run.status is RunStatus.CANCELLED
    assert time.monotonic() - asked < LONG_GRACE_S / 3  # a heartbeat, not the grace
    assert decisions == [Decision(approved=False, reason="cancelled", data=None)]
    assert ran == ["before"]
    assert await bench.step_keys(run_id) == [("before", "succeeded")]
    interrupt = await interrupts.get(pending.interrupt_id)
    assert interrupt is not None and interrupt.reason is DecisionReason.CANCELLED


async def test_a_workflow_that_never_checks_is_cancelled_after_the_grace(bench: Bench) -> None:
    grace_s = 0.5
    asleep = asyncio.Event()
    probe: list[str] = []

    @bench.app.workflow("sleeper")
    async def sleeper(ctx: Context) -> JSONValue:
        await ctx.step("one", note(probe), "one")
        asleep.set()
        try:
            await asyncio.sleep(FOREVER_S)
        except asyncio.CancelledError:
            probe.append("cancelled")
            raise
        await ctx.step("never", note(probe), "never")
        return "unreachable"

    run_id = await bench.submit("sleeper")
    async with Serving(bench.worker(cancel_grace_s=grace_s)):
        await asyncio.wait_for(asleep.wait(), 10)
        cancelled_at = time.monotonic()
        await cancel_run(bench.runs, bench.store, bench.tenant, run_id)
        run = await bench.finished(run_id)
        took_s = time.monotonic() - cancelled_at
    assert run.status is RunStatus.CANCELLED
    assert grace_s <= took_s < grace_s + 5
    assert probe == ["one", "cancelled"]
    assert await bench.step_keys(run_id) == [("one", "succeeded")]
    assert await event_types(bench.db, run_id) == [
        "queued",
        "started",
        "step_started",
        "step_finished",
        "cancelled",
    ]


async def test_a_cancel_that_arrives_as_the_workflow_returns_keeps_its_output(
    bench: Bench,
) -> None:
    """The workflow's code has returned; the cancel lands before the outcome is written."""
    seen_by_runner = asyncio.Event()

    @bench.app.workflow("returning")
    async def returning(ctx: Context) -> JSONValue:
        await ctx.step("effect", note([]), "done")  # the side effect, checkpointed
        await cancel_run(bench.runs, bench.store, bench.tenant, ctx.run_id)
        # Until the runner has marked the attempt cancelled (the store's signal or the
        # heartbeat), without the workflow asking: it returns knowing nothing of the cancel.
        await wait_for(lambda: is_marked(ctx), message="the runner to see the cancel")
        seen_by_runner.set()
        return {"effect": "done"}

    run_id = await bench.submit("returning")
    async with Serving(bench.worker()):
        run = await bench.finished(run_id)
    assert seen_by_runner.is_set()
    assert (run.status, run.output) == (RunStatus.SUCCEEDED, {"effect": "done"})
    assert run.cancel_requested_at is not None  # the request is kept, and answered
    assert await event_types(bench.db, run_id) == [
        "queued",
        "started",
        "step_started",
        "step_finished",
        "succeeded",
    ]


async def is_marked(ctx: Context) -> bool:
    # The attempt's own flag, read without telling the workflow (ctx.cancelled would).
    marked: bool = ctx._is_cancelled
    return marked


async def test_a_workflow_told_of_the_cancel_ends_cancelled_even_if_it_returns(
    bench: Bench,
) -> None:
    @bench.app.workflow("stubborn")
    async def stubborn(ctx: Context) -> JSONValue:
        await cancel_run(bench.runs, bench.store, bench.tenant, ctx.run_id)
        try:
            await ctx.step("next", note([]), "next")
        except Cancelled:
            return "ignored the cancel"  # told, and returned anyway
        return "unreachable"

    run_id = await bench.submit("stubborn")
    async with Serving(bench.worker()):
        run = await bench.finished(run_id)
    assert (run.status, run.output) == (RunStatus.CANCELLED, None)


async def test_the_hard_limit_ends_runs_timed_out_without_a_retry(bench: Bench) -> None:
    @bench.app.workflow("limited", timeout=0.3, max_attempts=3)
    async def limited(ctx: Context) -> JSONValue:
        await asyncio.sleep(FOREVER_S)
        return "unreachable"

    @bench.app.workflow("unlimited", max_attempts=3)
    async def unlimited(ctx: Context) -> JSONValue:
        await asyncio.sleep(FOREVER_S)
        return "unreachable"

    by_workflow = await bench.submit("limited")
    by_run = await bench.submit("unlimited", timeout_s=0.3)  # the run's own limit wins
    started = time.monotonic()
    async with Serving(bench.worker()):
        runs = [await bench.finished(run_id) for run_id in (by_workflow, by_run)]
    assert time.monotonic() - started < 10
    for run in runs:
        assert (run.status, run.attempt) == (RunStatus.TIMED_OUT, 1)
        assert isinstance(run.error, dict)
        assert (run.error["type"], run.error["reason"]) == ("TimeLimitExceeded", "timeout")
        assert run.error["message"] == "the attempt ran past its time limit of 0.3s"
        assert await event_types(bench.db, run.run_id) == ["queued", "started", "timed_out"]


async def test_a_caught_soft_limit_succeeds_and_an_escaped_one_fails_without_a_retry(
    bench: Bench,
) -> None:
    cleaned: list[str] = []

    @bench.app.workflow("tidy", soft_timeout=0.2, timeout=30)
    async def tidy(ctx: Context) -> JSONValue:
        try:
            await asyncio.sleep(FOREVER_S)
        except SoftTimeLimitExceeded:
            # The workflow goes on normally: it can still checkpoint its cleanup.
            return await ctx.step("cleanup", note(cleaned), "cleanup")
        return "unreachable"

    @bench.app.workflow("untidy", soft_timeout=0.2, timeout=30, max_attempts=3)
    async def untidy(ctx: Context) -> JSONValue:
        await asyncio.sleep(FOREVER_S)
        return "unreachable"

    caught, escaped = await bench.submit("tidy"), await bench.submit("untidy")
    async with Serving(bench.worker()):
        succeeded = await bench.finished(caught)
        failed = await bench.finished(escaped)
    assert (succeeded.status, succeeded.output) == (RunStatus.SUCCEEDED, "cleanup")
    assert cleaned == ["cleanup"]
    assert (failed.status, failed.attempt) == (RunStatus.FAILED, 1)
    assert isinstance(failed.error, dict)
    assert (failed.error["type"], failed.error["reason"]) == (
        "SoftTimeLimitExceeded",
        "non-retryable",
    )
    stored = await EventsRepo(bench.db).list(escaped)
    assert [e.type for e in stored] == ["queued", "started", "failed"]
