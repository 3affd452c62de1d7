"""Budget stores on every backend, and in Redis: charges add up exactly, days stay apart.

The database store runs on SQLite, PostgreSQL and MariaDB (the ``db`` fixture); the Redis
store beside it, under a key prefix of its own, whose every key must carry a TTL.
"""

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime

import pytest
from redis.asyncio import Redis

from moorline.db.manager import DatabaseManager
from moorline.dispatch.budgets import (
    BudgetStore,
    DatabaseBudgetStore,
    RedisBudgetStore,
    Spend,
    exhausted,
    to_micros,
)
from moorline.plans import DEFAULT_PLANS
from tests.contract.queue_helpers import Tenants
from tests.runtime.conftest import delete_keys, keys_under, keys_without_ttl
from tests.servers import REDIS_TEST_URL, require_server, unique_name

CHARGERS = 40
DAY = "2030-01-01"


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


@pytest.fixture(params=["database", "redis"])
async def budgets(
    request: pytest.FixtureRequest, db: DatabaseManager
) -> AsyncIterator[tuple[BudgetStore, Redis | None, str]]:
    if request.param == "database":
        yield DatabaseBudgetStore(db), None, ""
        return
    require_server("redis")
    client = Redis.from_url(REDIS_TEST_URL, decode_responses=True)
    prefix = unique_name("mo_budget")
    # The day's TTL is counted from this clock: a day in 2030 must still get a finite one.
    store = RedisBudgetStore(
        REDIS_TEST_URL, prefix=prefix, clock=lambda: datetime(2030, 1, 1, 12, tzinfo=UTC)
    )
    try:
        yield store, client, prefix
        assert await keys_without_ttl(client, prefix) == []
    finally:
        await store.close()
        await delete_keys(client, prefix)
        await client.aclose()


async def test_concurrent_charges_add_up_exactly(
    budgets: tuple[BudgetStore, Redis | None, str], tenants: Tenants
) -> None:
    store, client, prefix = budgets
    tenant = await tenants.new()
    assert await store.spent(tenant, DAY) == Spend(0, 0)
    await asyncio.gather(
        *(store.charge(tenant, DAY, 100 + i, to_micros(0.001 * i)) for i in range(CHARGERS))
    )
    tokens = sum(100 + i for i in range(CHARGERS))
    micros = sum(to_micros(0.001 * i) for i in range(CHARGERS))
    assert await store.spent(tenant, DAY) == Spend(tokens, micros)
    # Another day, another tenant: spend of their own.
    assert await store.spent(tenant, "2030-01-02") == Spend(0, 0)
    other = await tenants.new()
    after = await store.charge(other, DAY, 7, 0)
    assert after == Spend(7, 0)
    assert (await store.spent(tenant, DAY)).tokens == tokens
    if client is not None:
        keys = await keys_under(client, prefix)
        assert keys and all(":budget:" in key and "{tenant:" in key for key in keys)
        ttl_ms = await client.pttl(keys[0])
        # The day's remaining 12 h plus the margin, never more.
        assert 0 < ttl_ms <= (12 + 1) * 3600 * 1000


def test_a_budget_is_exhausted_at_its_limit_not_before() -> None:
    plan = DEFAULT_PLANS["team"]
    assert exhausted(plan, Spend(10**9, 10**12)) is None  # no budget: never exhausted
    tokens = replace(plan, daily_tokens=1000)
    assert exhausted(tokens, Spend(999, 0)) is None
    assert "budget of 1000 tokens" in (exhausted(tokens, Spend(1000, 0)) or "")
    cost = replace(plan, daily_cost=2.5)
    assert exhausted(cost, Spend(0, to_micros(2.49))) is None
    assert "cost budget of 2.5" in (exhausted(cost, Spend(0, to_micros(2.5))) or "")
