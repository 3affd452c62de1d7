"""Budgets inside runs: a spent budget fails the run at its next model call, reason ``budget``.

Real Workers execute workflows that ask the simulated model through the worker's
:class:`~moorline.worker.governor.Governor`, on every backend with the database's budget store
and with Redis's. Concurrent runs of one tenant overshoot its ``daily_tokens`` by no more than
the calls in flight when it ran out (docs/design.md states the bound); another tenant runs on.
"""

from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from moorline import Context
from moorline.db.manager import DatabaseManager
from moorline.dispatch.budgets import BudgetStore, DatabaseBudgetStore, RedisBudgetStore
from moorline.errors import BudgetExceeded
from moorline.llm import Message, SimulatedLLM, complete
from moorline.llm.governance import Caller, CallRequest
from moorline.plans import DEFAULT_PLANS, Plan
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.types import JSONValue, RunId, RunStatus, TenantId
from moorline.usage import Usage
from moorline.worker.governor import Governor
from tests.contract.queue_helpers import Tenants
from tests.engine.harness import EngineHarness
from tests.helpers import FULL_SIZE, wait_for
from tests.runtime.conftest import delete_keys, keys_without_ttl
from tests.servers import REDIS_TEST_URL, require_server, unique_name

RUNS = 50 if FULL_SIZE else 12
CALLS_PER_RUN = 4
SLOTS = 6
BUDGET_TOKENS = 600


def today() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d")


@pytest.fixture(params=["database", "redis"])
async def budgets(
    request: pytest.FixtureRequest, db: DatabaseManager
) -> AsyncIterator[BudgetStore]:
    if request.param == "database":
        yield DatabaseBudgetStore(db)
        return
    require_server("redis")
    from redis.asyncio import Redis

    client = Redis.from_url(REDIS_TEST_URL, decode_responses=True)
    prefix = unique_name("mo_budgetrun")
    store = RedisBudgetStore(REDIS_TEST_URL, prefix=prefix)
    try:
        yield store
        assert await keys_without_ttl(client, prefix) == []
    finally:
        await store.close()
        await delete_keys(client, prefix)
        await client.aclose()


class Calls:
    """The governor's usage sink: every finished call's tenant and tokens."""

    def __init__(self) -> None:
        self.usage: list[tuple[str, int]] = []

    async def __call__(self, request: CallRequest, usage: Usage | None) -> None:
        self.usage.append((request.caller.tenant_id, 0 if usage is None else usage.tokens))


@pytest.fixture
async def harness(db: DatabaseManager) -> AsyncIterator[EngineHarness]:
    tenants = Tenants(db)
    store = InMemoryRuntimeStore()
    yield EngineHarness(db, store, tenants)
    await store.close()
    await tenants.purge()


def govern(
    harness: EngineHarness, budgets: BudgetStore, plans: dict[TenantId, Plan], calls: Calls
) -> None:
    async def plan_of(tenant_id: TenantId) -> Plan | None:
        return plans.get(tenant_id)

    harness.use_call_hook(Governor(budgets=budgets, plan_of=plan_of, on_usage=calls))


def register_chat(harness: EngineHarness) -> None:
    llm = SimulatedLLM(first_token_s=0.01, word_interval_s=0.0)

    @harness.app.workflow("chat", max_attempts=3)
    async def chat(ctx: Context, turns: int = CALLS_PER_RUN) -> JSONValue:
        replies: list[JSONValue] = []
        for turn in range(turns):
            reply = await complete(llm, [Message.user(f"turn {turn} of {ctx.run_id}")])
            replies.append(reply.text[:10])
        return replies


async def submit(harness: EngineHarness, tenant: TenantId, count: int) -> list[RunId]:
    harness.tenant = tenant
    return [await harness.new_run("chat") for _ in range(count)]


async def finished(harness: EngineHarness, run_ids: list[RunId]) -> None:
    async def done() -> bool:
        statuses = [await harness.status(run_id) for run_id in run_ids]
        return all(status in (RunStatus.SUCCEEDED, RunStatus.FAILED) for status in statuses)

    await wait_for(done, timeout_s=60, message="every run to finish")


async def test_a_spent_budget_fails_the_run_with_reason_budget_without_a_retry(
    harness: EngineHarness, budgets: BudgetStore
) -> None:
    tenant = await harness.tenants.new()
    plan = replace(DEFAULT_PLANS["team"], daily_tokens=100)
    calls = Calls()
    govern(harness, budgets, {tenant: plan}, calls)
    register_chat(harness)
    await budgets.charge(tenant, today(), 100, 0)
    [run_id] = await submit(harness, tenant, 1)
    async with harness.worker():
        await harness.until_status(run_id, RunStatus.FAILED)
    run = await harness.runs.get(run_id)
    assert run is not None and isinstance(run.error, dict)
    assert (run.error["type"], run.error["reason"]) == ("BudgetExceeded", "budget")
    assert "daily budget of 100 tokens" in str(run.error["message"])
    assert run.attempt == 1  # not retried, though the workflow allows 3 attempts
    assert calls.usage == []  # the model was never called


async def test_concurrent_runs_overshoot_by_at_most_the_calls_in_flight(
    harness: EngineHarness, budgets: BudgetStore
) -> None:
    spender, other = await harness.tenants.new(), await harness.tenants.new()
    plan = replace(DEFAULT_PLANS["team"], daily_tokens=BUDGET_TOKENS)
    calls = Calls()
    govern(harness, budgets, {spender: plan, other: plan}, calls)
    register_chat(harness)
    spending = await submit(harness, spender, RUNS)
    async with harness.worker(slots=SLOTS):
        await finished(harness, spending)
        # The other tenant's budget is its own: its run succeeds after the first ran out.
        [calm] = await submit(harness, other, 1)
        await harness.until_status(calm, RunStatus.SUCCEEDED)
    statuses = [await harness.status(run_id) for run_id in spending]
    assert RunStatus.FAILED in statuses  # the budget ran out before every run was done
    spent = (await budgets.spent(spender, today())).tokens
    largest_call = max(total for tenant, total in calls.usage if tenant == spender)
    # A call starts only while spent < budget; at most one call per slot is in flight then.
    assert BUDGET_TOKENS <= spent <= BUDGET_TOKENS + SLOTS * largest_call
    assert spent == sum(total for tenant, total in calls.usage if tenant == spender)
    for run_id in spending:
        run = await harness.runs.get(run_id)
        assert run is not None
        if run.status is RunStatus.FAILED:
            assert isinstance(run.error, dict) and run.error["reason"] == "budget"
    assert (await budgets.spent(other, today())).tokens > 0


async def test_calls_are_charged_their_price_and_a_cost_budget_refuses_the_next(
    harness: EngineHarness, budgets: BudgetStore
) -> None:
    tenant = await harness.tenants.new()
    plan = replace(DEFAULT_PLANS["team"], daily_cost=0.01)

    async def plan_of(_tenant_id: TenantId) -> Plan | None:
        return plan

    async def price(model: str, usage: Usage) -> float:
        # 1 per million prompt tokens, 4 per million completion tokens.
        return (usage.prompt_tokens * 1 + usage.completion_tokens * 4) / 1_000_000

    governor = Governor(budgets=budgets, plan_of=plan_of, price=price)
    request = CallRequest(
        model="priced", caller=Caller(tenant_id=tenant, weight=50), estimated_tokens=10
    )
    await governor.before(request)
    await governor.after(
        request, Usage(model=request.model, prompt_tokens=2000, completion_tokens=1500)
    )
    spend = await budgets.spent(tenant, today())
    assert (spend.tokens, spend.cost_micros) == (3500, 2000 + 6000)
    await governor.before(request)  # 0.008 of 0.01: the next call may start
    await governor.after(
        request, Usage(model=request.model, prompt_tokens=2000, completion_tokens=0)
    )
    with pytest.raises(BudgetExceeded, match=r"cost budget of 0\.01 is spent"):
        await governor.before(request)
