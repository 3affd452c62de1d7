"""Steps of many runs started and finished at once, on every backend: the engine's way.

A worker's attempts start and finish their steps together; on a backend that can bind a batch's
rows as one parameter (PostgreSQL) those writes share one statement, and everywhere each step
ends exactly as its own statement would have left it: a lost fence, a recorded cancel or a key
already taken keep a step out of the batch and its own write says why.
"""

import asyncio
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import select, update

from moorline.db.manager import DatabaseManager
from moorline.db.repos.records import Fence
from moorline.db.repos.step_batches import StepBatches
from moorline.db.repos.steps import CancelRequested, LeaseLost, StepsRepo
from moorline.db.schema import runs, steps
from moorline.types import JSONValue, StepStatus
from tests.contract.queue_helpers import Tenants
from tests.contract.statements import data_statements
from tests.contract.test_steps_repo import new_run, reclaim, step_rows
from tests.helpers import wait_for

RUNS = 6
OUTPUTS: list[JSONValue] = [
    {"text": "review ✓", "nested": {"x": None}},
    None,
    [1, 2.5],
    "s",
    7,
    True,
]


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


async def start_all(repo: StepsRepo, fences: list[Fence]) -> list[object]:
    """Each run's step ``s`` started at once, as a claim's attempts start theirs."""
    starts = (repo.insert_new(fence, "s", "fn", "h1", seq=1) for fence in fences)
    return await asyncio.gather(*starts, return_exceptions=True)


async def test_steps_of_many_runs_are_started_and_finished_together(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = StepsRepo(db)
    fences = [(await new_run(db, tenants))[1] for _ in range(RUNS)]
    together = StepBatches.can_batch(db.backend)
    with data_statements(db, "steps") as started:
        assert await start_all(repo, fences) == [True] * RUNS
    with data_statements(db, "steps") as finished:
        await asyncio.gather(
            *(
                repo.succeed(fence, "s", output)
                for fence, output in zip(fences, OUTPUTS, strict=True)
            )
        )
    # Asked for in one turn of the event loop: one batch, one statement.
    expected = 1 if together else RUNS
    assert (len(started), len(finished)) == (expected, expected), (started, finished)
    for fence, output in zip(fences, OUTPUTS, strict=True):
        [row] = await step_rows(db, fence.run_id)
        assert (row["status"], row["attempt"], row["seq"], row["output"]) == (
            StepStatus.SUCCEEDED.value,
            fence.attempt,
            1,
            output,
        )
        assert row["started_at"] <= row["finished_at"]
        replayed = await repo.start(fence, "s", "fn", "h1")
        assert (replayed.replay, replayed.step.output) == (True, output)
    # A None output is stored as a lone write stores it (JSON null, not SQL NULL).
    _, fence = await new_run(db, tenants)
    assert await repo.insert_new(fence, "s", "fn", "h1", seq=1)
    await repo.succeed(fence, "s", None)
    async with db.connect() as conn:
        nulls = select(steps.c.run_id, steps.c.output.is_(None)).where(
            steps.c.run_id.in_([fences[1].run_id, fence.run_id])
        )
        stored = {run_id: is_null for run_id, is_null in await conn.execute(nulls)}
    assert stored[fences[1].run_id] == stored[fence.run_id]


async def test_a_batch_writes_only_the_steps_whose_fence_holds_and_no_cancel_stops(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = StepsRepo(db)
    made = [await new_run(db, tenants) for _ in range(4)]
    fences = [fence for _, fence in made]
    stale = fences[1]
    await reclaim(db, made[1][0], stale)
    async with db.transaction() as conn:
        await conn.execute(
            update(runs)
            .where(runs.c.id == fences[2].run_id)
            .values(cancel_requested_at=db.backend.now())
        )
    outcomes = await start_all(repo, fences)
    assert outcomes[0] is True and outcomes[3] is True
    assert isinstance(outcomes[1], LeaseLost)
    assert isinstance(outcomes[2], CancelRequested)
    assert [len(await step_rows(db, fence.run_id)) for fence in fences] == [1, 0, 0, 1]
    # Finishing: the run reclaimed since its start keeps its step running, the others succeed.
    await reclaim(db, made[3][0], fences[3])
    finishes = await asyncio.gather(
        repo.succeed(fences[0], "s", "kept"),
        repo.succeed(fences[3], "s", "lost"),
        return_exceptions=True,
    )
    assert finishes[0] is None and isinstance(finishes[1], LeaseLost)
    [kept] = await step_rows(db, fences[0].run_id)
    [lost] = await step_rows(db, fences[3].run_id)
    assert (kept["status"], kept["output"]) == (StepStatus.SUCCEEDED.value, "kept")
    assert (lost["status"], lost["output"]) == (StepStatus.RUNNING.value, None)


async def test_a_key_already_taken_sends_the_batch_s_steps_alone(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = StepsRepo(db)
    fences = [(await new_run(db, tenants))[1] for _ in range(3)]
    assert await repo.insert_new(fences[1], "s", "fn", "h1", seq=1)
    # The taken key fails the batch's statement as a whole: every step is written alone, and
    # the taken one is left to start(), as its own statement leaves it.
    assert await start_all(repo, fences) == [True, False, True]
    assert [len(await step_rows(db, fence.run_id)) for fence in fences] == [1, 1, 1]


@pytest.mark.requires("row_locks")
async def test_a_run_another_transaction_holds_keeps_no_other_step_waiting(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = StepsRepo(db)
    fences = [(await new_run(db, tenants))[1] for _ in range(3)]
    held = fences[1]
    async with db.write_transaction() as conn:
        # The run's row lock, as a cancel request or a reclaim holds it for a moment.
        await conn.execute(
            update(runs).where(runs.c.id == held.run_id).values(updated_at=db.backend.now())
        )
        starts = [
            asyncio.create_task(repo.insert_new(fence, "s", "fn", "h1", seq=1)) for fence in fences
        ]

        async def others_done() -> bool:
            return starts[0].done() and starts[2].done()

        await wait_for(others_done, message="the steps of the runs nobody holds")
        assert not starts[1].done()
    assert [await start for start in starts] == [True, True, True]
    assert [len(await step_rows(db, fence.run_id)) for fence in fences] == [1, 1, 1]
