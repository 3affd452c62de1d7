"""Daily quotas: how many runs a tenant may start per UTC day, counted atomically.

A unit is taken when a run is admitted and given back when the run could not be stored after
all. Two stores keep the counters, one per deployment shape, behind :class:`QuotaStore`:

- :class:`RedisQuotaStore` (``MOORLINE_REDIS_URL`` set): one counter per tenant and day,
  ``<prefix>:{tenant:<id>}:quota:<YYYY-MM-DD>``, changed only by the Lua scripts
  ``consume_quota`` and ``release_quota``. The counter is created with its expiry in the same
  atomic step as the first increment, so no client dying between two commands can leave a
  counter without a TTL (docs/reliability.md F1), and a release never recreates an expired one.
- :class:`DatabaseQuotaStore` (no Redis): the ``quota_usage`` table through
  :class:`~moorline.db.repos.quotas.QuotasRepo`, whose conditional UPDATE is just as atomic.
  Built by :func:`make_quota_store` it is *taken with runs*: admission does not consume a unit
  in a transaction of its own but hands the run's
  :class:`~moorline.db.repos.quotas.QuotaClaim` to the Submitter, whose batch transaction takes
  the units and stores the runs together (one transaction for many triggers instead of one per
  trigger, and a unit can never be taken without its run being stored, nor the reverse).

Both refuse the unit that would pass the limit, whatever the concurrency, so "exactly the
quota" holds for any number of API processes. Days are UTC and come from the API process's
clock; the quota resets at 00:00 UTC.
"""

from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

from moorline.db.manager import DatabaseManager
from moorline.db.repos.quotas import QuotaClaim, QuotasRepo
from moorline.dispatch.days import counter_ttl_ms
from moorline.errors import BackendUnavailable, ConfigError
from moorline.runtime.keys import RedisKeys
from moorline.settings import Settings
from moorline.types import TenantId

if TYPE_CHECKING:
    from moorline.runtime.redis import ScriptCall

REDIS_CONNECTIONS = 50
"""Connections of one process's quota store (and of its rate limiter's Redis storage); callers
beyond them wait for a free one."""


class QuotaStore(Protocol):
    """Per-tenant daily counters with an atomic take-unless-full."""

    @property
    def taken_with_runs(self) -> bool:
        """Whether a unit is taken in the transaction that stores its run.

        True only for counters in the runs' own database: admission then hands the Submitter a
        :class:`~moorline.db.repos.quotas.QuotaClaim` instead of calling :meth:`consume`.
        """
        ...

    async def consume(self, tenant_id: TenantId, day: str, limit: int) -> int | None:
        """Take one unit of ``day`` unless ``limit`` are taken.

        Returns:
            The day's usage including this unit; None when refused (nothing was taken).

        Raises:
            BackendUnavailable: the store did not answer; whether the unit was taken is
                unknown, so the caller refuses the request.
        """
        ...

    async def release(self, tenant_id: TenantId, day: str) -> None:
        """Give back one unit of ``day`` (never below 0)."""
        ...

    async def used(self, tenant_id: TenantId, day: str) -> int:
        """Units taken on ``day``."""
        ...

    async def used_by(self, tenant_ids: Iterable[TenantId], day: str) -> dict[TenantId, int]:
        """Units each tenant took on ``day``, in one round trip (the admin's tenants view)."""
        ...

    async def close(self) -> None:
        """Release connections; idempotent."""
        ...


class DatabaseQuotaStore(QuotaStore):
    """Quota counters in the ``quota_usage`` table (deployments without Redis).

    Args:
        db: The runs' database.
        taken_with_runs: Take units in the Submitter's transactions (see the module docstring)
            rather than through :meth:`consume`.
    """

    def __init__(self, db: DatabaseManager, *, taken_with_runs: bool = False) -> None:
        self._repo = QuotasRepo(db)
        self._taken_with_runs = taken_with_runs

    @property
    def taken_with_runs(self) -> bool:
        return self._taken_with_runs

    async def consume(self, tenant_id: TenantId, day: str, limit: int) -> int | None:
        return await self._repo.consume(tenant_id, day, limit)

    async def release(self, tenant_id: TenantId, day: str) -> None:
        await self._repo.release(tenant_id, day)

    async def used(self, tenant_id: TenantId, day: str) -> int:
        return await self._repo.used(tenant_id, day)

    async def used_by(self, tenant_ids: Iterable[TenantId], day: str) -> dict[TenantId, int]:
        return await self._repo.used_by(tenant_ids, day)

    async def close(self) -> None:
        return None


class RedisQuotaStore(QuotaStore):
    """Quota counters in Redis, each with a TTL from the moment it exists.

    ``RedisError`` never leaves this class: it becomes
    :class:`~moorline.errors.BackendUnavailable`, and admission fails closed (503) rather than
    start runs it cannot count.
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "mo",
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        """Create the store; nothing connects before the first command.

        Args:
            url: The Redis URL (``MOORLINE_REDIS_URL``): one server, Sentinel or Cluster.
            prefix: The key prefix (``MOORLINE_REDIS_PREFIX``).
            clock: Aware UTC "now", replaceable in tests; it sets the counters' expiry.

        Raises:
            ConfigError: the ``redis`` package is not installed, or the URL is wrong.
        """
        try:
            from redis.exceptions import RedisError

            from moorline.runtime.redis import load_script, run_scripts
            from moorline.runtime.redis_client import RedisConnector
        except ImportError:  # pragma: no cover - the test environment installs every extra
            raise ConfigError(
                "MOORLINE_REDIS_URL: the redis package is missing; install moorline[redis]"
            ) from None
        # A blocking pool: a burst of triggers beyond it waits for a connection, where the
        # default pool would fail the ones past its 100th with "Too many connections" (503).
        self._client = RedisConnector(url).client(
            decode_responses=True, max_connections=REDIS_CONNECTIONS
        )
        self._redis_error = RedisError
        self._run_scripts = run_scripts
        self.keys = RedisKeys(prefix)
        self._clock = clock or (lambda: datetime.now(UTC))
        self._consume = self._client.register_script(load_script("consume_quota"))
        self._release = self._client.register_script(load_script("release_quota"))

    @property
    def taken_with_runs(self) -> bool:
        return False

    async def consume(self, tenant_id: TenantId, day: str, limit: int) -> int | None:
        try:
            taken, used = await self._consume(
                keys=[self.keys.quota(tenant_id, day)],
                args=[limit, counter_ttl_ms(day, self._clock())],
            )
        except self._redis_error as exc:
            raise BackendUnavailable(f"Redis quota store: {exc}") from exc
        return int(used) if int(taken) == 1 else None

    async def release(self, tenant_id: TenantId, day: str) -> None:
        await self.give_back([(tenant_id, day, 1)])

    def take_calls(self, wants: Sequence[tuple[TenantId, QuotaClaim, int]]) -> "list[ScriptCall]":
        """Script calls that take units of several counters, for :meth:`run` (one round trip).

        Args:
            wants: Per counter: the tenant, its claim (day and limit), and the units wanted.

        Returns:
            One call per counter; each replies ``[units taken, used after]``, the units as many
            as its limit leaves, up to those wanted.
        """
        return [
            (
                self._consume,
                [self.keys.quota(tenant_id, claim.day)],
                [claim.limit, counter_ttl_ms(claim.day, self._clock()), wanted],
            )
            for tenant_id, claim, wanted in wants
        ]

    async def run(self, calls: "Sequence[ScriptCall]") -> list[Any]:
        """Run script calls in one round trip on this store's connections.

        The calls may be other users' too: admission's gate sends the rate limit's with these.

        Raises:
            BackendUnavailable: Redis did not answer.
        """
        try:
            return await self._run_scripts(self._client, calls)
        except self._redis_error as exc:
            raise BackendUnavailable(f"Redis quota store: {exc}") from exc

    async def give_back(self, units: Sequence[tuple[TenantId, str, int]]) -> None:
        """Give back units of several counters (tenant, day, units) in one round trip."""
        await self.run(
            [
                (self._release, [self.keys.quota(tenant_id, day)], [count])
                for tenant_id, day, count in units
            ]
        )

    async def used(self, tenant_id: TenantId, day: str) -> int:
        try:
            value = await self._client.get(self.keys.quota(tenant_id, day))
        except self._redis_error as exc:
            raise BackendUnavailable(f"Redis quota store: {exc}") from exc
        return 0 if value is None else int(value)

    async def used_by(self, tenant_ids: Iterable[TenantId], day: str) -> dict[TenantId, int]:
        wanted = sorted(set(tenant_ids))
        # One GET per key in one pipeline, not MGET: the keys hash to different cluster slots.
        pipeline = self._client.pipeline(transaction=False)
        for tenant_id in wanted:
            pipeline.get(self.keys.quota(tenant_id, day))
        try:
            values = await pipeline.execute() if wanted else []
        except self._redis_error as exc:
            raise BackendUnavailable(f"Redis quota store: {exc}") from exc
        return {
            tenant_id: 0 if value is None else int(value)
            for tenant_id, value in zip(wanted, values, strict=True)
        }

    async def close(self) -> None:
        await self._client.aclose()


def make_quota_store(settings: Settings, db: DatabaseManager) -> QuotaStore:
    """Redis counters when ``MOORLINE_REDIS_URL`` is set, else the database's (taken with runs)."""
    if settings.redis_url:
        return RedisQuotaStore(settings.redis_url, prefix=settings.redis_prefix)
    return DatabaseQuotaStore(db, taken_with_runs=True)
