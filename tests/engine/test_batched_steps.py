"""A worker's attempts share their step writes (issue 19): a real Worker, its runs' steps.

The repository's side of the batches is pinned by ``tests/contract/test_step_batches.py``; this
checks that a worker's attempts, claimed together, do reach it together: on PostgreSQL fewer
statements than steps, elsewhere one each, and every run's step recorded either way.
"""

from collections.abc import AsyncIterator

import pytest

from moorline import Context
from moorline.db.manager import DatabaseManager
from moorline.db.repos.step_batches import StepBatches
from moorline.db.repos.steps import StepsRepo
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.types import JSONValue, RunStatus, StepStatus
from tests.contract.queue_helpers import Tenants
from tests.contract.statements import data_statements
from tests.engine.harness import EngineHarness

RUNS = 16
SLOTS = 8


@pytest.fixture
async def harness(db: DatabaseManager) -> AsyncIterator[EngineHarness]:
    tenants = Tenants(db)
    store = InMemoryRuntimeStore()
    made = EngineHarness(db, store, tenants)
    yield made
    await store.close()
    await tenants.purge()


def double(value: int) -> int:
    return 2 * value


async def test_runs_claimed_together_write_their_steps_together(harness: EngineHarness) -> None:
    @harness.app.workflow("one_step")
    async def one_step(ctx: Context, value: int) -> JSONValue:
        return await ctx.step("double", double, value)

    run_ids = [await harness.new_run("one_step", input={"value": i}) for i in range(RUNS)]
    with data_statements(harness.db, "steps") as sent:
        async with harness.worker(slots=SLOTS):
            for run_id in run_ids:
                await harness.until_status(run_id, RunStatus.SUCCEEDED)
    starts = [sql for sql in sent if "INSERT INTO steps" in sql]
    if StepBatches.can_batch(harness.db.backend):
        # Each claim's attempts start their steps in one turn of the loop: a batch a claim.
        assert len(starts) <= RUNS // 2, starts
    else:
        assert len(starts) == RUNS, starts
    repo = StepsRepo(harness.db)
    for value, run_id in enumerate(run_ids):
        [step] = await repo.list(run_id)
        assert (step.key, step.status, step.output) == ("double", StepStatus.SUCCEEDED, 2 * value)
