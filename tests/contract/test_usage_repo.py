"""LLM usage on every backend: a step's usage written with its checkpoint, rolled up exactly.

The step's usage, its run's counters and its tenant's day (``llm_usage``) change in the
transaction of the checkpoint: a retried checkpoint counts nothing twice, a stale fence writes
nothing at all, and concurrent steps of many runs of one tenant add up to the exact sum.
"""

import asyncio
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import delete

from moorline.db.manager import DatabaseManager
from moorline.db.repos.queue import QueueRepo
from moorline.db.repos.records import Fence
from moorline.db.repos.runs import RunsRepo
from moorline.db.repos.steps import LeaseLost, StepsRepo
from moorline.db.repos.usage import Charge, UsageRepo, utc_day
from moorline.db.schema import llm_usage
from moorline.types import RunId, TenantId
from moorline.usage import ModelTotals
from tests.contract.queue_helpers import NO_CAP, Tenants, add_runs, set_lease_expiry, unique

TTL_S = 30.0
RUNS = 20
STEPS_PER_RUN = 3


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    async with db.transaction() as conn:
        for tenant_id in made.created:
            await conn.execute(delete(llm_usage).where(llm_usage.c.tenant_id == tenant_id))
    await made.purge()


def spent(model: str, prompt: int, completion: int, cached: int = 0) -> dict[str, ModelTotals]:
    return {
        model: ModelTotals(
            prompt_tokens=prompt,
            completion_tokens=completion,
            cached_tokens=cached,
            requests=1,
            cost=(prompt + completion) / 1e6,
        )
    }


async def claimed(db: DatabaseManager, tenant: TenantId, count: int) -> list[Fence]:
    lane = unique("usage")
    await add_runs(db, tenant, lane, count, workflow="wf")
    claims = await QueueRepo(db).claim_batch(
        lane, "worker", limit=count, lease_ttl_s=TTL_S, tenant_caps=NO_CAP
    )
    assert len(claims) == count
    return [claim.fence for claim in claims]


async def test_a_step_usage_rolls_up_to_its_run_and_tenant_day(
    db: DatabaseManager, tenants: Tenants
) -> None:
    tenant = await tenants.new()
    [fence] = await claimed(db, tenant, 1)
    steps_repo, usage = StepsRepo(db), UsageRepo(db)
    await steps_repo.start(fence, "a", "f", "h")
    charge = Charge(tenant_id=tenant, workflow="wf", spent=spent("m1", 100, 20, 40))
    await steps_repo.succeed(fence, "a", {"ok": 1}, charge=charge)
    # A retried checkpoint (its acknowledgement lost) finds it recorded and adds nothing.
    await steps_repo.succeed(fence, "a", {"ok": 1}, charge=charge)
    await steps_repo.start(fence, "b", "f", "h2")
    failing = Charge(tenant_id=tenant, workflow="wf", spent=spent("m2", 10, 0))
    await steps_repo.fail(fence, "b", "boom", charge=failing)
    await usage.add_saved(
        fence, Charge(tenant_id=tenant, workflow="wf", saved=spent("m1", 100, 20))
    )

    run = await RunsRepo(db).get(fence.run_id)
    assert run is not None
    assert (run.prompt_tokens, run.completion_tokens, run.cached_tokens) == (110, 20, 40)
    assert run.cost == pytest.approx(130 / 1e6)
    assert run.saved_tokens == 120
    assert run.saved_cost == pytest.approx(120 / 1e6)
    step = await steps_repo.get(fence.run_id, "a")
    assert step is not None and step.usage["m1"].prompt_tokens == 100
    by_model = await usage.run_by_model(fence.run_id)
    assert {m: (t.prompt_tokens, t.requests) for m, t in by_model.items()} == {
        "m1": (100, 1),
        "m2": (10, 1),
    }
    rows = {row.model: row for row in await usage.tenant_day(tenant, utc_day())}
    assert rows["m1"].totals.tokens == 120 and rows["m1"].saved_tokens == 120
    assert rows["m2"].totals.prompt_tokens == 10 and rows["m2"].workflow == "wf"
    totals = {model: row for _, model, row in await usage.totals()}
    assert totals["m1"].totals.prompt_tokens >= 100


async def test_a_stale_fence_counts_nothing(db: DatabaseManager, tenants: Tenants) -> None:
    tenant = await tenants.new()
    [fence] = await claimed(db, tenant, 1)
    steps_repo, usage = StepsRepo(db), UsageRepo(db)
    await steps_repo.start(fence, "a", "f", "h")
    await set_lease_expiry(db, [fence.run_id], -1.0)
    await QueueRepo(db).reap_expired(limit=100)
    charge = Charge(tenant_id=tenant, workflow="wf", spent=spent("m1", 100, 20))
    with pytest.raises(LeaseLost):
        await steps_repo.succeed(fence, "a", {"ok": 1}, charge=charge)
    with pytest.raises(LeaseLost):
        await usage.add_saved(fence, Charge(tenant_id=tenant, workflow="wf", saved=charge.spent))
    run = await RunsRepo(db).get(fence.run_id)
    assert run is not None and (run.prompt_tokens, run.saved_tokens) == (0, 0)
    assert await usage.tenant_day(tenant, utc_day()) == []


async def test_concurrent_steps_of_many_runs_add_up_exactly(
    db: DatabaseManager, tenants: Tenants
) -> None:
    tenant = await tenants.new()
    fences = await claimed(db, tenant, RUNS)
    steps_repo = StepsRepo(db)

    async def run_steps(index: int, fence: Fence) -> None:
        for n in range(STEPS_PER_RUN):
            key = f"llm:{n}"
            await steps_repo.start(fence, key, "f", key)
            charge = Charge(
                tenant_id=tenant, workflow="wf", spent=spent(f"m{n % 2}", index + n + 1, 7, 1)
            )
            await steps_repo.succeed(fence, key, None, charge=charge)

    await asyncio.gather(*(run_steps(i, fence) for i, fence in enumerate(fences)))
    expected_prompt = sum(i + n + 1 for i in range(RUNS) for n in range(STEPS_PER_RUN))
    rows = await UsageRepo(db).tenant_day(tenant, utc_day())
    assert sum(row.totals.prompt_tokens for row in rows) == expected_prompt
    assert sum(row.totals.completion_tokens for row in rows) == 7 * RUNS * STEPS_PER_RUN
    assert sum(row.totals.requests for row in rows) == RUNS * STEPS_PER_RUN
    runs_repo = RunsRepo(db)
    per_run = [await runs_repo.get(RunId(fence.run_id)) for fence in fences]
    assert sum(run.prompt_tokens for run in per_run if run is not None) == expected_prompt
