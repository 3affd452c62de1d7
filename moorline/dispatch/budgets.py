"""Daily budgets: the model tokens and cost a tenant may spend per UTC day.

Here, below admission and the worker, because both use it.

A plan may set ``daily_tokens`` and ``daily_cost`` (:class:`~moorline.plans.Plan`). Spend is
charged *after* each model call with the usage the provider reported, and checked *before*:

- admission refuses a new run of a tenant whose budget is spent (429 ``budget_exhausted``,
  ``Retry-After`` to 00:00 UTC; nothing is stored, :meth:`Admission.admit
  <moorline.admission.admit.Admission.admit>`);
- a model call that would start after it is spent raises
  :class:`~moorline.errors.BudgetExceeded` in the workflow (:mod:`moorline.worker.governor`).

A call is refused when ``spent >= budget``, so the overshoot is bounded by the calls already
in flight when the budget ran out: at most (calls in flight) * (their prompt + ``max_tokens``)
tokens, and the cost of those tokens. A stream in progress is never cut off.

Two stores, one per deployment shape, behind :class:`BudgetStore`:

- :class:`RedisBudgetStore` (``MOORLINE_REDIS_URL`` set): one hash per tenant and day,
  ``<prefix>:{tenant:<id>}:budget:<YYYY-MM-DD>`` (``tokens``, ``cost_micros``), changed only by
  the Lua script ``charge_budget``, which sets the expiry in the same atomic step as the
  increments: no counter is ever without an expiry.
- :class:`DatabaseBudgetStore`: the ``budget_spend`` table, one row per tenant, day and kind,
  added to by one upsert (the backend's ``add_to_counters``), atomic on every backend.

Cost is counted in integer micro-units (a millionth of the price unit), so that both stores
add exactly and no float drifts across processes.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from sqlalchemy import select

from moorline.db.manager import DatabaseManager
from moorline.db.schema import budget_spend
from moorline.dispatch.days import counter_ttl_ms
from moorline.errors import BackendUnavailable, ConfigError
from moorline.plans import Plan
from moorline.runtime.keys import RedisKeys
from moorline.settings import Settings
from moorline.types import TenantId

REDIS_CONNECTIONS = 20
"""Connections of one process's budget store."""

MICROS = 1_000_000
"""Micro-units of cost per price unit."""

TOKENS = "tokens"
COST_MICROS = "cost_micros"


@dataclass(frozen=True, slots=True)
class Spend:
    """What a tenant spent on one UTC day."""

    tokens: int = 0
    cost_micros: int = 0

    @property
    def cost(self) -> float:
        """The cost in the price unit."""
        return self.cost_micros / MICROS


def to_micros(cost: float) -> int:
    """A cost in whole micro-units, rounded up (never under-counted)."""
    return max(0, math.ceil(cost * MICROS - 1e-6))


def exhausted(plan: Plan, spend: Spend) -> str | None:
    """Why ``plan``'s budget is spent by ``spend``, as a sentence; None while it is not."""
    if plan.daily_tokens is not None and spend.tokens >= plan.daily_tokens:
        # Not "token budget": error texts are redacted, and "Token <word>" reads as a credential.
        return f"daily budget of {plan.daily_tokens} tokens is spent ({spend.tokens} used)"
    if plan.daily_cost is not None and spend.cost_micros >= to_micros(plan.daily_cost):
        return f"daily cost budget of {plan.daily_cost:g} is spent ({spend.cost:g} used)"
    return None


class BudgetStore(Protocol):
    """Per-tenant daily spend, added to atomically by any number of processes."""

    async def spent(self, tenant_id: TenantId, day: str) -> Spend:
        """The tenant's spend on ``day``.

        Raises:
            BackendUnavailable: the store did not answer.
        """
        ...

    async def charge(self, tenant_id: TenantId, day: str, tokens: int, cost_micros: int) -> Spend:
        """Add one call's spend to ``day``; returns the day's spend after it."""
        ...

    async def close(self) -> None:
        """Release connections; idempotent."""
        ...


class DatabaseBudgetStore(BudgetStore):
    """Spend in the ``budget_spend`` table (deployments without Redis)."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db

    async def spent(self, tenant_id: TenantId, day: str) -> Spend:
        table = budget_spend.c
        stmt = select(table.kind, table.amount).where(
            table.tenant_id == tenant_id, table.day == day
        )

        async def read() -> Spend:
            async with self._db.connect() as conn:
                amounts = {row.kind: int(row.amount) for row in await conn.execute(stmt)}
            return Spend(amounts.get(TOKENS, 0), amounts.get(COST_MICROS, 0))

        return await self._db.with_retry(read)

    async def charge(self, tenant_id: TenantId, day: str, tokens: int, cost_micros: int) -> Spend:
        # One upsert adds both kinds (INSERT … ON CONFLICT/DUPLICATE KEY UPDATE amount + new):
        # atomic per row on every backend, so concurrent charges never lose an addition. Not
        # retried: a retry after a lost acknowledgement would charge twice.
        upsert = self._db.backend.add_to_counters(
            budget_spend, keys=("tenant_id", "day", "kind"), columns=("amount",)
        )
        rows = [
            {"tenant_id": tenant_id, "day": day, "kind": TOKENS, "amount": tokens},
            {"tenant_id": tenant_id, "day": day, "kind": COST_MICROS, "amount": cost_micros},
        ]
        async with self._db.write_transaction() as conn:
            await conn.execute(upsert.values(rows))
        return await self.spent(tenant_id, day)

    async def close(self) -> None:
        return None


class RedisBudgetStore(BudgetStore):
    """Spend in Redis: one hash per tenant and day, with a TTL from the moment it exists."""

    def __init__(
        self, url: str, *, prefix: str = "mo", clock: Callable[[], datetime] | None = None
    ) -> None:
        """Create the store; nothing connects before the first command.

        Raises:
            ConfigError: the ``redis`` package is not installed.
        """
        try:
            from redis.exceptions import RedisError

            from moorline.runtime.redis import load_script
            from moorline.runtime.redis_client import RedisConnector
        except ImportError:  # pragma: no cover - the test environment installs every extra
            raise ConfigError(
                "MOORLINE_REDIS_URL: the redis package is missing; install moorline[redis]"
            ) from None
        # One server, Sentinel or Cluster: the day's counters of a tenant are one hash.
        self._client = RedisConnector(url).client(
            decode_responses=True, max_connections=REDIS_CONNECTIONS
        )
        self._redis_error = RedisError
        self.keys = RedisKeys(prefix)
        self._clock = clock or (lambda: datetime.now(UTC))
        self._charge = self._client.register_script(load_script("charge_budget"))

    async def spent(self, tenant_id: TenantId, day: str) -> Spend:
        try:
            tokens, cost = await self._client.hmget(
                self.keys.budget(tenant_id, day), [TOKENS, COST_MICROS]
            )
        except self._redis_error as exc:
            raise BackendUnavailable(f"Redis budget store: {exc}") from exc
        return Spend(int(tokens or 0), int(cost or 0))

    async def charge(self, tenant_id: TenantId, day: str, tokens: int, cost_micros: int) -> Spend:
        try:
            after = await self._charge(
                keys=[self.keys.budget(tenant_id, day)],
                args=[tokens, cost_micros, counter_ttl_ms(day, self._clock())],
            )
        except self._redis_error as exc:
            raise BackendUnavailable(f"Redis budget store: {exc}") from exc
        return Spend(int(after[0]), int(after[1]))

    async def close(self) -> None:
        await self._client.aclose()


def make_budget_store(settings: Settings, db: DatabaseManager) -> BudgetStore:
    """Redis hashes when ``MOORLINE_REDIS_URL`` is set, else the database's table."""
    if settings.redis_url:
        return RedisBudgetStore(settings.redis_url, prefix=settings.redis_prefix)
    return DatabaseBudgetStore(db)
