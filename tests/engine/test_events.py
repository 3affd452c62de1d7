"""Events end to end on both stores: batched deltas, durability points, streams and cut-offs.

``delta`` events are written in batches (by size, by time, and before every checkpoint and the
outcome); a stream replays stored events after a cursor and follows live ones without a gap or
a duplicate at the seam; a subscriber that falls behind is cut off without slowing the worker
and resumes from the database.
"""

import asyncio
from collections.abc import AsyncIterator

import pytest

from moorline import Context
from moorline.db.manager import DatabaseManager
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.records import Event
from moorline.db.repos.runs import NewRun
from moorline.engine.streams import EventStream
from moorline.errors import RunNotFound
from moorline.runtime.base import RuntimeStore
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.types import JSONObject, JSONValue, RunId, RunStatus
from tests.contract.queue_helpers import Tenants
from tests.engine.harness import EngineHarness
from tests.helpers import wait_for
from tests.runtime.conftest import make_redis_store

STREAMED_DELTAS = 400
SLOW_QUEUE = 20
"""Live events a slow subscriber may fall behind by in the cut-off test."""


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


@pytest.fixture
def engine(db: DatabaseManager, store: RuntimeStore, tenants: Tenants) -> EngineHarness:
    return EngineHarness(db, store, tenants)


async def collect(stream: EventStream) -> list[Event]:
    return [event async for event in stream]


def is_contiguous(events: list[Event], first: int) -> bool:
    return [event.seq for event in events] == list(range(first, first + len(events)))


def without_duration(data: JSONValue) -> JSONValue:
    """An event's data without ``duration_ms``, which no test can predict."""
    if isinstance(data, dict):
        return {key: value for key, value in data.items() if key != "duration_ms"}
    return data


async def test_deltas_are_written_in_batches_and_before_every_checkpoint(
    db: DatabaseManager, store: RuntimeStore, tenants: Tenants
) -> None:
    # Flushes by size and at checkpoints only: the timer is far away.
    engine = EngineHarness(db, store, tenants, event_batch_size=4, event_flush_interval_s=60)
    stored_during: list[int] = []

    async def stored_deltas(run_id: RunId) -> int:
        return len(await engine.stored(run_id, "delta"))

    @engine.app.workflow("streamer")
    async def streamer(ctx: Context) -> JSONValue:
        for i in range(3):
            await ctx.emit("delta", {"i": i})
        stored_during.append(await stored_deltas(ctx.run_id))  # a part batch waits
        await ctx.emit("delta", {"i": 3})

        async def batch_written() -> int:
            return await stored_deltas(ctx.run_id)

        # A full batch is written in the background, with nothing else to trigger it.
        stored_during.append(await wait_for(batch_written, message="the full batch"))
        for i in range(4, 10):
            await ctx.emit("delta", {"i": i})
        # The step starts after the buffered deltas are stored.
        seen = await ctx.step("look", stored_deltas, ctx.run_id)
        for i in range(10, 13):
            await ctx.emit("delta", {"i": i})
        await ctx.emit("note", {"after": 13})
        for i in range(13, 15):
            await ctx.emit("delta", {"i": i})
        return seen

    run_id = await engine.new_run("streamer")
    assert await engine.runner.run(await engine.claim()) == 10
    # The last two were written before the runner returned (before any outcome).
    stored = await engine.stored(run_id)
    assert stored_during == [0, 4]
    look: JSONObject = {"key": "look", "try": 1}
    assert [(e.type, without_duration(e.data)) for e in stored] == [
        ("queued", {}),
        ("started", {}),
        *[("delta", {"i": i}) for i in range(10)],
        # Progress events keep their place among the others, though no checkpoint waits for
        # them: they were written with the next delta's batch.
        ("step_started", look),
        ("step_finished", {**look, "status": "succeeded"}),
        *[("delta", {"i": i}) for i in range(10, 13)],
        ("note", {"after": 13}),
        *[("delta", {"i": i}) for i in range(13, 15)],
    ]
    assert is_contiguous(stored, 1)
    # Events written together share their transaction's clock reading, where the clock is
    # the transaction's (PostgreSQL's now()); SQLite's and MariaDB's move per statement.
    if db.backend.name == "postgresql":
        by_seq = {event.seq: event.created_at for event in stored}
        assert len({by_seq[seq] for seq in range(3, 7)}) == 1, "deltas 0-3: one batch"
        assert len({by_seq[seq] for seq in range(13, 17)}) == 1, "deltas 10-12 and the note"


async def test_a_trickle_is_written_and_streamed_by_the_timer(engine: EngineHarness) -> None:
    gate = asyncio.Event()

    @engine.app.workflow("trickle")
    async def trickle(ctx: Context) -> JSONValue:
        await ctx.emit("delta", {"text": "Hel"})
        await gate.wait()
        return None

    run_id = await engine.new_run("trickle")
    live = await engine.store.subscribe_events(run_id)
    task = asyncio.create_task(engine.runner.run(await engine.claim()))

    async def stored() -> list[Event]:
        return await engine.stored(run_id, "delta")

    [delta] = await wait_for(stored, message="the timer to write the delta")
    received = await asyncio.wait_for(live.take(), 5)
    assert [(event["seq"], event["data"]) for event in received] == [(delta.seq, {"text": "Hel"})]
    assert not task.done(), "written while the workflow is still waiting"
    gate.set()
    await asyncio.wait_for(task, 10)
    await live.close()


async def test_a_stream_replays_stored_events_then_follows_live_ones(
    engine: EngineHarness,
) -> None:
    halfway, go = asyncio.Event(), asyncio.Event()

    @engine.app.workflow("streamer")
    async def streamer(ctx: Context) -> JSONValue:
        for i in range(STREAMED_DELTAS):
            if i == STREAMED_DELTAS // 4:
                halfway.set()
                await go.wait()
            await ctx.emit("delta", {"i": i})
            if i % 16 == 0:
                await asyncio.sleep(0)
        await ctx.emit("done", {})
        return "ok"

    run_id = await engine.new_run("streamer")
    assert engine.tenant is not None
    async with engine.worker():
        await asyncio.wait_for(halfway.wait(), 10)

        async def some_stored() -> bool:
            return len(await engine.stored(run_id, "delta")) >= 64

        await wait_for(some_stored, message="a first part of the deltas to be stored")
        whole = await engine.streams.open(engine.tenant, run_id)
        resumed = await engine.streams.open(engine.tenant, run_id, after_seq=50)
        go.set()
        streams = await asyncio.wait_for(asyncio.gather(collect(whole), collect(resumed)), 30)
    everything, after_50 = streams
    expected = ["queued", "started", *["delta"] * STREAMED_DELTAS, "done", "succeeded"]
    assert [event.type for event in everything] == expected
    assert is_contiguous(everything, 1), "no gap and no duplicate at the seam"
    assert after_50 == everything[50:]
    assert everything == await engine.stored(run_id)
    with pytest.raises(RunNotFound):
        await engine.streams.open(await engine.tenants.new(), run_id)


@pytest.fixture
def small_queue_store(store_kind: str, request: pytest.FixtureRequest) -> RuntimeStore:
    """A store whose subscribers may fall only ``SLOW_QUEUE`` events behind (the test closes it)."""
    if store_kind == "redis":
        prefix: str = request.getfixturevalue("redis_prefix")
        return make_redis_store(prefix, event_queue_size=SLOW_QUEUE)
    return InMemoryRuntimeStore(event_queue_size=SLOW_QUEUE)


async def test_a_slow_subscriber_is_cut_off_and_resumes_from_the_database(
    db: DatabaseManager, small_queue_store: RuntimeStore, tenants: Tenants
) -> None:
    store = small_queue_store
    engine = EngineHarness(db, store, tenants, event_batch_size=16)
    reading = asyncio.Event()

    @engine.app.workflow("fast")
    async def fast(ctx: Context) -> JSONValue:
        for i in range(300):
            if i == 16:
                await reading.wait()
            await ctx.emit("delta", {"i": i})
        return "done"

    run_id = await engine.new_run("fast")
    assert engine.tenant is not None
    try:
        stream = await engine.streams.open(engine.tenant, run_id)
        async with engine.worker():
            first = await asyncio.wait_for(anext(stream), 10)
            reading.set()
            # The reader now takes nothing while the run emits: it never slows the run.
            await engine.until_status(run_id, RunStatus.SUCCEEDED)
        events = [first, *await asyncio.wait_for(collect(stream), 30)]
    finally:
        await store.close()
    assert stream.cut_offs >= 1, "the subscriber fell behind and was cut off"
    assert is_contiguous(events, 1), "it resumed from the database without a gap or duplicate"
    assert [event.type for event in events] == [
        "queued",
        "started",
        *["delta"] * 300,
        "succeeded",
    ]


async def test_a_stream_ends_when_the_run_ended_without_a_terminal_event(
    engine: EngineHarness,
) -> None:
    tenant = await engine.tenants.new()
    [refused] = await engine.runs.insert_pending(
        [NewRun(tenant_id=tenant, workflow="never", input={}, lane=engine.lane)]
    )
    stream = await engine.streams.open(tenant, refused.run_id)
    assert await engine.runs.mark_rate_limited(refused.run_id, {"code": "quota_exceeded"})
    assert await asyncio.wait_for(collect(stream), 10) == []


async def test_steps_and_permission_waits_are_events_a_follower_sees(
    db: DatabaseManager, store: RuntimeStore, tenants: Tenants
) -> None:
    engine = EngineHarness(db, store, tenants)
    asking = asyncio.Event()

    def flaky(calls: list[int]) -> str:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("the first try fails")
        return "drafted"

    @engine.app.workflow("reviewed")
    async def reviewed(ctx: Context) -> JSONValue:
        calls: list[int] = []
        await ctx.step("draft", flaky, calls, retries=1, backoff=0.0)
        asking.set()
        decision = await ctx.request_permission("publish", {"pages": 3}, timeout=60)
        return decision.data

    run_id = await engine.new_run("reviewed")
    claim = await engine.claim()
    running = asyncio.create_task(engine.runner.run(claim))
    await asyncio.wait_for(asking.wait(), 10)

    async def requested() -> list[Event]:
        return await engine.stored(run_id, "permission_request")

    # Written at once, while the workflow waits: a follower learns it waits for someone.
    [request] = await wait_for(requested, message="the permission_request event")
    assert isinstance(request.data, dict)
    interrupt_id = request.data["interrupt_id"]
    assert isinstance(interrupt_id, str)
    assert request.data == {
        "interrupt_id": interrupt_id,
        "action": "publish",
        "data": {"pages": 3},
        "expires_at": request.data["expires_at"],
    }
    await InterruptsRepo(db).resolve(
        run_id, interrupt_id, approved=True, reason="approved", data={"edited": True}
    )
    decision: JSONObject = {"approved": True, "reason": "approved", "data": {"edited": True}}
    await store.resolve_interrupt(run_id, interrupt_id, decision)
    assert await asyncio.wait_for(running, 10) == {"edited": True}
    await engine.runner.release(claim)

    stored = [(e.type, without_duration(e.data)) for e in await engine.stored(run_id)]
    draft = {"key": "draft"}
    assert stored[2:] == [
        ("step_started", {**draft, "try": 1}),
        (
            "step_finished",
            {
                **draft,
                "try": 1,
                "status": "failed",
                "error": "ConnectionError: the first try fails",
            },
        ),
        ("step_started", {**draft, "try": 2}),
        ("step_finished", {**draft, "try": 2, "status": "succeeded"}),
        ("permission_request", request.data),
        (
            "permission_resolved",
            {
                "interrupt_id": interrupt_id,
                "approved": True,
                "reason": "approved",
                "data": {"edited": True},
            },
        ),
    ]
    for finished in await engine.stored(run_id, "step_finished"):
        assert isinstance(finished.data, dict)
        duration_ms = finished.data["duration_ms"]
        assert isinstance(duration_ms, float | int) and duration_ms >= 0


async def test_a_returning_workflow_hands_its_last_progress_events_to_the_outcome(
    db: DatabaseManager, store: RuntimeStore, tenants: Tenants
) -> None:
    # The timer far away: on a loaded machine a step (its function in a thread, then its
    # write) can outlast the default 50 ms, and the timer then writes the step's progress
    # events before the workflow returns; that bound is tested on its own above.
    engine = EngineHarness(db, store, tenants, event_flush_interval_s=60)

    @engine.app.workflow("one_step")
    async def one_step(ctx: Context) -> JSONValue:
        return await ctx.step("look", lambda: "seen")

    @engine.app.workflow("streamed")
    async def streamed(ctx: Context) -> JSONValue:
        await ctx.step("look", lambda: "seen")
        await ctx.emit("delta", {"token": "last"})  # a streamed tail is written and published
        return "done"

    run_id = await engine.new_run("one_step")
    trailing: list[tuple[str, JSONObject]] = []
    assert await engine.runner.run(await engine.claim(), trailing=trailing) == "seen"
    assert [(kind, without_duration(data)) for kind, data in trailing] == [
        ("step_started", {"key": "look", "try": 1}),
        ("step_finished", {"key": "look", "try": 1, "status": "succeeded"}),
    ]
    assert [e.type for e in await engine.stored(run_id)] == ["queued", "started"]

    run_id = await engine.new_run("streamed")
    trailing = []
    assert await engine.runner.run(await engine.claim(), trailing=trailing) == "done"
    assert trailing == []
    assert [e.type for e in await engine.stored(run_id)][2:] == [
        "step_started",
        "step_finished",
        "delta",
    ]


async def test_a_worker_commits_a_step_runs_last_events_with_its_success(
    db: DatabaseManager, store: RuntimeStore, tenants: Tenants
) -> None:
    # The timer far away: on a loaded machine it could write the step's events before the
    # outcome arrives (a trickle's latency bound, tested above), which is not this test's point.
    engine = EngineHarness(db, store, tenants, event_flush_interval_s=60)

    @engine.app.workflow("one_step")
    async def one_step(ctx: Context) -> JSONValue:
        return await ctx.step("look", lambda: "seen")

    run_id = await engine.new_run("one_step")
    async with engine.worker():
        await engine.until_status(run_id, RunStatus.SUCCEEDED)
    stored = await engine.stored(run_id)
    assert [e.type for e in stored] == [
        "queued",
        "started",
        "step_started",
        "step_finished",
        "succeeded",
    ]
    assert is_contiguous(stored, 1)
    # One transaction, one clock reading: not a write of their own before the outcome's.
    assert stored[2].created_at == stored[3].created_at == stored[4].created_at


async def test_last_progress_events_ride_with_whatever_outcome_ends_the_attempt(
    engine: EngineHarness,
) -> None:
    # The workflow returns, but its result is not JSON: the attempt fails after all, and the
    # progress events it handed over are written with the failure, not dropped.
    @engine.app.workflow("unserialisable")
    async def unserialisable(ctx: Context) -> JSONValue:
        await ctx.step("look", lambda: "seen")
        return object()  # type: ignore[return-value]

    run_id = await engine.new_run("unserialisable")
    async with engine.worker():
        await engine.until_status(run_id, RunStatus.FAILED)
    assert [e.type for e in await engine.stored(run_id)] == [
        "queued",
        "started",
        "step_started",
        "step_finished",
        "failed",
    ]
