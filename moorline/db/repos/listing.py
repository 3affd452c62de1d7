"""Reads over many runs: run listings, a conversation's active run, lane and tenant loads.

Listings page with a keyset cursor rather than an offset: a page is the runs strictly *after*
the last one of the previous page in ``(created_at, id)`` order, newest first, so a page costs
the same however deep it is and runs inserted meanwhile neither repeat nor shift the pages.
``id`` breaks ties, which are common: a group-committed batch shares one ``created_at``. A
tenant's listing walks ``ix_runs_tenant_created`` (``tenant_id, created_at``) backwards, or
``ix_runs_tenant_status`` (``tenant_id, status, created_at, id``) when it filters on a status;
the admin's listing across tenants walks ``ix_runs_created`` (``created_at, id``), or
``ix_runs_status_created`` / ``ix_runs_workflow_created`` when it filters on a status or a
workflow, so a rare one is found without reading past the common ones.
"""

import builtins
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import FromClause, Text, and_, cast, func, or_, select
from sqlalchemy.sql.elements import ColumnElement

from moorline.db.backends import Backend
from moorline.db.manager import DatabaseManager
from moorline.db.repos.records import LaneLoad, Run, run_from_row
from moorline.db.schema import runs
from moorline.types import RunId, RunStatus, TenantId

SEARCH_WINDOW = 5_000
"""Newest runs an input search, or a short id's, reads at most: its cost is bounded, its
reach is too."""

SHORT_ID_MAX = 12
"""Longest run id search matched at either end of the id; a longer one is the id's start.

Run ids are UUIDv7 (:func:`~moorline.db.repos.new_runs.new_run_id`): their first 12 hex digits
are the time they were made, shared by every run of the same millisecond, so a short id is
their end (the dashboard shows the last 8 characters). 13 characters or more name a
millisecond and what follows: a range of the primary key, read in full."""

ACTIVE_STATUSES = (RunStatus.PENDING, RunStatus.QUEUED, RunStatus.RUNNING)
"""The statuses of a run that has not ended: it holds its conversation."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunCursor:
    """A position in a listing: the last run of a page. The next page starts after it."""

    created_at: datetime
    run_id: RunId


@dataclass(frozen=True, slots=True, kw_only=True)
class RunFilter:
    """Conditions a listed run must meet; None matches everything."""

    status: RunStatus | None = None
    workflow: str | None = None
    conversation_id: str | None = None
    lane: str | None = None
    parent_run_id: str | None = None
    created_after: datetime | None = None
    """Only runs created at or after this instant."""
    created_before: datetime | None = None
    """Only runs created before this instant."""
    run_ids: tuple[str, ...] | None = None
    """Only these runs (a bulk action's ``ids``; at most a few thousand)."""
    run_id_search: str | None = None
    """Only runs whose id starts with this; or, up to :data:`SHORT_ID_MAX` characters, starts
    or ends with it, among the newest :data:`SEARCH_WINDOW` runs the other conditions select."""
    input_contains: str | None = None
    """Only runs whose input's JSON text contains this, in any case, among the newest
    :data:`SEARCH_WINDOW` runs the other conditions select (a bounded scan)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunPage:
    """One page of a listing, newest first, and where the next one starts (None: no more)."""

    runs: builtins.list[Run]
    next_cursor: RunCursor | None


class RunListing:
    """Tenant-scoped run listings and the aggregate reads of the admin API."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db
        self._backend: Backend = db.backend

    async def page(
        self,
        tenant_id: TenantId,
        *,
        where: RunFilter,
        limit: int,
        after: RunCursor | None = None,
    ) -> RunPage:
        """The tenant's runs matching ``where``, newest first, ``limit`` at most.

        Args:
            tenant_id: Only this tenant's runs are ever returned.
            where: Conditions on status, workflow, conversation and lane.
            limit: Most runs on the page (at least 1).
            after: The cursor of the previous page; None for the first page.

        Raises:
            ValueError: ``limit`` is below 1.
        """
        return await self._page([runs.c.tenant_id == tenant_id], where, limit, after)

    async def page_all_tenants(
        self,
        *,
        where: RunFilter,
        limit: int,
        after: RunCursor | None = None,
        tenant_id: TenantId | None = None,
    ) -> RunPage:
        """Every tenant's runs matching ``where`` (the admin's view), newest first.

        Args:
            where: Conditions on status, workflow, conversation and lane.
            limit: Most runs on the page (at least 1).
            after: The cursor of the previous page; None for the first page.
            tenant_id: Only this tenant's runs, when given.

        Raises:
            ValueError: ``limit`` is below 1.
        """
        scope = [] if tenant_id is None else [runs.c.tenant_id == tenant_id]
        return await self._page(scope, where, limit, after)

    async def _page(
        self,
        scope: builtins.list[ColumnElement[bool]],
        where: RunFilter,
        limit: int,
        after: RunCursor | None,
    ) -> RunPage:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        conditions = [*scope, *filter_conditions(where)]
        searched = _searched_conditions(where)
        source: FromClause = runs
        if searched:
            # Only the newest SEARCH_WINDOW runs of the listing are read for the text or a short
            # id: a derived table (MySQL refuses LIMIT in an IN subquery), joined back by id.
            window = (
                select(runs.c.id)
                .where(*conditions)
                .order_by(runs.c.created_at.desc(), runs.c.id.desc())
                .limit(SEARCH_WINDOW)
                .subquery("window")
            )
            source = runs.join(window, window.c.id == runs.c.id)
            conditions += searched
        if after is not None:
            # ``created_at <= …`` is a range every planner can start the index walk from;
            # the OR alone would make some of them read the skipped pages again.
            conditions.append(runs.c.created_at <= after.created_at)
            conditions.append(
                or_(
                    runs.c.created_at < after.created_at,
                    and_(runs.c.created_at == after.created_at, runs.c.id < after.run_id),
                )
            )
        stmt = (
            select(runs)
            .select_from(source)
            .where(*conditions)
            .order_by(runs.c.created_at.desc(), runs.c.id.desc())
            .limit(limit + 1)  # one more than asked: whether a next page exists
        )

        async def read() -> RunPage:
            async with self._db.connect() as conn:
                found = [run_from_row(row) for row in (await conn.execute(stmt)).mappings()]
            page = found[:limit]
            if len(found) <= limit:
                return RunPage(runs=page, next_cursor=None)
            last = page[-1]
            return RunPage(
                runs=page, next_cursor=RunCursor(created_at=last.created_at, run_id=last.run_id)
            )

        return await self._db.with_retry(read)

    async def running_by_tenant(self, tenant_ids: Iterable[TenantId]) -> dict[TenantId, int]:
        """How many runs of each tenant are ``running`` now (``ix_runs_tenant_status``)."""
        wanted = sorted(set(tenant_ids))
        if not wanted:
            return {}
        stmt = (
            select(runs.c.tenant_id, func.count().label("n"))
            .where(runs.c.tenant_id.in_(wanted), runs.c.status == RunStatus.RUNNING.value)
            .group_by(runs.c.tenant_id)
        )

        async def read() -> dict[TenantId, int]:
            async with self._db.connect() as conn:
                counted = {TenantId(row.tenant_id): int(row.n) for row in await conn.execute(stmt)}
            return {tenant_id: counted.get(tenant_id, 0) for tenant_id in wanted}

        return await self._db.with_retry(read)

    async def active_in_conversation(
        self, tenant_id: TenantId, conversation_id: str
    ) -> RunId | None:
        """The oldest run of the tenant's conversation that has not ended, if any."""
        stmt = (
            select(runs.c.id, runs.c.conversation_id)
            .where(
                runs.c.tenant_id == tenant_id,
                runs.c.conversation_id == conversation_id,
                runs.c.status.in_([status.value for status in ACTIVE_STATUSES]),
            )
            .order_by(runs.c.created_at, runs.c.id)
            .limit(1)
        )

        async def read() -> RunId | None:
            async with self._db.connect() as conn:
                row = (await conn.execute(stmt)).first()
            # MariaDB's binary collation ignores trailing spaces: compare exactly here.
            if row is None or row.conversation_id != conversation_id:
                return None
            return RunId(row.id)

        return await self._db.with_retry(read)

    async def lane_loads(self, lanes: Iterable[str] = ()) -> builtins.list[LaneLoad]:
        """Queued and running runs per lane, and how long the oldest claimable one has waited.

        Args:
            lanes: Lanes to report even when empty (the configured ones); lanes that hold
                runs are reported too.

        Returns:
            One entry per lane, by lane name.
        """
        queued, running = RunStatus.QUEUED.value, RunStatus.RUNNING.value
        counts = (
            select(runs.c.lane, runs.c.status, func.count().label("n"))
            .where(runs.c.status.in_([queued, running]))
            .group_by(runs.c.lane, runs.c.status)
        )
        now = self._backend.now()
        oldest = (
            select(runs.c.lane, func.min(runs.c.not_before).label("since"))
            .where(runs.c.status == queued, runs.c.not_before <= now)
            .group_by(runs.c.lane)
        )

        async def read() -> builtins.list[LaneLoad]:
            async with self._db.connect() as conn:
                current: datetime = (await conn.execute(select(now))).scalar_one()
                by_status = {(row.lane, row.status): row.n for row in await conn.execute(counts)}
                since = {row.lane: row.since for row in await conn.execute(oldest)}
            names = sorted({*lanes, *(lane for lane, _ in by_status)})
            return [
                LaneLoad(
                    lane=lane,
                    queued=by_status.get((lane, queued), 0),
                    running=by_status.get((lane, running), 0),
                    oldest_queued_age_s=(
                        None
                        if since.get(lane) is None
                        else max(0.0, (current - since[lane]).total_seconds())
                    ),
                )
                for lane in names
            ]

        return await self._db.with_retry(read)


def filter_conditions(where: RunFilter) -> builtins.list[ColumnElement[bool]]:
    """The conditions on ``runs`` a run meeting ``where`` satisfies."""
    conditions: builtins.list[ColumnElement[bool]] = []
    if where.status is not None:
        conditions.append(runs.c.status == where.status.value)
    if where.workflow is not None:
        conditions.append(runs.c.workflow == where.workflow)
    if where.conversation_id is not None:
        conditions.append(runs.c.conversation_id == where.conversation_id)
    if where.lane is not None:
        conditions.append(runs.c.lane == where.lane)
    if where.parent_run_id is not None:
        conditions.append(runs.c.parent_run_id == where.parent_run_id)
    if where.created_after is not None:
        conditions.append(runs.c.created_at >= where.created_after)
    if where.created_before is not None:
        conditions.append(runs.c.created_at < where.created_before)
    if where.run_ids is not None:
        conditions.append(runs.c.id.in_(list(where.run_ids)))
    search = where.run_id_search
    if search is not None and len(search) > SHORT_ID_MAX:
        # A range, so the primary key's index finds it (LIKE would not on every backend).
        conditions.append(runs.c.id >= search)
        conditions.append(runs.c.id < search[:-1] + chr(ord(search[-1]) + 1))
    return conditions


def _searched_conditions(where: RunFilter) -> builtins.list[ColumnElement[bool]]:
    """The conditions of ``where`` tested only within its newest :data:`SEARCH_WINDOW` runs."""
    conditions: builtins.list[ColumnElement[bool]] = []
    if where.input_contains is not None:
        conditions.append(
            _text_of(runs.c.input).contains(where.input_contains.lower(), autoescape=True)
        )
    search = where.run_id_search
    if search is not None and len(search) <= SHORT_ID_MAX:
        starts = runs.c.id.startswith(search, autoescape=True)
        conditions.append(or_(starts, runs.c.id.endswith(search, autoescape=True)))
    return conditions


def _text_of(document: ColumnElement[Any]) -> ColumnElement[str]:
    """A JSON column's text, lower-cased (``jsonb::text``, ``CAST(… AS CHAR)``, the text)."""
    return func.lower(cast(document, Text))
