"""What ``ctx.step`` costs in the database, on every backend, and what it must still refuse.

An attempt reads its run's steps once (a first attempt reads nothing), replays from what it read
without a database trip, starts and finishes its first new step with one statement each and
records every later new step, once finished, with one; a key it reused, a step it must take
over and a changed call still go through ``StepsRepo.start``.
"""

import asyncio
from collections.abc import AsyncIterator

import pytest

from moorline import Cancelled, Context
from moorline.db.manager import DatabaseManager
from moorline.db.repos.steps import StepMismatch, StepsRepo
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.types import JSONValue, RunId, StepStatus
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


async def test_a_new_step_costs_one_statement_after_the_attempts_first(
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
    # The first step meets the cancel check by its start; each later one by its predecessor's.
    expected = ["INSERT", "UPDATE"] + ["INSERT"] * (STEPS - 1)
    assert [statement.split()[0].upper() for statement in sent] == expected
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


async def test_a_step_after_the_workflow_awaited_something_starts_with_its_own_checks(
    harness: EngineHarness,
) -> None:
    # A checkpoint's fence and cancel checks stand in for the next step's only while the
    # workflow has awaited nothing since: here it yields between every two steps.
    @harness.app.workflow("yielding")
    async def yielding(ctx: Context) -> JSONValue:
        results = []
        for i in range(STEPS):
            results.append(await ctx.step(f"s{i}", double, i))
            await asyncio.sleep(0)
        return results

    await harness.new_run("yielding")
    claim = await harness.claim()
    with data_statements(harness.db, "steps") as sent:
        output = await harness.runner.run(claim)
    assert output == [double(i) for i in range(STEPS)]
    assert [statement.split()[0].upper() for statement in sent] == ["INSERT", "UPDATE"] * STEPS


async def test_a_cancel_recorded_only_in_the_database_stops_the_step_after_the_next_checkpoint(
    harness: EngineHarness,
) -> None:
    ran: list[str] = []

    async def cancelling() -> str:
        # The cancel is recorded while this step runs; the store never hears of it.
        assert harness.tenant is not None
        await harness.runs.request_cancel(harness.tenant, ctx_run_id[0])
        ran.append("two")
        return "two"

    ctx_run_id: list[RunId] = []

    @harness.app.workflow("cancelled_in_db")
    async def cancelled_in_db(ctx: Context) -> JSONValue:
        ctx_run_id.append(ctx.run_id)
        await ctx.step("one", double, 1)
        await ctx.step("two", cancelling)  # recorded without a running row
        await ctx.step("three", ran.append, "three")
        return "unreachable"

    run_id = await harness.new_run("cancelled_in_db")
    with pytest.raises(Cancelled):
        await harness.runner.run(await harness.claim())
    assert ran == ["two"]
    # The step that ran when the cancel came keeps its result; the next one never started.
    recorded = await StepsRepo(harness.db).list(run_id)
    assert [(s.key, s.status, s.output) for s in recorded] == [
        ("one", StepStatus.SUCCEEDED, 2),
        ("two", StepStatus.SUCCEEDED, "two"),
    ]


async def test_a_step_recorded_in_one_write_keeps_its_failed_tries_and_their_attempt(
    harness: EngineHarness,
) -> None:
    tries: list[int] = []

    def flaky() -> str:
        tries.append(len(tries))
        if len(tries) < 3:
            raise ValueError("not yet")
        return "done"

    seen: list[tuple[StepStatus, str | None]] = []

    async def observe() -> None:
        step = await StepsRepo(harness.db).get(run_id, "flaky")
        assert step is not None
        seen.append((step.status, step.error))

    @harness.app.workflow("flaky_after")
    async def flaky_after(ctx: Context) -> JSONValue:
        await ctx.step("first", double, 1)
        try:
            # The first try runs without a running row and is inserted failed.
            await ctx.step("flaky", flaky)
        except ValueError:
            await observe()
        return await ctx.step("flaky", flaky, retries=1, backoff=0.0)

    run_id = await harness.new_run("flaky_after")
    assert await harness.runner.run(await harness.claim()) == "done"
    assert tries == [0, 1, 2]
    assert seen == [(StepStatus.FAILED, "ValueError: not yet")]
    step = await StepsRepo(harness.db).get(run_id, "flaky")
    assert step is not None
    assert (step.status, step.attempt, step.output, step.error) == (
        StepStatus.SUCCEEDED,
        1,
        "done",
        None,
    )


async def test_a_key_folding_onto_a_known_one_is_judged_before_its_function_runs(
    harness: EngineHarness,
) -> None:
    calls: list[str] = []

    def note(key: str) -> str:
        calls.append(key)
        return key

    @harness.app.workflow("folding")
    async def folding(ctx: Context) -> JSONValue:
        await ctx.step("Key", note, "Key")
        return await ctx.step("key", note, "key")

    run_id = await harness.new_run("folding")
    try:
        output = await harness.runner.run(await harness.claim())
    except StepMismatch as exc:
        # MySQL/MariaDB compare the keys as equal: refused before the function ran.
        assert "collides" in str(exc)
        assert calls == ["Key"]
    else:
        assert (output, calls) == ("key", ["Key", "key"])
        lower = await StepsRepo(harness.db).get(run_id, "key")
        assert lower is not None and lower.output == "key"
