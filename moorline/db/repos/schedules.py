"""Schedules: a tenant's recurring triggers, and the scheduler's conditional advance of each.

A schedule's ``next_at`` is its first tick not yet fired. The API writes it when a schedule is
created, its cadence changes or it resumes; the scheduler reads the due ones (:meth:`due`)
and, once the runs of their ticks are stored, moves each forward with :meth:`advance`, a
statement conditional on ``next_at`` still being what the scheduler read. So two schedulers
(two processes that both believe they lead) advance a schedule once, and an edit made
meanwhile (a new cadence, a resume) is never overwritten by a pass that read the old one.
"""

import builtins
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import RowMapping, delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from moorline.db.manager import DatabaseManager
from moorline.db.schema import schedules
from moorline.errors import TenantNotFound
from moorline.types import JSONObject, TenantId

EDITABLE = frozenset(
    {"workflow", "input", "cron", "every_s", "timezone", "catch_up", "paused", "next_at"}
)
"""Columns :meth:`SchedulesRepo.update` may change."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """A schedule as stored.

    Attributes:
        cron: Five-field cron expression read in ``timezone``; None for an interval.
        every_s: Interval in seconds; None for a cron expression.
        next_at: The first tick not yet fired (while paused: the one it would fire next).
        last_fired_at: The tick whose run was stored last.
        last_run_id: That run.
        last_error: ``{"code", "message", "tick"}`` of the last tick admission refused.
        fired: Ticks whose run was stored.
        refused: Ticks admission refused (quota, rate limit, invalid input, …).
    """

    schedule_id: str
    tenant_id: TenantId
    workflow: str
    input: JSONObject
    cron: str | None
    every_s: int | None
    timezone: str
    catch_up: str
    paused: bool
    next_at: datetime
    last_fired_at: datetime | None
    last_run_id: str | None
    last_error: JSONObject | None
    fired: int
    refused: int
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class NewSchedule:
    """What creating a schedule stores (checked by the caller)."""

    tenant_id: TenantId
    workflow: str
    input: JSONObject
    cron: str | None
    every_s: int | None
    timezone: str
    catch_up: str
    paused: bool
    next_at: datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """What a scheduler pass did with one schedule's due ticks.

    Attributes:
        next_at: The schedule's new first unfired tick.
        fired: Ticks whose run is stored (new, or found under the tick's idempotency key).
        refused: Ticks admission refused.
        last_fired_at: The latest tick fired, if any.
        last_run_id: Its run.
        last_error: The latest refusal, if any.
    """

    next_at: datetime
    fired: int = 0
    refused: int = 0
    last_fired_at: datetime | None = None
    last_run_id: str | None = None
    last_error: JSONObject | None = None


class SchedulesRepo:
    """Creates, edits and lists schedules, and advances them for the scheduler."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db

    async def create(self, new: NewSchedule) -> Schedule:
        """Store a new schedule.

        Not retried on a lost connection: a retry after a lost acknowledgement would store a
        second schedule under another id.

        Raises:
            TenantNotFound: No such tenant; nothing was written.
        """
        schedule_id = str(uuid.uuid4())
        now = self._db.backend.now()
        async with self._db.transaction() as conn:
            try:
                await conn.execute(
                    insert(schedules).values(
                        id=schedule_id,
                        tenant_id=new.tenant_id,
                        workflow=new.workflow,
                        input=new.input,
                        cron=new.cron,
                        every_s=new.every_s,
                        timezone=new.timezone,
                        catch_up=new.catch_up,
                        paused=int(new.paused),
                        next_at=new.next_at,
                        fired=0,
                        refused=0,
                        created_at=now,
                        updated_at=now,
                    )
                )
            except IntegrityError as exc:
                raise TenantNotFound(f"no tenant {new.tenant_id}") from exc
            row = (
                (await conn.execute(select(schedules).where(schedules.c.id == schedule_id)))
                .mappings()
                .one()
            )
        return _schedule_from_row(row)

    async def get(self, schedule_id: str, *, tenant_id: TenantId) -> Schedule | None:
        """The tenant's schedule with this id, or None (another tenant's is None too)."""
        stmt = select(schedules).where(
            schedules.c.id == schedule_id, schedules.c.tenant_id == tenant_id
        )

        async def read() -> Schedule | None:
            async with self._db.connect() as conn:
                row = (await conn.execute(stmt)).mappings().first()
            # MariaDB's binary collation still ignores trailing spaces: compare exactly here.
            return None if row is None or row["id"] != schedule_id else _schedule_from_row(row)

        return await self._db.with_retry(read)

    async def list_for(self, tenant_id: TenantId) -> builtins.list[Schedule]:
        """The tenant's schedules, oldest first."""
        stmt = (
            select(schedules)
            .where(schedules.c.tenant_id == tenant_id)
            .order_by(schedules.c.created_at, schedules.c.id)
        )

        async def read() -> builtins.list[Schedule]:
            async with self._db.connect() as conn:
                rows = (await conn.execute(stmt)).mappings().all()
            return [_schedule_from_row(row) for row in rows]

        return await self._db.with_retry(read)

    async def update(
        self, schedule_id: str, *, tenant_id: TenantId, values: Mapping[str, object]
    ) -> Schedule | None:
        """Change columns of the tenant's schedule; None when it has none with this id.

        Args:
            schedule_id: The schedule.
            tenant_id: Its tenant (another tenant's schedule is not found).
            values: Column → new value, columns among :data:`EDITABLE` (``paused`` a bool).

        Raises:
            ValueError: A column outside :data:`EDITABLE`.
        """
        unknown = set(values) - EDITABLE
        if unknown:
            raise ValueError(f"not editable: {sorted(unknown)}")
        changes = dict(values)
        if "paused" in changes:
            changes["paused"] = int(bool(changes["paused"]))
        stmt = (
            update(schedules)
            .where(schedules.c.id == schedule_id, schedules.c.tenant_id == tenant_id)
            .values(**changes, updated_at=self._db.backend.now())
        )

        async def write() -> bool:
            async with self._db.transaction() as conn:
                result = await conn.execute(stmt)
            return result.rowcount == 1

        # Idempotent: the same values written again change nothing more.
        if not await self._db.with_retry(write):
            return None
        return await self.get(schedule_id, tenant_id=tenant_id)

    async def delete(self, schedule_id: str, *, tenant_id: TenantId) -> bool:
        """Delete the tenant's schedule; False when it has none with this id.

        Runs it started are kept; a pass firing it right now may still store that tick's run.
        """
        stmt = delete(schedules).where(
            schedules.c.id == schedule_id, schedules.c.tenant_id == tenant_id
        )

        async def remove() -> bool:
            async with self._db.transaction() as conn:
                result = await conn.execute(stmt)
            return result.rowcount == 1

        return await self._db.with_retry(remove)

    async def due(self, now: datetime, *, limit: int) -> builtins.list[Schedule]:
        """Unpaused schedules of every tenant whose next tick is at or before ``now``.

        Most overdue first, at most ``limit``.
        """
        stmt = (
            select(schedules)
            .where(schedules.c.paused == 0, schedules.c.next_at <= now)
            .order_by(schedules.c.next_at, schedules.c.id)
            .limit(limit)
        )

        async def read() -> builtins.list[Schedule]:
            async with self._db.connect() as conn:
                rows = (await conn.execute(stmt)).mappings().all()
            return [_schedule_from_row(row) for row in rows]

        return await self._db.with_retry(read)

    async def advance(self, schedule: Schedule, outcome: Outcome) -> bool:
        """Record a pass over ``schedule``'s due ticks; False when its ``next_at`` moved meanwhile.

        One statement, conditional on ``next_at`` being what ``schedule`` read: of two passes
        over the same ticks only one counts them, and an edit that set a new ``next_at``
        (cadence changed, resumed) wins over a pass that read the old one.
        """
        c = schedules.c
        values: dict[str, object] = {
            "next_at": outcome.next_at,
            "fired": c.fired + outcome.fired,
            "refused": c.refused + outcome.refused,
        }
        if outcome.last_fired_at is not None:
            values["last_fired_at"] = outcome.last_fired_at
            values["last_run_id"] = outcome.last_run_id
        if outcome.last_error is not None:
            values["last_error"] = outcome.last_error
        stmt = (
            update(schedules)
            .where(c.id == schedule.schedule_id, c.next_at == schedule.next_at)
            .values(**values)
        )
        # Not retried: after a lost acknowledgement a retry would find next_at moved and
        # answer False for a pass that did count. The pass after it starts from the row.
        async with self._db.transaction() as conn:
            result = await conn.execute(stmt)
        return result.rowcount == 1


def _schedule_from_row(row: RowMapping) -> Schedule:
    return Schedule(
        schedule_id=row["id"],
        tenant_id=TenantId(row["tenant_id"]),
        workflow=row["workflow"],
        input=row["input"],
        cron=row["cron"],
        every_s=row["every_s"],
        timezone=row["timezone"],
        catch_up=row["catch_up"],
        paused=bool(row["paused"]),
        next_at=row["next_at"],
        last_fired_at=row["last_fired_at"],
        last_run_id=row["last_run_id"],
        last_error=row["last_error"],
        fired=row["fired"],
        refused=row["refused"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
    )
