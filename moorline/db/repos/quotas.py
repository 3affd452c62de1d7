"""Daily quota counters in the database: the quota store of deployments without Redis.

One row per tenant and UTC day (``quota_usage``) counts the runs admitted that day. Consuming a
unit is one statement on PostgreSQL and SQLite, ``INSERT … ON CONFLICT DO UPDATE SET used =
used + 1 WHERE used < :limit RETURNING used`` (the backend's ``increment_below``), and on
MariaDB one transaction of two statements:

1. insert the day's row with ``used = 0`` unless it exists (the backend's
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

:func:`take_units_txn` takes several units at once inside a caller's write transaction: the
:class:`~moorline.dispatch.submit.Submitter` takes the units of a whole batch of runs
(:class:`QuotaClaim`) in the transaction that stores them, so a unit and its run are committed,
or rolled back, together.
"""

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Integer, Update, bindparam, select, update
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import CTE

from moorline.db.backends import Backend, DialectName, backend_for
from moorline.db.manager import DatabaseManager
from moorline.db.schema import quota_usage
from moorline.types import JSONObject, TenantId


@dataclass(frozen=True, slots=True, kw_only=True)
class QuotaClaim:
    """The daily-quota unit a run needs to be queued, and what to store when there is none.

    Attributes:
        day: The UTC day the unit is counted on, ``YYYY-MM-DD``.
        limit: Units the tenant may take that day.
        refusal: The ``error`` of the run when the quota is used up: the run is then stored
            ``rate_limited``.
    """

    day: str
    limit: int
    refusal: JSONObject


@dataclass(frozen=True, slots=True)
class Taken:
    """What :func:`take_units_txn` took.

    Attributes:
        units: Units taken, ``0`` to the number wanted.
        now: The database's time, read by the same statement where the dialect returns it from
            an UPDATE (SQLite, PostgreSQL) and the common case applied; None otherwise. A
            caller that needs the time too saves a statement.
    """

    units: int
    now: datetime | None = None


async def take_units_txn(
    conn: AsyncConnection,
    dialect: DialectName,
    tenant_id: TenantId,
    day: str,
    *,
    limit: int,
    wanted: int,
) -> Taken:
    """Take up to ``wanted`` units of ``day`` without passing ``limit``, in ``conn``'s transaction.

    The common case is one statement: ``used + wanted <= limit`` is the UPDATE's own predicate,
    so it is re-checked on the locked row after any lock wait. Otherwise (the day's first use,
    or the quota nearly used up) the row is created unless it exists, read under its lock and
    given what is left. The row stays locked until the transaction ends, so concurrent takers
    of one tenant's day queue, and what one took is what the others see.

    Returns:
        The units taken (they are the caller's once its transaction commits, and were never
        taken if it rolls back), with the database's time when the statement could read it.
    """
    if wanted < 1 or limit < 1:
        return Taken(0)
    params = take_all_parameters(tenant_id, day, limit=limit, wanted=wanted)
    backend = backend_for(dialect)
    result = await conn.execute(_take_all_statement(dialect), params)
    if backend.capabilities.update_returning:
        now = result.scalar_one_or_none()
        if now is not None:
            return Taken(wanted, now)
    elif result.rowcount == 1:
        return Taken(wanted)
    row = _row(tenant_id, day)
    counter = quota_usage.c.used
    keys = {"tenant_id": tenant_id, "day": day}
    await conn.execute(backend.insert_or_lock_existing(quota_usage, "used").values(**keys, used=0))
    used: int = (await conn.execute(backend.lock_rows(select(counter).where(row)))).scalar_one()
    taken = max(0, min(wanted, limit - used))
    if taken:
        await conn.execute(update(quota_usage).where(row).values(used=counter + taken))
    return Taken(taken)


@functools.cache
def _take_all_statement(dialect: DialectName) -> Update:
    """``used += b_wanted`` unless that passes ``b_limit``; returning the database time if it can.

    Built once per dialect with bound parameters, so SQLAlchemy derives its cache key once
    instead of walking a new statement per batch.
    """
    counter = quota_usage.c.used
    wanted = bindparam("b_wanted", type_=Integer)
    stmt = (
        update(quota_usage)
        .where(
            quota_usage.c.tenant_id == bindparam("b_tenant_id"),
            quota_usage.c.day == bindparam("b_day"),
            counter + wanted <= bindparam("b_limit", type_=Integer),
        )
        .values(used=counter + wanted)
    )
    backend = backend_for(dialect)
    return stmt.returning(backend.now()) if backend.capabilities.update_returning else stmt


def take_all_parameters(
    tenant_id: TenantId, day: str, *, limit: int, wanted: int
) -> dict[str, Any]:
    """The bound parameters of :func:`_take_all_statement` and :func:`units_gate`."""
    return {"b_tenant_id": tenant_id, "b_day": day, "b_wanted": wanted, "b_limit": limit}


def units_gate(dialect: DialectName) -> CTE:
    """:func:`take_units_txn`'s one-statement case, as the CTE ``taken`` of another statement.

    A statement that writes only if the units were there uses it (a one-statement submit, on
    PostgreSQL). It returns a row when it took ``b_wanted`` units, and none when the day's
    row is missing or the units are not all left: the caller then takes the transactional
    path, which creates the row or takes what is left.
    """
    return _take_all_statement(dialect).cte("taken")


class QuotasRepo:
    """Per-tenant, per-day usage counters with an atomic conditional consume."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db
        self._backend: Backend = db.backend

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
        one_statement = self._backend.increment_below(
            quota_usage, column="used", limit=limit, keys=keys
        )
        async with self._db.write_transaction() as conn:
            if one_statement is not None:
                used: int | None = (await conn.execute(one_statement)).scalar_one_or_none()
                return used
            await conn.execute(
                self._backend.insert_or_lock_existing(quota_usage, "used").values(**keys, used=0)
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
