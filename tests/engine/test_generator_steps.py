"""Generator steps through the real runner and a real Worker, on every backend and both stores.

A step whose function yields streams each item as a ``delta`` event that a follower of the run
sees live, and checkpoints the items joined; a replay returns that checkpoint without calling
the generator again or sending its deltas twice. A cancel or a lost lease in the middle of a
stream stops the producer thread: it is gone, and its generator closed, soon after.
"""

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator

import pytest

from moorline import Context
from moorline.db.manager import DatabaseManager
from moorline.db.repos.records import Event
from moorline.db.repos.steps import StepsRepo
from moorline.dispatch.cancel import cancel_run
from moorline.engine.streams import EventStream
from moorline.errors import LeaseLost
from moorline.runtime.base import RuntimeStore
from moorline.types import JSONValue, RunStatus, StepStatus
from tests.contract.queue_helpers import Tenants
from tests.engine.harness import EngineHarness
from tests.helpers import wait_for

WORDS = ["Moor", "line ", "streams ", "steps"]


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


@pytest.fixture
def engine(db: DatabaseManager, store: RuntimeStore, tenants: Tenants) -> EngineHarness:
    return EngineHarness(db, store, tenants)


class Endless:
    """A sync generator function that never ends, recording its thread and its close."""

    def __init__(self) -> None:
        self.produced = 0
        self.closed = threading.Event()
        self.thread: threading.Thread | None = None

    def __call__(self) -> Iterator[str]:
        self.thread = threading.current_thread()
        try:
            while True:
                self.produced += 1
                yield "."
        finally:
            self.closed.set()

    async def wait_ended(self) -> None:
        async def gone() -> bool:
            return self.closed.is_set() and self.thread is not None and not self.thread.is_alive()

        await wait_for(gone, timeout_s=10, message="the producer thread to end")


async def test_a_follower_sees_the_deltas_and_the_checkpoint_holds_the_joined_output(
    engine: EngineHarness,
) -> None:
    go = asyncio.Event()

    def words(chunks: list[str]) -> Iterator[str]:
        yield from chunks  # in the bridge's thread

    async def records(n: int) -> AsyncIterator[JSONValue]:
        for i in range(n):
            yield {"n": i}

    @engine.app.workflow("streaming")
    async def streaming(ctx: Context) -> JSONValue:
        await go.wait()
        text = await ctx.step("text", words, WORDS)
        items = await ctx.step("items", records, 2)
        return {"text": text, "items": items}

    run_id = await engine.new_run("streaming")
    assert engine.tenant is not None
    async with engine.worker():
        stream = await engine.streams.open(engine.tenant, run_id)
        go.set()
        followed = await asyncio.wait_for(_collect(stream), 30)
    deltas = [event.data for event in followed if event.type == "delta"]
    assert deltas == [
        *({"step": "text", "text": word} for word in WORDS),
        {"step": "items", "item": {"n": 0}},
        {"step": "items", "item": {"n": 1}},
    ]
    assert followed[-1].type == "succeeded"
    assert followed == await engine.stored(run_id)
    steps = await StepsRepo(engine.db).list(run_id)
    assert [(s.key, s.status, s.output) for s in steps] == [
        ("text", StepStatus.SUCCEEDED, "".join(WORDS)),
        ("items", StepStatus.SUCCEEDED, [{"n": 0}, {"n": 1}]),
    ]
    run = await engine.runs.get(run_id)
    assert run is not None and run.status is RunStatus.SUCCEEDED
    assert run.output == {"text": "".join(WORDS), "items": [{"n": 0}, {"n": 1}]}


async def test_a_replay_returns_the_checkpoint_without_streaming_again(
    engine: EngineHarness,
) -> None:
    calls: list[int] = []

    def words() -> Iterator[str]:
        calls.append(1)
        yield from WORDS

    @engine.app.workflow("replayed")
    async def replayed(ctx: Context) -> JSONValue:
        text = await ctx.step("text", words)
        if ctx.attempt == 1:
            raise ConnectionError("the worker died after the stream")
        return text

    run_id = await engine.new_run("replayed")
    with pytest.raises(ConnectionError):
        await engine.runner.run(await engine.claim())
    claim = await engine.reclaim()
    assert await engine.runner.run(claim) == "".join(WORDS)
    await engine.runner.release(claim)
    assert calls == [1]
    deltas = await engine.stored(run_id, "delta")
    assert [(event.attempt, event.data) for event in deltas] == [
        (1, {"step": "text", "text": word}) for word in WORDS
    ]


async def test_a_cancel_mid_stream_ends_the_run_and_leaves_no_thread_blocked(
    engine: EngineHarness,
) -> None:
    endless = Endless()

    @engine.app.workflow("endless")
    async def endless_workflow(ctx: Context) -> JSONValue:
        return await ctx.step("forever", endless)

    run_id = await engine.new_run("endless")
    assert engine.tenant is not None
    async with engine.worker():

        async def streaming() -> bool:
            return len(await engine.stored(run_id, "delta")) >= 10

        await wait_for(streaming, message="the stream to be under way")
        await cancel_run(engine.runs, engine.store, engine.tenant, run_id)
        await engine.until_status(run_id, RunStatus.CANCELLED)
    await endless.wait_ended()
    step = await StepsRepo(engine.db).get(run_id, "forever")
    assert step is not None and step.status is not StepStatus.SUCCEEDED


async def test_a_lease_lost_mid_stream_stops_the_attempt_and_leaves_no_thread_blocked(
    engine: EngineHarness,
) -> None:
    endless = Endless()

    @engine.app.workflow("endless")
    async def endless_workflow(ctx: Context) -> JSONValue:
        return await ctx.step("forever", endless)

    run_id = await engine.new_run("endless")
    first = asyncio.create_task(engine.runner.run(await engine.claim()))

    async def streaming() -> bool:
        return len(await engine.stored(run_id, "delta")) >= 10

    await wait_for(streaming, message="the stream to be under way")
    second = await engine.reclaim()  # the first attempt's next delta batch finds it taken
    with pytest.raises(LeaseLost):
        await asyncio.wait_for(first, 20)
    await endless.wait_ended()
    assert all(event.attempt == 1 for event in await engine.stored(run_id, "delta"))
    await engine.runner.release(second)


async def _collect(stream: EventStream) -> list[Event]:
    return [event async for event in stream]
