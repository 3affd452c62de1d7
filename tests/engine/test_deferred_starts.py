"""A new step's start written only if the step outlasts ``step_start_after`` (opt-in, issue 19).

Under a lease the worker's own clock vouches for, a step that returns within the grace is
recorded by one statement (its start and its result together); a longer one has its start
written at the grace and shows ``running`` from then on; a failing one gets its start and its
failure. Without that word on the lease (or with the setting at its default, 0) every start is
written before the function is called. A cancel recorded in the database whose store signal
was lost is found by the step's write, which keeps the step (it has run) and stops the run at
the next boundary.
"""

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest

from moorline import Cancelled, Context
from moorline.db.manager import DatabaseManager
from moorline.db.repos.steps import StepsRepo
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.types import JSONValue, RunId, StepStatus
from tests.contract.queue_helpers import Tenants
from tests.contract.statements import data_statements
from tests.engine.harness import EngineHarness
from tests.helpers import wait_for

STEPS = 4
GRACE_S = 0.05


def held() -> bool:
    return True


def not_held() -> bool:
    return False


@pytest.fixture
async def harness(db: DatabaseManager) -> AsyncIterator[EngineHarness]:
    tenants = Tenants(db)
    store = InMemoryRuntimeStore()
    made = EngineHarness(db, store, tenants, step_start_after_s=GRACE_S)
    yield made
    await store.close()
    await tenants.purge()


async def steps_of(harness: EngineHarness, run_id: RunId) -> list[tuple[str, StepStatus]]:
    return [(step.key, step.status) for step in await StepsRepo(harness.db).list(run_id)]


async def test_quick_steps_under_a_held_lease_cost_one_statement_each(
    harness: EngineHarness,
) -> None:
    @harness.app.workflow("quick")
    async def quick(ctx: Context) -> JSONValue:
        return [await ctx.step(f"s{i}", pow, i, 2) for i in range(STEPS)]

    run_id = await harness.new_run("quick")
    claim = await harness.claim()
    with data_statements(harness.db, "steps") as sent:
        assert await harness.runner.run(claim, lease_held=held) == [i * i for i in range(STEPS)]
    assert [statement.split()[0].upper() for statement in sent] == ["INSERT"] * STEPS
    recorded = await StepsRepo(harness.db).list(run_id)
    assert [(s.key, s.status, s.output, s.seq) for s in recorded] == [
        (f"s{i}", StepStatus.SUCCEEDED, i * i, i + 1) for i in range(STEPS)
    ]


@pytest.mark.parametrize("why", ["the lease unvouched for", "the default setting"])
async def test_otherwise_every_start_is_written_before_the_call(
    harness: EngineHarness, db: DatabaseManager, why: str
) -> None:
    if why == "the default setting":
        harness = EngineHarness(db, harness.store, harness.tenants)
        assert harness.settings.step_start_after == 0

    @harness.app.workflow("careful")
    async def careful(ctx: Context) -> JSONValue:
        return [await ctx.step(f"s{i}", pow, i, 2) for i in range(STEPS)]

    await harness.new_run("careful")
    claim = await harness.claim()
    with data_statements(harness.db, "steps") as sent:
        await harness.runner.run(
            claim, lease_held=held if why == "the default setting" else not_held
        )
    assert [statement.split()[0].upper() for statement in sent] == ["INSERT", "UPDATE"] * STEPS


async def test_a_quick_steps_start_is_dated_back_to_its_call(harness: EngineHarness) -> None:
    async def nap() -> str:
        await asyncio.sleep(GRACE_S / 2)
        return "rested"

    @harness.app.workflow("nap")
    async def napping(ctx: Context) -> JSONValue:
        return await ctx.step("nap", nap)

    run_id = await harness.new_run("nap")
    with data_statements(harness.db, "steps") as sent:
        assert await harness.runner.run(await harness.claim(), lease_held=held) == "rested"
    assert len(sent) == 1
    step = await StepsRepo(harness.db).get(run_id, "nap")
    assert step is not None and step.finished_at is not None
    # SQLite keeps milliseconds.
    assert step.finished_at - step.started_at >= timedelta(seconds=GRACE_S / 2 - 0.002)


async def test_a_step_that_outlasts_the_grace_shows_running_until_it_returns(
    harness: EngineHarness,
) -> None:
    release = asyncio.Event()

    async def slow() -> str:
        await release.wait()
        return "done"

    @harness.app.workflow("slow")
    async def slow_workflow(ctx: Context) -> JSONValue:
        return await ctx.step("slow", slow)

    run_id = await harness.new_run("slow")
    called = asyncio.get_running_loop().time()
    running = asyncio.create_task(harness.runner.run(await harness.claim(), lease_held=held))

    async def shown_running() -> bool:
        return await steps_of(harness, run_id) == [("slow", StepStatus.RUNNING)]

    await wait_for(shown_running, message="the slow step's start")
    assert asyncio.get_running_loop().time() - called >= GRACE_S
    release.set()
    assert await asyncio.wait_for(running, 10) == "done"
    assert await steps_of(harness, run_id) == [("slow", StepStatus.SUCCEEDED)]


async def test_a_quick_step_that_fails_records_its_start_and_its_failure(
    harness: EngineHarness,
) -> None:
    tries: list[int] = []

    def flaky() -> str:
        tries.append(len(tries) + 1)
        if len(tries) == 1:
            raise ConnectionError("the first try fails")
        return "second"

    @harness.app.workflow("flaky")
    async def flaky_workflow(ctx: Context) -> JSONValue:
        return await ctx.step("flaky", flaky, retries=1, backoff=0)

    run_id = await harness.new_run("flaky")
    with data_statements(harness.db, "steps") as sent:
        assert await harness.runner.run(await harness.claim(), lease_held=held) == "second"
    # The failed try: its start and its failure; the retry takes the failed row over.
    assert [statement.split()[0].upper() for statement in sent][:2] == ["INSERT", "UPDATE"]
    assert tries == [1, 2]
    assert await steps_of(harness, run_id) == [("flaky", StepStatus.SUCCEEDED)]


@pytest.mark.parametrize("slow", [False, True], ids=["quick", "outlasting the grace"])
async def test_a_cancel_whose_signal_was_lost_lets_at_most_one_step_run(
    harness: EngineHarness, slow: bool
) -> None:
    gate = asyncio.Event()
    ran: list[str] = []

    async def note(name: str) -> str:
        if slow:
            await asyncio.sleep(GRACE_S * 3)
        ran.append(name)
        return name

    @harness.app.workflow("cancelled")
    async def cancelled(ctx: Context) -> JSONValue:
        await ctx.step("before", note, "before")
        await gate.wait()
        await ctx.step("after", note, "after")  # runs: nothing told the worker yet
        await ctx.step("never", note, "never")
        return "unreachable"

    run_id = await harness.new_run("cancelled")
    running = asyncio.create_task(harness.runner.run(await harness.claim(), lease_held=held))

    async def first_recorded() -> bool:
        return await steps_of(harness, run_id) == [("before", StepStatus.SUCCEEDED)]

    await wait_for(first_recorded, message="the first step")
    assert harness.tenant is not None
    # Recorded in the database only: the store never hears of it.
    await harness.runs.request_cancel(harness.tenant, run_id)
    gate.set()
    with pytest.raises(Cancelled):
        await asyncio.wait_for(running, 10)
    assert ran == ["before", "after"]
    assert await steps_of(harness, run_id) == [
        ("before", StepStatus.SUCCEEDED),
        ("after", StepStatus.SUCCEEDED),
    ]
