"""``StepsRepo.record`` and late starts on every backend: a step written once it has run.

A step whose function returned before its start was written is recorded succeeded by one fenced
statement; a start written once the function has run is dated back to its call and, like the
record, is not stopped by a recorded cancel (the function ran): the record says so instead.
"""

from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from sqlalchemy import update

from moorline.db.manager import DatabaseManager
from moorline.db.repos.records import Fence
from moorline.db.repos.runs import RunsRepo
from moorline.db.repos.steps import CancelRequested, LeaseLost, StepMismatch, StepsRepo
from moorline.db.repos.usage import Charge
from moorline.db.schema import runs
from moorline.types import JSONValue, StepStatus
from moorline.usage import ModelTotals
from tests.contract.queue_helpers import Tenants
from tests.contract.statements import data_statements
from tests.contract.test_steps_repo import STALENESS, make_stale, new_run, step_rows

OUTPUT: JSONValue = {"text": "review ✓", "scores": [1, 2.5], "nested": {"x": None}}


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


async def record(
    repo: StepsRepo,
    fence: Fence,
    key: str,
    output: JSONValue,
    *,
    seq: int = 1,
    elapsed_s: float = 0.0,
    charge: Charge | None = None,
) -> bool:
    return await repo.record(
        fence, key, "fn", "h1", output, seq=seq, elapsed_s=elapsed_s, charge=charge
    )


async def cancel_in_database(db: DatabaseManager, fence: Fence) -> None:
    async with db.transaction() as conn:
        await conn.execute(
            update(runs)
            .where(runs.c.id == fence.run_id)
            .values(cancel_requested_at=db.backend.now())
        )


async def test_a_step_that_has_run_is_recorded_by_one_statement(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = StepsRepo(db)
    _, fence = await new_run(db, tenants)
    with data_statements(db, "steps") as sent:
        assert await record(repo, fence, "quick", OUTPUT, seq=3, elapsed_s=2.5) is False
    assert len(sent) == 1
    step = await repo.get(fence.run_id, "quick")
    assert step is not None and step.finished_at is not None
    assert (step.status, step.attempt, step.output, step.seq) == (
        StepStatus.SUCCEEDED,
        fence.attempt,
        OUTPUT,
        3,
    )
    assert (step.function, step.call_hash, step.usage) == ("fn", "h1", {})
    # Dated back by the time it ran (SQLite keeps milliseconds).
    assert abs(step.finished_at - step.started_at - timedelta(seconds=2.5)) < timedelta(
        milliseconds=50
    )


async def test_a_record_retried_after_a_lost_acknowledgement_finds_its_own_row(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = StepsRepo(db)
    _, fence = await new_run(db, tenants)
    charge = Charge(
        tenant_id=tenants.created[-1], workflow="wf", spent={"m1": ModelTotals(prompt_tokens=7)}
    )
    assert await record(repo, fence, "quick", OUTPUT, charge=charge) is False
    before = await step_rows(db, fence.run_id)
    assert await record(repo, fence, "quick", OUTPUT, charge=charge) is False
    assert await step_rows(db, fence.run_id) == before
    run = await RunsRepo(db).get(fence.run_id)
    assert run is not None and run.prompt_tokens == 7  # counted once
    step = await repo.get(fence.run_id, "quick")
    assert step is not None and step.usage["m1"].prompt_tokens == 7


async def test_a_stale_fence_records_nothing(db: DatabaseManager, tenants: Tenants) -> None:
    repo = StepsRepo(db)
    for how in STALENESS:
        _, fence = await new_run(db, tenants)
        fence = await make_stale(db, fence, how)
        with pytest.raises(LeaseLost):
            await record(repo, fence, "quick", OUTPUT)
        with pytest.raises(LeaseLost):
            await repo.insert_new(fence, "late", "fn", "h1", seq=1, refuse_cancelled=False)
        assert await step_rows(db, fence.run_id) == [], how


async def test_a_recorded_cancel_keeps_the_step_and_is_reported(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = StepsRepo(db)
    _, fence = await new_run(db, tenants)
    await cancel_in_database(db, fence)
    assert await record(repo, fence, "ran", OUTPUT) is True
    # A start written after the call is not refused either; one before it still is.
    with pytest.raises(CancelRequested):
        await repo.insert_new(fence, "late", "fn", "h1", seq=2)
    assert await repo.insert_new(fence, "late", "fn", "h1", seq=2, refuse_cancelled=False)
    rows = {row["key"]: (row["status"], row["output"]) for row in await step_rows(db, fence.run_id)}
    assert rows == {"ran": ("succeeded", OUTPUT), "late": ("running", None)}


async def test_a_key_equal_to_a_recorded_one_is_refused_or_distinct(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = StepsRepo(db)
    _, fence = await new_run(db, tenants)
    assert await record(repo, fence, "Key", "upper") is False
    try:
        await record(repo, fence, "key", "lower", seq=2)
    except StepMismatch as exc:
        # MySQL/MariaDB's collation: never recorded over the other key's row.
        assert "collides" in str(exc)
    else:
        lower = await repo.get(fence.run_id, "key")
        assert lower is not None and lower.output == "lower"
    upper = await repo.get(fence.run_id, "Key")
    assert upper is not None and upper.output == "upper"


async def test_a_late_start_is_dated_back_to_the_call(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = StepsRepo(db)
    _, fence = await new_run(db, tenants)
    assert await repo.insert_new(fence, "slow", "fn", "h1", seq=1, elapsed_s=60.0)
    await repo.succeed(fence, "slow", OUTPUT)
    step = await repo.get(fence.run_id, "slow")
    assert step is not None and step.finished_at is not None
    assert step.finished_at - step.started_at >= timedelta(seconds=59.9)
