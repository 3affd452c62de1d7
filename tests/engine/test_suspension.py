"""Durable suspension through a real Worker: waits that park the run and free its slot.

A permission request, a sleep or a message wait longer than ``park_after`` parks the run
(``waiting``: no lease, no slot); a decision, a message or the timer sweep re-queues it, and the
replay returns at the same call without re-running the steps before it.
"""

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
from sqlalchemy import select, update

from moorline import Context
from moorline.db.manager import DatabaseManager
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.records import Interrupt, InterruptStatus
from moorline.db.schema import runs
from moorline.runtime.base import RuntimeStore
from moorline.types import RunId, RunStatus
from tests.contract.queue_helpers import Tenants
from tests.engine.harness import EngineHarness
from tests.helpers import wait_for

PARK_AFTER_S = 0.1
SLEEP_S = 2.0
"""A wait long enough to park (twenty times ``PARK_AFTER_S``), short enough to pass in a test.

A wait whose deadline passes before the park commits ends in memory instead; a loaded machine
has been seen to take most of a second over the writes between the two.
"""


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


@pytest.fixture
def engine(db: DatabaseManager, store: RuntimeStore, tenants: Tenants) -> EngineHarness:
    return EngineHarness(db, store, tenants, park_after_s=PARK_AFTER_S)


async def make_due(db: DatabaseManager, run_id: RunId) -> None:
    """Move the run's timer into the past, as time passing would."""
    async with db.transaction() as conn:
        past = datetime(2000, 1, 1, tzinfo=UTC)
        await conn.execute(update(runs).where(runs.c.id == run_id).values(wake_at=past))


async def test_a_slow_approval_parks_the_run_frees_its_slot_and_resumes_on_the_decision(
    engine: EngineHarness,
) -> None:
    calls: list[str] = []

    def side_effect(name: str) -> str:
        calls.append(name)
        return name

    @engine.app.workflow("approve")
    async def approve(ctx: Context) -> dict[str, object]:
        await ctx.step("before", side_effect, "before")
        decision = await ctx.request_permission("ship", {"n": 1}, timeout=60)
        await ctx.step("after", side_effect, "after")
        return {"approved": decision.approved, "data": decision.data}

    @engine.app.workflow("echo")
    async def echo(ctx: Context) -> str:
        return "echo"

    parked = await engine.new_run("approve")
    async with engine.worker(slots=1) as worker:
        await engine.until_status(parked, RunStatus.WAITING)
        described = await engine.waiting_for(parked)
        assert described["kind"] == "permission"
        assert described["interrupt_id"]
        # The only slot is free: another run of the lane runs while the first one waits.
        other = await engine.new_run("echo")
        await engine.until_status(other, RunStatus.SUCCEEDED)

        async def slot_free() -> bool:
            return worker.in_flight == 0  # released just after the outcome's commit

        await wait_for(slot_free, message="the slot to be released")
        await InterruptsRepo(engine.db).resolve(
            parked,
            str(described["interrupt_id"]),
            approved=True,
            reason="approved",
            data={"edited": True},
        )
        await engine.until_status(parked, RunStatus.SUCCEEDED)
    run = await engine.runs.get(parked)
    assert run is not None
    assert run.output == {"approved": True, "data": {"edited": True}}
    assert run.resumes == 1 and run.waiting_for is None
    assert calls == ["before", "after"]  # nothing ran twice
    types = [event.type for event in await engine.stored(parked)]
    assert types.index("waiting") < types.index("resumed") < len(types) - 1
    assert types[-1] == "succeeded"


async def test_a_long_sleep_parks_and_the_timer_sweep_resumes_it_once_due(
    engine: EngineHarness,
) -> None:
    calls: list[str] = []

    @engine.app.workflow("nap")
    async def nap(ctx: Context) -> str:
        await ctx.step("before", calls.append, "before")
        await ctx.sleep(SLEEP_S)
        return "rested"

    run_id = await engine.new_run("nap")
    timers = engine.timer_sweep()
    async with engine.worker(slots=1):
        await engine.until_status(run_id, RunStatus.WAITING)
        assert (await engine.waiting_for(run_id))["kind"] == "sleep"
        assert await timers.tick() == []  # not due yet: nothing moves
        [moved] = await wait_for(timers.tick, message="the sleep's timer to be due")
        assert moved.run_id == run_id and moved.status is RunStatus.QUEUED
        await engine.until_status(run_id, RunStatus.SUCCEEDED)
    assert calls == ["before"]


async def test_a_short_sleep_stays_in_memory(engine: EngineHarness) -> None:
    @engine.app.workflow("doze")
    async def doze(ctx: Context) -> str:
        await ctx.sleep(PARK_AFTER_S / 2)
        return "done"

    run_id = await engine.new_run("doze")
    async with engine.worker(slots=1):
        await engine.until_status(run_id, RunStatus.SUCCEEDED)
    assert [e for e in await engine.stored(run_id) if e.type == "waiting"] == []


async def test_a_message_wait_parks_and_a_posted_message_resumes_it(
    engine: EngineHarness,
) -> None:
    @engine.app.workflow("listen")
    async def listen(ctx: Context) -> list[str | None]:
        first = await ctx.wait_for_message()
        second = await ctx.wait_for_message(timeout=SLEEP_S)
        return [first, second]

    run_id = await engine.new_run("listen")
    timers = engine.timer_sweep()
    async with engine.worker(slots=1):
        await engine.until_status(run_id, RunStatus.WAITING)
        assert engine.tenant is not None
        await engine.inbox.post_message(engine.tenant, run_id, "hello")
        # Re-queued by the post, claimed, replayed to the second wait, parked again.

        async def parked_again() -> bool:
            run = await engine.runs.get(run_id)
            return run is not None and run.status is RunStatus.WAITING and run.resumes == 1

        await wait_for(parked_again, message="the second wait to park")
        await wait_for(timers.tick, message="the message wait's timeout")
        await engine.until_status(run_id, RunStatus.SUCCEEDED)
    run = await engine.runs.get(run_id)
    assert run is not None and run.output == ["hello", None]


async def test_a_permission_that_expires_while_parked_is_denied_by_the_sweep(
    engine: EngineHarness,
) -> None:
    @engine.app.workflow("expire")
    async def expire(ctx: Context) -> str:
        decision = await ctx.request_permission("ship", {}, timeout=3600)
        return decision.reason

    run_id = await engine.new_run("expire")
    timers = engine.timer_sweep()
    async with engine.worker(slots=1):
        await engine.until_status(run_id, RunStatus.WAITING)
        await make_due(engine.db, run_id)
        assert len(await timers.tick()) == 1
        await engine.until_status(run_id, RunStatus.SUCCEEDED)
    run = await engine.runs.get(run_id)
    assert run is not None and run.output == "timeout"


async def test_a_waiting_run_past_its_deadline_ends_timed_out(engine: EngineHarness) -> None:
    @engine.app.workflow("late", deadline=3600)
    async def late(ctx: Context) -> str:
        await ctx.wait_for_message()
        return "never"

    run_id = await engine.new_run("late")
    async with engine.worker(slots=1):
        await engine.until_status(run_id, RunStatus.WAITING)
    run = await engine.runs.get(run_id)
    assert run is not None and run.deadline_at is not None and run.wake_at == run.deadline_at
    async with engine.db.transaction() as conn:
        past = datetime(2000, 1, 1, tzinfo=UTC)
        await conn.execute(
            update(runs).where(runs.c.id == run_id).values(wake_at=past, deadline_at=past)
        )
    [moved] = await engine.timer_sweep().tick()
    assert moved.status is RunStatus.TIMED_OUT
    assert await engine.status(run_id) is RunStatus.TIMED_OUT


async def test_cancelling_a_waiting_run_ends_it_at_once_and_closes_its_interrupt(
    engine: EngineHarness,
) -> None:
    @engine.app.workflow("held")
    async def held(ctx: Context) -> str:
        await ctx.request_permission("ship", {}, timeout=3600)
        return "never"

    run_id = await engine.new_run("held")
    async with engine.worker(slots=1):
        await engine.until_status(run_id, RunStatus.WAITING)
    assert engine.tenant is not None
    # No worker lives now: the cancel alone ends the run.
    cancelled = await engine.runs.request_cancel(engine.tenant, run_id)
    assert cancelled.status is RunStatus.CANCELLED
    interrupts = InterruptsRepo(engine.db)
    described = await engine.waiting_for_or_none(run_id)
    assert described is None
    [closed] = [
        i
        for i in await interrupts_of(engine, run_id)
        if i.status is InterruptStatus.DENIED and i.reason is not None
    ]
    assert closed.reason is not None and closed.reason.value == "cancelled"
    assert await interrupts.pending_for_run(run_id) == []


async def interrupts_of(engine: EngineHarness, run_id: RunId) -> list[Interrupt]:
    from moorline.db.schema import interrupts

    repo = InterruptsRepo(engine.db)
    async with engine.db.connect() as conn:
        ids = (
            await conn.execute(select(interrupts.c.id).where(interrupts.c.run_id == run_id))
        ).scalars()
        found = [await repo.get(i) for i in ids]
    return [i for i in found if i is not None]


async def test_a_waiting_run_holds_no_cap_unit(engine: EngineHarness) -> None:
    """A tenant capped at 1 with a waiting run still runs another run."""

    async def cap_one() -> dict[str, int]:
        return {"free": 1, "team": 1, "pro": 1, "enterprise": 1, "sandbox": 1}

    @engine.app.workflow("held")
    async def held(ctx: Context) -> str:
        await ctx.request_permission("ship", {}, timeout=3600)
        return "never"

    @engine.app.workflow("echo")
    async def echo(ctx: Context) -> str:
        return "echo"

    waiting = [await engine.new_run("held") for _ in range(3)]
    async with engine.worker(slots=2, tenant_caps=cap_one):
        for run_id in waiting:
            await engine.until_status(run_id, RunStatus.WAITING)
        other = await engine.new_run("echo")
        await asyncio.wait_for(engine.until_status(other, RunStatus.SUCCEEDED), 20)


async def test_emits_before_a_park_are_not_written_again_by_the_replay(
    engine: EngineHarness,
) -> None:
    @engine.app.workflow("chatty")
    async def chatty(ctx: Context) -> str:
        await ctx.emit("note", {"n": 1})
        await ctx.emit("delta", {"text": "before "})
        await ctx.sleep(SLEEP_S)
        await ctx.emit("note", {"n": 2})
        return "done"

    run_id = await engine.new_run("chatty")
    timers = engine.timer_sweep()
    async with engine.worker(slots=1):
        await engine.until_status(run_id, RunStatus.WAITING)
        await wait_for(timers.tick, message="the sleep's timer to be due")
        await engine.until_status(run_id, RunStatus.SUCCEEDED)
    notes = [e.data for e in await engine.stored(run_id, "note")]
    assert notes == [{"n": 1}, {"n": 2}]
    assert len(await engine.stored(run_id, "delta")) == 1
