"""What ``ctx.step`` costs in the database, on every backend, and what it must still refuse.

An attempt reads its run's steps once (a first attempt reads nothing), replays from what it read
without a database trip, and starts and finishes a new step with one statement each; a key it
reused, a step it must take over and a changed call still go through ``StepsRepo.start``.
"""

from collections.abc import AsyncIterator

import pytest
from sqlalchemy import update

from moorline import Context
from moorline.db.manager import DatabaseManager
from moorline.db.repos.steps import StepMismatch, StepsRepo
from moorline.db.schema import runs
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.types import JSONValue, StepStatus
from tests.contract.queue_helpers import Tenants
from tests.contract.statements import data_statements
from tests.engine.harness import EngineHarness

STEPS = 5


@pytest.fixture
async def harness(db: DatabaseManager) -> AsyncIterator[EngineHarness]:
    tenants = Tenants(db)
    store = InMemoryRuntimeStore()
    yield EngineHarness(db, store, tenants)
    await store.close()
    await tenants.purge()


def double(n: int) -> int:
    return n * 2


async def test_a_new_step_costs_one_statement_to_start_and_one_to_finish(
    harness: EngineHarness,
) -> None:
    calls: list[int] = []

    def counted(n: int) -> int:
        calls.append(n)
        return n * 2

    @harness.app.workflow("steps")
    async def steps(ctx: Context) -> JSONValue:
        return [await ctx.step(f"s{i}", counted, i) for i in range(STEPS)]

    run_id = await harness.new_run("steps")
    claim = await harness.claim()
    with data_statements(harness.db, "steps") as sent:
        output = await harness.runner.run(claim)
    assert output == [double(i) for i in range(STEPS)]
    assert calls == list(range(STEPS))
    assert [statement.split()[0].upper() for statement in sent] == ["INSERT", "UPDATE"] * STEPS
    recorded = await StepsRepo(harness.db).list(run_id)
    assert [(s.key, s.status, s.output) for s in recorded] == [
        (f"s{i}", StepStatus.SUCCEEDED, double(i)) for i in range(STEPS)
    ]


async def test_a_resumed_attempt_reads_its_steps_once_and_replays_them_without_a_trip(
    harness: EngineHarness,
) -> None:
    calls: list[int] = []

    def counted(n: int) -> int:
        calls.append(n)
        return n * 2

    @harness.app.workflow("resumed")
    async def resumed(ctx: Context) -> JSONValue:
        results = [await ctx.step(f"s{i}", counted, i) for i in range(STEPS)]
        if ctx.attempt == 1:
            raise ConnectionError("the worker died after the steps")
        results.append(await ctx.step("last", counted, STEPS))
        return results

    await harness.new_run("resumed")
    with pytest.raises(ConnectionError):
        await harness.runner.run(await harness.claim())
    claim = await harness.reclaim()
    with data_statements(harness.db, "steps") as sent:
        output = await harness.runner.run(claim)
    assert output == [double(i) for i in range(STEPS + 1)]
    assert calls == [*range(STEPS), STEPS]
    # One read of the recorded steps, then the new step's start and finish.
    assert [statement.split()[0].upper() for statement in sent] == ["SELECT", "INSERT", "UPDATE"]


async def test_a_key_reused_for_the_same_call_is_replayed_from_the_database(
    harness: EngineHarness,
) -> None:
    calls: list[int] = []

    def counted(n: int) -> int:
        calls.append(n)
        return n * 2

    @harness.app.workflow("again")
    async def again(ctx: Context) -> JSONValue:
        first = [await ctx.step("key", counted, 1) for _ in range(2)]
        if ctx.attempt == 1:
            raise ConnectionError("the worker died after the steps")
        # Read at the first step, replayed from memory once; the second replay reads it again.
        return first + [await ctx.step("key", counted, 1) for _ in range(2)]

    await harness.new_run("again")
    with pytest.raises(ConnectionError):
        await harness.runner.run(await harness.claim())
    assert await harness.runner.run(await harness.reclaim()) == [2, 2, 2, 2]
    assert calls == [1]


async def test_a_reused_key_with_another_call_in_the_same_attempt_is_a_mismatch(
    harness: EngineHarness,
) -> None:
    @harness.app.workflow("reused")
    async def reused(ctx: Context) -> JSONValue:
        await ctx.step("key", double, 1)
        return await ctx.step("key", double, 2)

    run_id = await harness.new_run("reused")
    with pytest.raises(StepMismatch, match="non-deterministic"):
        await harness.runner.run(await harness.claim())
    step = await StepsRepo(harness.db).get(run_id, "key")
    assert step is not None and (step.status, step.output) == (StepStatus.SUCCEEDED, 2)


async def test_a_step_that_failed_in_this_attempt_is_taken_over_by_its_retry(
    harness: EngineHarness,
) -> None:
    tries: list[int] = []

    def flaky() -> str:
        tries.append(len(tries))
        if len(tries) < 3:
            raise ValueError("not yet")
        return "done"

    @harness.app.workflow("flaky")
    async def flaky_workflow(ctx: Context) -> JSONValue:
        return await ctx.step("flaky", flaky, retries=2, backoff=0.0)

    run_id = await harness.new_run("flaky")
    assert await harness.runner.run(await harness.claim()) == "done"
    assert tries == [0, 1, 2]
    step = await StepsRepo(harness.db).get(run_id, "flaky")
    assert step is not None and (step.status, step.output, step.error) == (
        StepStatus.SUCCEEDED,
        "done",
        None,
    )


async def test_an_attempt_numbers_its_steps_after_those_it_found(harness: EngineHarness) -> None:
    @harness.app.workflow("numbered")
    async def numbered(ctx: Context, more: bool) -> JSONValue:
        keys = ["zeta", "alpha", *(["mid", "beta"] if more else [])]
        return [await ctx.step(key, double, 1) for key in keys]

    run_id = await harness.new_run("numbered", input={"more": False})
    assert await harness.runner.run(await harness.claim()) == [2, 2]
    # A later attempt (the same run, replayed) adds two steps after the ones it loaded.
    async with harness.db.transaction() as conn:
        await conn.execute(update(runs).where(runs.c.id == run_id).values(input={"more": True}))
    assert await harness.runner.run(await harness.reclaim()) == [2, 2, 2, 2]
    recorded = await StepsRepo(harness.db).list(run_id)
    assert [(s.key, s.seq) for s in recorded] == [
        ("zeta", 1),
        ("alpha", 2),
        ("mid", 3),
        ("beta", 4),
    ]
