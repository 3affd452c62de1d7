"""The claim's SQL statements, built once per database kind with bound parameters.

Building a statement with table aliases costs more CPU than the database spends running it, and
a reused statement object also keeps its cache key, so each is built once per backend kind (and
shape) and reused. The backend supplies the SQL that differs between databases (database time,
row locks); everything else is written once.
"""

import functools
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from sqlalchemy import (
    ColumnElement,
    CompoundSelect,
    Integer,
    Select,
    String,
    bindparam,
    cast,
    func,
    select,
    union_all,
    update,
)
from sqlalchemy.sql.dml import Update
from sqlalchemy.sql.elements import BindParameter

from moorline.db.backends import Backend
from moorline.db.repos.records import unindexed
from moorline.db.schema import runs, tenants
from moorline.types import RunStatus

UNION_CHUNK = 400
"""Tenants per claim read: SQLite allows at most 500 members in one compound SELECT."""

MAX_BOUND_PARAMETERS = 30_000
"""Bound parameters per claim statement, under SQLite's default limit (32,766) and asyncpg's
(32,767): each member of a claim read binds its tenant, its count and the served workflows."""

_QUEUED = RunStatus.QUEUED.value
_RUNNING = RunStatus.RUNNING.value

_P = ParamSpec("_P")
_T = TypeVar("_T")


def per_backend_kind(
    build: Callable[Concatenate[Backend, _P], _T],
) -> Callable[Concatenate[Backend, _P], _T]:
    """Cache ``build``'s result per backend kind (its name) and arguments.

    Not ``functools.cache``: that would key on the backend instance, one per
    ``DatabaseManager``, and keep every manager's backend alive; the SQL depends on the kind.
    """
    cache: dict[tuple[Any, ...], _T] = {}

    @functools.wraps(build)
    def cached(backend: Backend, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        key = (backend.name, args, tuple(sorted(kwargs.items())))
        try:
            return cache[key]
        except KeyError:
            built = cache[key] = build(backend, *args, **kwargs)
            return built

    return cached


def _id_list() -> BindParameter[Any]:
    """The ``ids`` parameter: a list expanded into ``IN (…)`` at execution."""
    return bindparam("ids", expanding=True)


def _served_by(column: ColumnElement[Any]) -> ColumnElement[bool]:
    """``column IN (:workflows)``: the run's workflow is one the claiming worker serves.

    ``workflow`` is the last column of ``ix_runs_lane_tenant``, so the filter is applied to the
    index entries the claim walks anyway: no table read per candidate, and a run of another
    workflow is stepped over inside the tenant's range.
    """
    return column.in_(bindparam("workflows", expanding=True))


def union_chunk(workflow_count: int) -> int:
    """Tenants per claim read when each member also binds ``workflow_count`` workflows."""
    return max(1, min(UNION_CHUNK, MAX_BOUND_PARAMETERS // (workflow_count + 2)))


@per_backend_kind
def waiting_statement(backend: Backend, served: bool = False) -> Select[Any]:
    """The tenants with queued runs in ``lane``: plan, running count, next eligible run.

    A recursive query skips through ``ix_runs_lane_tenant`` one tenant id at a time, so the
    cost follows the number of tenants waiting, never the length of a backlog. A tenant whose
    runs are all delayed has a NULL next run. ``served``: the next run is one of the
    ``workflows`` bound at execution; a tenant with none of them queued has a NULL next run.
    """
    lane = bindparam("lane", type_=String())
    # ORDER BY … LIMIT 1 rather than min(): the planner always reads it as one index seek.
    first = (
        select(cast(runs.c.tenant_id, String()))
        .where(runs.c.status == _QUEUED, runs.c.lane == lane)
        .order_by(runs.c.tenant_id)
        .limit(1)
    )
    waiting = select(first.scalar_subquery().label("tenant_id")).cte("waiting", recursive=True)
    seen = waiting.alias("seen")
    later = runs.alias("later")
    following = (
        select(cast(later.c.tenant_id, String()))
        .where(later.c.status == _QUEUED, later.c.lane == lane)
        .where(later.c.tenant_id > seen.c.tenant_id)
        .order_by(later.c.tenant_id)
        .limit(1)
    )
    waiting = waiting.union_all(
        select(following.scalar_subquery()).where(seen.c.tenant_id.is_not(None))
    )
    ahead = runs.alias("ahead")

    def next_run(column: ColumnElement[Any]) -> ColumnElement[Any]:
        nxt = (
            select(column)
            .where(ahead.c.status == _QUEUED, ahead.c.lane == lane)
            .where(ahead.c.tenant_id == waiting.c.tenant_id, ahead.c.not_before <= backend.now())
        )
        if served:
            nxt = nxt.where(_served_by(ahead.c.workflow))
        return (
            nxt.order_by(ahead.c.priority.desc(), ahead.c.not_before, ahead.c.id)
            .limit(1)
            .scalar_subquery()
        )

    load = runs.alias("load")
    busy = (
        select(func.count())
        .select_from(load)
        .where(load.c.tenant_id == waiting.c.tenant_id, load.c.status == _RUNNING)
        .scalar_subquery()
    )
    return select(
        waiting.c.tenant_id,
        tenants.c.plan,
        busy.label("busy"),
        next_run(ahead.c.priority).label("priority"),
        next_run(ahead.c.not_before).label("not_before"),
    ).join(tenants, tenants.c.id == waiting.c.tenant_id)


@per_backend_kind
def lock_tenants_statement(backend: Backend) -> Select[Any]:
    """The tenant rows ``ids``, locked in id order (so two claimers never deadlock)."""
    ids = _id_list()
    return backend.lock_rows(
        select(tenants.c.id).where(tenants.c.id.in_(ids)).order_by(tenants.c.id)
    )


@per_backend_kind
def next_runs_statement(
    backend: Backend, tenants_count: int, locked: bool, served: bool = False
) -> Select[Any] | CompoundSelect[Any]:
    """Each of ``tenants_count`` tenants' next ``count_<i>`` eligible runs of ``lane``.

    ``locked``: the whole rows, locked ``FOR UPDATE SKIP LOCKED`` (the lock sits in each
    member's own sub-select, where PostgreSQL and MariaDB allow it under a ``UNION``), with
    the tenant's ``running`` count (``busy``) and the database time (``db_now``) beside them.
    The eligibility predicate is on the rows being locked, so a row another transaction
    changed is checked again as locked. Otherwise the columns the claim order needs.
    ``served``: only runs of the ``workflows`` bound at execution.
    """
    # Not "lane": an UPDATE (SQLite's claim) reserves column names for its SET clause.
    lane = bindparam("in_lane", type_=String())

    def next_of(index: int) -> Select[Any]:
        tenant = bindparam(f"tenant_{index}", type_=String())
        columns = (
            runs.c if locked else (runs.c.id, runs.c.tenant_id, runs.c.priority, runs.c.not_before)
        )
        nxt = (
            select(*columns)
            .where(runs.c.status == _QUEUED, runs.c.lane == lane)
            .where(runs.c.tenant_id == tenant)
            .where(runs.c.not_before <= backend.now())
            # Never set on a queued run (a cancel ends one at once); kept so that no path
            # to ``queued`` can ever hand a cancelled run to a worker.
            .where(runs.c.cancel_requested_at.is_(None))
        )
        if served:
            nxt = nxt.where(_served_by(runs.c.workflow))
        nxt = nxt.order_by(runs.c.priority.desc(), runs.c.not_before, runs.c.id).limit(
            bindparam(f"count_{index}", type_=Integer())
        )
        if not locked:
            return select(nxt.subquery())
        held = backend.lock_rows_skip_locked(nxt).subquery()
        load = runs.alias()
        busy = (
            select(func.count())
            .select_from(load)
            .where(load.c.tenant_id == tenant, load.c.status == _RUNNING)
            .scalar_subquery()
        )
        return select(held, busy.label("busy"), backend.now().label("db_now"))

    members = [next_of(index) for index in range(tenants_count)]
    return members[0] if len(members) == 1 else union_all(*members)


@per_backend_kind
def claim_next_statement(
    backend: Backend, tenants_count: int, lease_ttl_s: float, served: bool = False
) -> Update:
    """The serialised claim: the allotted tenants' next runs, read and claimed by one statement.

    The eligibility predicate (with the served workflows, when ``served``) is repeated on the
    rows being updated, checked under the write lock; every column of the claimed rows is
    returned.
    """
    chosen = next_runs_statement(backend, tenants_count, False, served).subquery()
    now = backend.now()
    # The rows are found by their ids; the rest is a check on each, in expressions no index
    # covers. A plain ``status = 'queued' AND lane = ?`` let SQLite's planner (no statistics)
    # walk ix_runs_lane_tenant through the lane's whole backlog, testing each entry against
    # the ids: a claim's cost grew with the backlog (docs/performance.md, 2026-11-30).
    eligible = [
        runs.c.id.in_(select(chosen.c.id)),
        unindexed(runs.c.status) == _QUEUED,
        unindexed(runs.c.lane) == bindparam("in_lane", type_=String()),
        runs.c.not_before <= now,
        runs.c.cancel_requested_at.is_(None),
    ]
    if served:
        eligible.append(_served_by(unindexed(runs.c.workflow)))
    return (
        update(runs)
        .where(*eligible)
        .values(
            status=_RUNNING,
            attempt=runs.c.attempt + 1,
            lease_owner=bindparam("new_owner", type_=String()),
            lease_expires_at=backend.now(plus_s=lease_ttl_s),
            started_at=func.coalesce(runs.c.started_at, now),
            updated_at=now,
        )
        .returning(*runs.c)
    )


@functools.cache
def claim_locked_statement() -> Update:
    """The row-locked claim of rows this transaction holds locked: by primary key alone.

    No predicate beyond the ids: the rows were eligible as locked and nobody else can change
    them before commit. With more predicates, a planner without statistics yet (a young
    table) may walk a status index through the whole backlog instead of reading the ids.
    """
    claimed_at = bindparam("claimed_at", type_=runs.c.updated_at.type)
    return (
        update(runs)
        .where(runs.c.id.in_(_id_list()))
        .values(
            status=_RUNNING,
            attempt=runs.c.attempt + 1,
            lease_owner=bindparam("new_owner", type_=String()),
            lease_expires_at=bindparam("expires_at", type_=runs.c.lease_expires_at.type),
            started_at=func.coalesce(runs.c.started_at, claimed_at),
            updated_at=claimed_at,
        )
    )
