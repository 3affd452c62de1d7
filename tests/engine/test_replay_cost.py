"""Replay cost: a resumed run replays its finished steps from what the attempt read, at once.

Issue 16 resumes parked runs by replaying them, and wants 200 finished steps replayed in about
the time of 2. A replayed step runs nothing and writes nothing, so it must not cost a round
trip to the RuntimeStore either: with Redis, one cancel check per replayed step made a
200-step replay several times slower than the rest of the attempt (bench/suspension.py).
"""

from collections.abc import AsyncIterator

import pytest

from moorline import Cancelled, Context
from moorline.db.manager import DatabaseManager
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.types import RunId
from tests.contract.queue_helpers import Tenants
from tests.engine.harness import EngineHarness

STEPS = 20


class CountingStore(InMemoryRuntimeStore):
    """The in-memory store, counting the reads of runs' cancel flags."""

    def __init__(self) -> None:
        super().__init__()
        self.cancel_reads = 0

    async def is_cancelled(self, run_id: RunId) -> bool:
        self.cancel_reads += 1
        return await super().is_cancelled(run_id)


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


@pytest.fixture
def store() -> CountingStore:
    return CountingStore()


@pytest.fixture
def engine(db: DatabaseManager, store: CountingStore, tenants: Tenants) -> EngineHarness:
    return EngineHarness(db, store, tenants)


async def test_replayed_steps_do_not_ask_the_store_for_a_cancel(
    engine: EngineHarness, store: CountingStore
) -> None:
    calls: list[int] = []

    @engine.app.workflow("many")
    async def many(ctx: Context) -> int:
        for index in range(STEPS):
            await ctx.step(f"s:{index}", calls.append, index)
        return len(calls)

    await engine.new_run("many")
    assert await engine.runner.run(await engine.claim()) == STEPS
    assert store.cancel_reads >= STEPS  # a step that runs checks for a cancel first
    store.cancel_reads = 0
    assert await engine.runner.run(await engine.reclaim()) == STEPS
    assert calls == list(range(STEPS))  # nothing ran twice
    assert store.cancel_reads == 0


async def test_a_cancel_is_raised_at_the_first_step_that_would_run_after_the_replay(
    engine: EngineHarness, store: CountingStore
) -> None:
    calls: list[str] = []
    planned = ["a", "b"]

    @engine.app.workflow("grows")
    async def grows(ctx: Context) -> None:
        for name in list(planned):
            await ctx.step(name, calls.append, name)

    run_id = await engine.new_run("grows")
    await engine.runner.run(await engine.claim())
    planned.append("c")
    await store.request_cancel(run_id)
    with pytest.raises(Cancelled):
        await engine.runner.run(await engine.reclaim())
    assert calls == ["a", "b"]  # "c" never ran
