"""A tenant whose daily model budget is spent is refused 429 ``budget_exhausted``.

On both deployment shapes (SQLite with the budget in the database; PostgreSQL with Redis):
the refusal carries ``Retry-After`` up to 00:00 UTC, stores no run and takes no quota unit;
a tenant of the same plan with budget left is admitted.
"""

import math
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from redis.asyncio import Redis

from moorline.dispatch.budgets import BudgetStore, DatabaseBudgetStore, RedisBudgetStore
from moorline.types import TenantId
from tests.api.conftest import PLANS_YAML, MakeApi
from tests.conftest import CAPABILITIES
from tests.runtime.conftest import delete_keys, keys_without_ttl
from tests.servers import REDIS_TEST_URL, require_server, unique_name

BUDGETED_PLANS = (
    PLANS_YAML
    + """
  metered:
    lane: workflow_team
    priority: 50
    daily_quota: 500
    rate_limit: "100000/second"
    tenant_concurrency: 4
    lane_slots: 4
    daily_tokens: 1000
    daily_cost: 2.5
"""
)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def api_database_url(database_url: str) -> str:
    return database_url


@pytest.fixture
async def redis_settings(backend: str) -> AsyncIterator[dict[str, str]]:
    """Redis under a prefix of its own for the server backend; nothing for the embedded one."""
    if "server" not in CAPABILITIES[backend]:
        yield {}
        return
    require_server("redis")
    client = Redis.from_url(REDIS_TEST_URL, decode_responses=True)
    prefix = unique_name("mo_budgetapi")
    try:
        yield {"redis_url": REDIS_TEST_URL, "redis_prefix": prefix}
        assert await keys_without_ttl(client, prefix) == []
    finally:
        await delete_keys(client, prefix)
        await client.aclose()


@pytest.fixture
def plans_file(tmp_path: Path) -> Path:
    path = tmp_path / "budgeted-plans.yaml"
    path.write_text(BUDGETED_PLANS, encoding="utf-8")
    return path


async def test_a_spent_budget_refuses_new_runs_until_midnight(
    make_api: MakeApi, redis_settings: dict[str, str], plans_file: Path
) -> None:
    async with make_api(plans_file=plans_file, **redis_settings) as api:
        spender = await api.tenant("metered")
        neighbour = await api.tenant("metered")
        store: BudgetStore = (
            RedisBudgetStore(REDIS_TEST_URL, prefix=redis_settings["redis_prefix"])
            if redis_settings
            else DatabaseBudgetStore(api.db)
        )
        try:
            day = datetime.now(UTC).strftime("%Y-%m-%d")
            await store.charge(TenantId(spender.tenant_id), day, 999, 0)
            assert (await api.trigger(spender)).status_code == 202  # 999 < 1000: not yet
            await store.charge(TenantId(spender.tenant_id), day, 1, 0)
            now = datetime.now(UTC)
            refused = await api.trigger(spender)
            # The cost budget refuses too, on its own.
            await store.charge(TenantId(neighbour.tenant_id), day, 0, 2_500_000)
            cost_refused = await api.trigger(neighbour)
        finally:
            await store.close()
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "budget_exhausted"
        assert "budget of 1000 tokens is spent" in error["message"]
        midnight = datetime.combine(now.date() + timedelta(days=1), datetime.min.time(), UTC)
        expected = math.ceil((midnight - now).total_seconds())
        retry_after = int(refused.headers["Retry-After"])
        assert abs(retry_after - expected) <= 2
        assert error["retry_after_s"] == retry_after
        assert cost_refused.status_code == 429
        assert "cost budget of 2.5" in cost_refused.json()["error"]["message"]
        # A batch's items are refused alike, each on its own.
        batch = await api.client.post(
            "/v1/workflows/echo/runs/batch",
            json={"runs": [{"input": {}}, {"input": {}, "idempotency_key": "k"}, {"input": {}}]},
            headers=spender.headers,
        )
        assert batch.status_code == 200, batch.text
        codes = [item["error"]["code"] for item in batch.json()["results"]]
        assert codes == ["budget_exhausted"] * 3
        # Nothing stored for the refusals, and no quota unit taken.
        assert await api.count_runs(spender) == 1
        usage = (await api.client.get("/v1/usage", headers=spender.headers)).json()
        assert usage["used_today"] == 1
        # A tenant of a plan without a budget is not asked about one.
        free = await api.tenant("team")
        assert (await api.trigger(free)).status_code == 202


async def test_the_openapi_document_names_budget_exhausted(make_api: MakeApi) -> None:
    async with make_api() as api:
        document = (await api.client.get("/openapi.json")).json()
    trigger = document["paths"]["/v1/workflows/{workflow}/runs"]["post"]
    assert "`budget_exhausted`" in trigger["responses"]["429"]["description"]
