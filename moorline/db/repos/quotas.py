"""Daily quota counters in the database: the quota store of deployments without Redis.

One row per tenant and UTC day (``quota_usage``) counts the runs admitted that day. Consuming a
unit is one statement on PostgreSQL and SQLite, ``INSERT … ON CONFLICT DO UPDATE SET used =
used + 1 WHERE used < :limit RETURNING used`` (the dialect hook ``increment_below``), and on
MariaDB one transaction of two statements:

1. insert the day's row with ``used = 0`` unless it exists (the dialect hook
   ``insert_or_lock_existing``, which never leaves a shared lock to upgrade: MariaDB's
   ``INSERT IGNORE`` would, and concurrent consumers would deadlock), so the next statement
   always has a row to lock;
2. ``UPDATE … SET used = used + 1 WHERE tenant_id = ? AND day = ? AND used < :limit``, whose
   rowcount is the answer.

Either way the limit is a predicate on the row itself, so it is re-checked after any lock
wait (PostgreSQL and MariaDB under READ COMMITTED; SQLite serialises writers anyway): however
many processes consume at once, ``used`` never passes the limit and no two of them are told
they took the same last unit. A counter in the database never needs an expiry; a new day is a
new row, and old rows are the usage history.
"""

from collections.abc import Iterable

from sqlalchemy import select, update
from sqlalchemy.sql.elements import ColumnElement

from moorline.db.dialects import DialectName, increment_below, insert_or_lock_existing
from moorline.db.manager import DatabaseManager
from moorline.db.schema import quota_usage
from moorline.types import TenantId


class QuotasRepo:
    """Per-tenant, per-day usage counters with an atomic conditional consume."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db
        self._dialect: DialectName = db.dialect

    async def consume(self, tenant_id: TenantId, day: str, limit: int) -> int | None:
        """Take one unit of the tenant's quota for ``day``, unless ``limit`` units are taken.

        Not retried on a lost connection: a retry after a commit whose acknowledgement was
        lost would count the unit twice. The error reaches the caller, which refuses the
        request.

        Args:
            tenant_id: The tenant (it must exist: the row references it).
            day: The UTC day, ``YYYY-MM-DD``.
            limit: Units the tenant may take that day.

        Returns:
            The day's usage including this unit, or None when the quota was used up (nothing
            was taken).
        """
        if limit < 1:
            return None
        row = _row(tenant_id, day)
        keys = {"tenant_id": tenant_id, "day": day}
        one_statement = increment_below(
            quota_usage, self._dialect, column="used", limit=limit, keys=keys
        )
        async with self._db.write_transaction() as conn:
            if one_statement is not None:
                used: int | None = (await conn.execute(one_statement)).scalar_one_or_none()
                return used
            await conn.execute(
                insert_or_lock_existing(quota_usage, self._dialect, "used").values(**keys, used=0)
            )
            take = (
                update(quota_usage)
                .where(row, quota_usage.c.used < limit)
                .values(used=quota_usage.c.used + 1)
            )
            if (await conn.execute(take)).rowcount != 1:
                return None
            used = (await conn.execute(select(quota_usage.c.used).where(row))).scalar_one()
        return used

    async def release(self, tenant_id: TenantId, day: str) -> bool:
        """Give back one unit taken on ``day`` (a run that was never stored after all).

        Not retried, for the same reason as :meth:`consume`.

        Returns:
            False when there was nothing to give back (no unit taken that day).
        """
        stmt = (
            update(quota_usage)
            .where(_row(tenant_id, day), quota_usage.c.used > 0)
            .values(used=quota_usage.c.used - 1)
        )
        async with self._db.write_transaction() as conn:
            result = await conn.execute(stmt)
        return result.rowcount == 1

    async def used(self, tenant_id: TenantId, day: str) -> int:
        """Units the tenant has taken on ``day`` (0 before the first)."""
        stmt = select(quota_usage.c.used).where(_row(tenant_id, day))

        async def read() -> int:
            async with self._db.connect() as conn:
                used: int | None = (await conn.execute(stmt)).scalar_one_or_none()
            return used or 0

        return await self._db.with_retry(read)

    async def used_by(self, tenant_ids: Iterable[TenantId], day: str) -> dict[TenantId, int]:
        """Units each tenant has taken on ``day``, in one read (0 before the first)."""
        wanted = sorted(set(tenant_ids))
        if not wanted:
            return {}
        stmt = select(quota_usage.c.tenant_id, quota_usage.c.used).where(
            quota_usage.c.tenant_id.in_(wanted), quota_usage.c.day == day
        )

        async def read() -> dict[TenantId, int]:
            async with self._db.connect() as conn:
                found = {TenantId(row.tenant_id): int(row.used) for row in await conn.execute(stmt)}
            return {tenant_id: found.get(tenant_id, 0) for tenant_id in wanted}

        return await self._db.with_retry(read)


def _row(tenant_id: TenantId, day: str) -> ColumnElement[bool]:
    return (quota_usage.c.tenant_id == tenant_id) & (quota_usage.c.day == day)
