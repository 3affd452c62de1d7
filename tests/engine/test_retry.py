"""A retried run resumes at the step that failed, with a fresh attempt budget, on every backend.

A real Worker executes the run; side-effect counters show which step functions were called.
"""

from collections.abc import AsyncIterator

import pytest

from moorline import Context
from moorline.db.manager import DatabaseManager
from moorline.db.repos.runs import NewRun
from moorline.errors import RunNotFound, RunNotRetryable
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.types import JSONValue, RunId, RunStatus
from tests.contract.queue_helpers import Tenants
from tests.engine.harness import EngineHarness


@pytest.fixture
async def harness(db: DatabaseManager) -> AsyncIterator[EngineHarness]:
    tenants = Tenants(db)
    store = InMemoryRuntimeStore()
    yield EngineHarness(db, store, tenants)
    await store.close()
    await tenants.purge()


async def test_a_retried_run_resumes_at_its_failed_step_with_a_fresh_budget(
    harness: EngineHarness,
) -> None:
    calls = {"fetch": 0, "post": 0, "notify": 0}
    broken = True

    def fetch() -> str:
        calls["fetch"] += 1
        return "page"

    def post(page: str) -> str:
        calls["post"] += 1
        if broken:
            raise RuntimeError("the service is down")
        return f"posted {page}"

    def notify() -> str:
        calls["notify"] += 1
        return "told"

    @harness.app.workflow("flaky", max_attempts=2)
    async def flaky(ctx: Context) -> JSONValue:
        page = await ctx.step("fetch", fetch)
        posted = await ctx.step("post", post, page)
        return [posted, await ctx.step("notify", notify)]

    harness.tenant = await harness.tenants.new()
    [stored] = await harness.runs.submit_many(
        [
            NewRun(
                tenant_id=harness.tenant,
                workflow="flaky",
                input={},
                lane=harness.lane,
                max_attempts=2,
            )
        ]
    )
    run_id = stored.run_id
    async with harness.worker():
        await harness.until_status(run_id, RunStatus.FAILED)
        assert calls == {"fetch": 1, "post": 2, "notify": 0}  # two attempts, its budget

        # Still broken: the retry gets two attempts more (a fresh budget), and replays fetch.
        retried = await harness.runs.retry(run_id, tenant_id=harness.tenant)
        assert (retried.status, retried.error, retried.resumes) == (RunStatus.QUEUED, None, 2)
        await harness.until_status(run_id, RunStatus.FAILED)
        assert calls == {"fetch": 1, "post": 4, "notify": 0}

        broken = False
        await harness.runs.retry(run_id, tenant_id=harness.tenant)
        await harness.until_status(run_id, RunStatus.SUCCEEDED)

    assert calls == {"fetch": 1, "post": 5, "notify": 1}  # fetch never called again
    run = await harness.runs.get(run_id)
    assert run is not None and run.output == ["posted page", "told"]
    assert run.attempt == 5 and run.finished_at is not None
    retried_events = await harness.stored(run_id, "retried")
    data = [e.data for e in retried_events]
    assert [d["previous_status"] for d in data if isinstance(d, dict)] == ["failed", "failed"]
    assert isinstance(data[0], dict) and isinstance(data[0]["error"], dict)
    assert data[0]["error"]["message"] == "the service is down"


async def test_only_a_failed_or_timed_out_run_of_the_tenant_can_be_retried(
    harness: EngineHarness,
) -> None:
    @harness.app.workflow("quick")
    async def quick(ctx: Context) -> JSONValue:
        return "done"

    run_id = await harness.new_run("quick")
    assert harness.tenant is not None
    with pytest.raises(RunNotRetryable, match="is queued"):
        await harness.runs.retry(run_id, tenant_id=harness.tenant)
    async with harness.worker():
        await harness.until_status(run_id, RunStatus.SUCCEEDED)
    with pytest.raises(RunNotRetryable, match="is succeeded"):
        await harness.runs.retry(run_id)
    other = await harness.tenants.new()
    with pytest.raises(RunNotFound):
        await harness.runs.retry(run_id, tenant_id=other)
    with pytest.raises(RunNotFound):
        await harness.runs.retry(RunId("no-such-run"))
    assert await harness.stored(run_id, "retried") == []
