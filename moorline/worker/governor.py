"""The worker's model-call hook: daily budgets and the shared provider limiter.

:class:`Governor` is the :class:`~moorline.llm.governance.CallHook` the worker's runner installs
for every run it executes, so each model call of a workflow is:

1. **refused** with :class:`~moorline.errors.BudgetExceeded` when its tenant's plan has a
   ``daily_tokens`` / ``daily_cost`` budget and today's spend has reached it
   (:mod:`moorline.dispatch.budgets`; the run then fails with reason ``budget``);
2. **admitted by the provider limiter** (:mod:`moorline.llm.limiter`) when its model declares
   limits: it waits for a request and its estimated tokens, fairly between tenants weighted by
   the run's priority (its plan's); a wait longer than ``park_after`` parks the run instead
   (:class:`~moorline.llm.limiter.CapacityWait`, let through to the call);
3. **settled** afterwards: the limiter's reservation is corrected by the real usage, and the
   usage (and its cost, from ``price``) is charged to the tenant's day.

A provider 429 pauses the model in the limiter, which every worker sharing it honours.

Inputs the models file provides are narrow callables, so whoever loads that file wires them:
``limits`` (model → :class:`~moorline.llm.limiter.ModelLimits` or None) and ``price``
(model, usage → cost). ``on_usage`` is called after every call (usage recording).
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from moorline.concurrency import TTLCache
from moorline.db.manager import DatabaseManager
from moorline.db.repos.tenants import TenantsRepo
from moorline.dispatch.budgets import BudgetStore, exhausted, make_budget_store, to_micros
from moorline.dispatch.days import quota_day
from moorline.errors import BudgetExceeded, ConfigError
from moorline.llm.governance import CallHook, CallRequest
from moorline.llm.limiter import MemoryLimiter, ModelLimits, ProviderLimiter, RedisLimiter
from moorline.llm.models import ModelsProvider
from moorline.plans import Plan, PlansProvider
from moorline.runtime.keys import RedisKeys
from moorline.settings import Settings
from moorline.types import TenantId
from moorline.usage import Usage

logger = logging.getLogger(__name__)

PLAN_TTL_S = 5.0
"""Seconds a tenant's plan, as read for its budget, is trusted (as the plans file's TTL)."""

Limits = Callable[[str], Awaitable[ModelLimits | None]]
"""Model → its declared provider limits, or None (the limiter is not used for it). Async, so
that a TTL-cached models file (re-read in a thread) can answer it."""

Pricing = Callable[[str, Usage], Awaitable[float]]
"""Model and usage → the call's cost, in the unit of the plans' ``daily_cost``."""

UsageSink = Callable[[CallRequest, Usage | None], Awaitable[None]]
"""Told of every finished call and its usage (None: the provider reported none)."""


async def no_limits(_model: str) -> ModelLimits | None:
    """The default :data:`Limits`: no model declares any."""
    return None


class Governor(CallHook):
    """Budgets, provider limits and usage around every model call of the worker's runs.

    Args:
        budgets: The daily spend (Redis or the database).
        plan_of: Tenant → its plan (None: unknown tenant, no budget applies).
        limiter: The provider limiter; None: no model is limited.
        limits: Model → declared limits (:data:`Limits`).
        price: Model and usage → cost; None: calls cost 0 (only ``daily_tokens`` bites).
        on_usage: Told of every finished call (:data:`UsageSink`).
        clock: Aware UTC "now" (the budget's day), replaceable in tests.
    """

    def __init__(
        self,
        *,
        budgets: BudgetStore,
        plan_of: Callable[[TenantId], Awaitable[Plan | None]],
        limiter: ProviderLimiter | None = None,
        limits: Limits = no_limits,
        price: Pricing | None = None,
        on_usage: UsageSink | None = None,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        self._budgets = budgets
        self._plan_of = plan_of
        self._limiter = limiter
        self._limits = limits
        self._price = price
        self._on_usage = on_usage
        self._clock = clock or (lambda: datetime.now(UTC))

    def _day(self) -> str:
        return quota_day(self._clock())

    async def _limited(self, model: str) -> ModelLimits | None:
        if self._limiter is None:
            return None
        limits = await self._limits(model)
        return limits if limits is not None and limits.declared else None

    async def before(self, request: CallRequest) -> None:
        tenant_id = TenantId(request.caller.tenant_id)
        plan = await self._plan_of(tenant_id)
        if plan is not None and plan.has_budget:
            why = exhausted(plan, await self._budgets.spent(tenant_id, self._day()))
            if why is not None:
                raise BudgetExceeded(
                    f"model {request.model!r} not called: tenant {tenant_id}'s {why}; "
                    "it resets at 00:00 UTC"
                )
        limits = await self._limited(request.model)
        if limits is not None and self._limiter is not None:
            waited_s = await self._limiter.acquire(
                request.model,
                limits,
                tenant=request.caller.tenant_id,
                weight=request.caller.weight,
                tokens=request.estimated_tokens,
                park_after_s=request.park_after_s,
            )
            if waited_s > 1.0:
                logger.debug("model %s: waited %.1fs for capacity", request.model, waited_s)

    async def rate_limited(self, request: CallRequest, retry_after_s: float) -> None:
        if self._limiter is not None and await self._limited(request.model) is not None:
            logger.info("model %s answered 429: paused %.1fs", request.model, retry_after_s)
            await self._limiter.pause(request.model, retry_after_s)

    async def after(self, request: CallRequest, usage: Usage | None) -> None:
        # The limiter's correction and the budget's charge are independent round trips: sent
        # together, the call's end waits for the slower one only.
        await asyncio.gather(self._settle(request, usage), self._charge(request, usage))
        if self._on_usage is not None:
            await self._on_usage(request, usage)

    async def _settle(self, request: CallRequest, usage: Usage | None) -> None:
        limits = await self._limited(request.model)
        if limits is not None and self._limiter is not None:
            used = request.estimated_tokens if usage is None else usage.tokens
            await self._limiter.settle(request.model, request.estimated_tokens, used)

    async def _charge(self, request: CallRequest, usage: Usage | None) -> None:
        """Charge the call's usage to its tenant's day (not retried: it could count twice)."""
        if usage is not None and usage.tokens > 0:
            cost = 0.0 if self._price is None else await self._price(request.model, usage)
            await self._budgets.charge(
                TenantId(request.caller.tenant_id), self._day(), usage.tokens, to_micros(cost)
            )

    async def close(self) -> None:
        """Release the budget store's and the limiter's connections."""
        await self._budgets.close()
        if self._limiter is not None:
            await self._limiter.close()


def make_limiter(settings: Settings) -> ProviderLimiter:
    """The provider limiter of this deployment: in Redis when configured, else in memory.

    Raises:
        ConfigError: Redis is configured but the ``redis`` package is missing.
    """
    if not settings.redis_url:
        return ProviderLimiter(MemoryLimiter())
    try:
        from moorline.runtime.redis_client import RedisConnector
    except ImportError:  # pragma: no cover - the test environment installs every extra
        raise ConfigError(
            "MOORLINE_REDIS_URL: the redis package is missing; install moorline[redis]"
        ) from None
    # One server, Sentinel or Cluster: a model's limiter keys share one hash tag.
    client = RedisConnector(settings.redis_url).client(decode_responses=True)
    return ProviderLimiter(RedisLimiter(client, RedisKeys(settings.redis_prefix).limiter))


def declared_limits(models: ModelsProvider) -> Limits:
    """The limits the models file declares for a model (None: it declares neither)."""

    async def limits(model: str) -> ModelLimits | None:
        entry = await models.get(model)
        if entry.rpm is None and entry.tpm is None:
            return None
        return ModelLimits(rpm=entry.rpm, tpm=entry.tpm)

    return limits


def priced(models: ModelsProvider) -> Pricing:
    """A call's cost from the models file's prices (0 for a model it does not list)."""

    async def price(model: str, usage: Usage) -> float:
        entry = await models.get(model)
        return entry.cost(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)

    return price


def make_governor(
    settings: Settings,
    db: DatabaseManager,
    plans: PlansProvider,
    *,
    limits: Limits = no_limits,
    price: Pricing | None = None,
    on_usage: UsageSink | None = None,
    models: ModelsProvider | None = None,
) -> Governor:
    """The governor of a worker process, its stores chosen by the settings (Redis or not).

    With ``models`` (the models file), the limits and prices are its entries' ``rpm``/``tpm``
    and prices, unless ``limits`` or ``price`` are given.

    A tenant's plan is read through a :class:`~moorline.concurrency.TTLCache`, so a call pays
    no database read for it more than once per :data:`PLAN_TTL_S` and tenant.
    """
    tenants = TenantsRepo(db)

    async def load(tenant_id: TenantId) -> Plan | None:
        tenant = await tenants.get(tenant_id)
        if tenant is None:
            return None
        current = await plans.plans()
        return current.get(tenant.plan)

    cache: TTLCache[TenantId, Plan | None] = TTLCache(
        load, ttl_s=PLAN_TTL_S, name="tenant plans", max_entries=10_000
    )
    if models is not None:
        limits = limits if limits is not no_limits else declared_limits(models)
        price = price if price is not None else priced(models)
    return Governor(
        budgets=make_budget_store(settings, db),
        plan_of=cache.get,
        limiter=make_limiter(settings),
        limits=limits,
        price=price,
        on_usage=on_usage,
    )
