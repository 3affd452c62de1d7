"""Run events: the ordered record of what happened in a run (``seq`` counts from 1 per run).

Events are written only inside the transaction that makes the transition they record (a claim,
a finish, a reap), by :func:`append_events_txn`; a transition that matched no row writes no
event. A workflow's own events (``ctx.emit``) go through :meth:`EventsRepo.append_many`, fenced
by the attempt like a step checkpoint, several in one transaction (the engine batches ``delta``
events). Their type names are persisted and streamed, so they are contract (``tests/compat``).
"""

import builtins
import functools
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    CTE,
    ColumnElement,
    FromClause,
    Insert,
    RowMapping,
    Select,
    Update,
    bindparam,
    func,
    insert,
    literal,
    select,
)
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.backends import Backend, DialectName, backend_for
from moorline.db.manager import DatabaseManager
from moorline.db.repos.fences import hold_fence_txn
from moorline.db.repos.records import Event, Fence
from moorline.db.schema import events, runs
from moorline.types import Attempt, JSONObject, RunId

EVENT_QUEUED = "queued"
EVENT_STARTED = "started"
EVENT_RETRYING = "retrying"
EVENT_RECLAIMED = "reclaimed"
EVENT_SUCCEEDED = "succeeded"
EVENT_FAILED = "failed"
EVENT_CANCELLED = "cancelled"
EVENT_RELEASED = "released"
EVENT_TIMED_OUT = "timed_out"
EVENT_MESSAGE_RECEIVED = "message_received"
EVENT_WAITING = "waiting"
"""The run parked: ``data`` is its ``waiting_for`` (``kind``, ``until``, ``interrupt_id``?)."""
EVENT_RESUMED = "resumed"
"""The run left ``waiting`` and is queued again: ``{"reason", "waited_for"}``."""
EVENT_RETRIED = "retried"
"""A ``failed`` or ``timed_out`` run was put back to ``queued`` with a fresh attempt budget:
``{"previous_status", "error", "job_id"?}``."""
"""The workflow took an injected message (``ctx.drain_messages``); data ``{"seq", "content"}``."""

TERMINAL_EVENT_TYPES = frozenset({EVENT_SUCCEEDED, EVENT_FAILED, EVENT_CANCELLED, EVENT_TIMED_OUT})
"""The last event of a run that ended after it was queued (a refused run has no events)."""

DEFAULT_LIST_LIMIT = 1000

# Bound parameters per IN list: PostgreSQL (asyncpg) allows 32,767 per statement; a chunk of
# this size leaves room for the rest of the statement on every backend.
_IN_CHUNK = 1000


# Built once: constructing a statement costs more CPU than running it on a hot path.
_LAST_SEQ = (
    select(events.c.run_id, func.max(events.c.seq).label("seq"))
    .where(events.c.run_id.in_(bindparam("ids", expanding=True)))
    .group_by(events.c.run_id)
)
_INSERT = insert(events)


@functools.cache
def _insert_at_db_now(dialect: DialectName) -> Insert:
    return insert(events).values(created_at=backend_for(dialect).now())


async def append_events_txn(
    conn: AsyncConnection,
    dialect: DialectName,
    items: Sequence[tuple[RunId, Attempt, str, JSONObject]],
    *,
    now: datetime | None = None,
    new_runs: bool = False,
) -> list[int]:
    """Append one event per item, each at its run's next ``seq``, in the caller's transaction.

    The caller holds each run's row (it just changed or inserted it under a fence or
    predicate), which serialises this run's writers; that is what makes ``max(seq) + 1`` safe
    here. Several items for one run get consecutive numbers in item order.

    Args:
        conn: The caller's connection, inside its write transaction.
        dialect: The database's dialect.
        items: ``(run id, attempt, event type, data)`` per event.
        now: ``created_at`` of every event: a database time the caller already read in this
            transaction. None evaluates database time in the INSERT itself. Passing a value
            keeps the INSERT free of SQL functions, which lets aiomysql send a batch as one
            multi-row statement instead of one statement per row.
        new_runs: The runs were inserted in this transaction, so none has an event yet and
            the ``max(seq)`` read is skipped.

    Returns:
        The ``seq`` given to each item, in item order.
    """
    if not items:
        return []
    from_rows = _appended_from_rows(dialect, at_db_now=now is None, new_runs=new_runs)
    if from_rows is not None:
        return await _append_from_rows_txn(conn, from_rows, items, now)
    run_ids = [] if new_runs else sorted({run_id for run_id, *_ in items})
    seqs: dict[str, int] = {}
    for offset in range(0, len(run_ids), _IN_CHUNK):
        chunk = run_ids[offset : offset + _IN_CHUNK]
        rows = await conn.execute(_LAST_SEQ, {"ids": chunk})
        seqs.update({row.run_id: row.seq for row in rows})
    params: list[dict[str, Any]] = []
    for run_id, attempt, event_type, data in items:
        seqs[run_id] = seqs.get(run_id, 0) + 1
        params.append(
            {
                "run_id": run_id,
                "seq": seqs[run_id],
                "type": event_type,
                "attempt": attempt,
                "data": data,
            }
        )
    if now is not None:
        for param in params:
            param["created_at"] = now
        await conn.execute(_INSERT, params)
    else:
        await conn.execute(_insert_at_db_now(dialect), params)
    return [param["seq"] for param in params]


_EVENT_ROW_COLUMNS = {
    "run_id": events.c.run_id.type,
    "nth": events.c.seq.type,
    "type": events.c.type.type,
    "attempt": events.c.attempt.type,
    "data": events.c.data.type,
}
"""The columns of an ``events`` rows parameter (:func:`numbered_event_rows`)."""


@functools.cache
def _appended_from_rows(dialect: DialectName, *, at_db_now: bool, new_runs: bool) -> Insert | None:
    """Events bound as one rows parameter, numbered by the statement itself; None if unbound.

    Where the backend binds many rows as one parameter (PostgreSQL), the ``max(seq)`` read and
    the INSERT are one statement: a round trip and a per-row execution fewer. Each row carries
    ``nth``, its place among its run's events (from 1); its ``seq`` is the run's last one plus
    ``nth``. Each run's last ``seq`` is read once, into a materialised CTE, before any row is
    inserted: read per row, the index scan for a run's last ``seq`` would step over every
    entry the statement had inserted for it so far (invisible to its snapshot), and a batch of
    one run's streamed deltas would cost the square of its size. ``at_db_now``: the events'
    time is the database's, read per row; otherwise the ``created_at`` parameter.
    ``new_runs``: the runs have no event yet, and nothing is read.
    """
    backend = backend_for(dialect)
    source = backend.rows_parameter("events", _EVENT_ROW_COLUMNS)
    if source is None:
        return None
    created_at = (
        backend.now() if at_db_now else bindparam("created_at", type_=events.c.created_at.type)
    )
    if new_runs:
        chosen = select(
            source.c.run_id, source.c.nth, source.c.type, source.c.attempt, source.c.data
        )
        return _insert_events(chosen.add_columns(created_at)).returning(
            events.c.run_id, events.c.seq
        )
    given = select(source).cte("given")
    runs_given = select(given.c.run_id).distinct().subquery("runs_given")
    last = _last_seqs(runs_given.c.run_id)
    numbered = _numbered_after(given, last, created_at)
    return _insert_events(numbered).returning(events.c.run_id, events.c.seq)


def _last_seqs(run_id: ColumnElement[Any], *carried: ColumnElement[Any]) -> CTE:
    """Each run of ``run_id``'s last ``seq`` (0: none yet), read once: a materialised CTE.

    Read per inserted row instead, the index scan for a run's last ``seq`` would step over
    every entry the statement had inserted for it so far (invisible to its snapshot).
    ``carried``: more columns of the same rows, kept beside it.
    """
    prior = events.alias("prior")
    last_seq = (
        select(func.coalesce(func.max(prior.c.seq), 0))
        .where(prior.c.run_id == run_id)
        .scalar_subquery()
    )
    chosen = select(run_id.label("run_id"), *carried, last_seq.label("seq"))
    return chosen.cte("last_seq").prefix_with("MATERIALIZED")


def _numbered_after(given: CTE, last: CTE, created_at: ColumnElement[Any]) -> Select[Any]:
    """The columns of each event in ``given``, at its run's last ``seq`` plus its ``nth``."""
    return select(
        given.c.run_id,
        last.c.seq + given.c.nth,
        given.c.type,
        given.c.attempt,
        given.c.data,
        created_at,
    ).join_from(given, last, given.c.run_id == last.c.run_id)


@functools.lru_cache(maxsize=128)
def transition_with_given_events(dialect: DialectName, transition: Update) -> Insert | None:
    """``transition`` and events given for the runs it changes, as one statement; or None.

    ``WITH moved AS (UPDATE runs … RETURNING …) INSERT INTO events …``, the events bound as
    one rows parameter (``events``: ``run_id``, ``nth``, ``type``, ``attempt``, ``data``), as
    :func:`append_events_txn` binds them; each at its run's last ``seq`` plus ``nth``, dated
    the run's new ``updated_at``. An attempt's own last events and the event of its outcome go
    in the outcome's statement this way (a round trip less than events, then transition). Only
    events of runs the UPDATE changed are written, so the statement's rowcount is the number
    of events given exactly when every run changed. The caller holds the runs' rows, so their
    last ``seq`` read here cannot move (see :func:`events_from_runs_statement`). None where
    the backend cannot bind rows as one parameter or run an UPDATE in a CTE. ``transition``
    is the cache's key: a statement built once, its parameters not named ``events``.
    """
    backend = backend_for(dialect)
    source = backend.rows_parameter("events", _EVENT_ROW_COLUMNS)
    if source is None or not backend.capabilities.dml_in_cte:
        return None
    moved = transition.returning(runs.c.id, runs.c.updated_at).cte("moved")
    given = select(source).cte("given")
    last = _last_seqs(moved.c.id, moved.c.updated_at)
    return _insert_events(_numbered_after(given, last, last.c.updated_at)).add_cte(moved)


async def _append_from_rows_txn(
    conn: AsyncConnection,
    statement: Insert,
    items: Sequence[tuple[RunId, Attempt, str, JSONObject]],
    now: datetime | None,
) -> list[int]:
    """:func:`append_events_txn` with :func:`_appended_from_rows`'s statement: the seqs given."""
    rows = numbered_event_rows(items)
    params: dict[str, Any] = {"events": rows}
    if now is not None:
        params["created_at"] = now
    # A run's events got consecutive seqs from its first one, in item order.
    first: dict[str, int] = {}
    for stored in await conn.execute(statement, params):
        first[stored.run_id] = min(stored.seq, first.get(stored.run_id, stored.seq))
    return [first[row["run_id"]] + row["nth"] - 1 for row in rows]


def numbered_event_rows(
    items: Sequence[tuple[RunId, Attempt, str, JSONObject]],
) -> list[dict[str, Any]]:
    """The ``events`` rows parameter of ``items``: each with ``nth``, its place in its run's."""
    places: dict[str, int] = {}
    rows: list[dict[str, Any]] = []
    for run_id, attempt, event_type, data in items:
        places[run_id] = nth = places.get(run_id, 0) + 1
        rows.append(
            {"run_id": run_id, "nth": nth, "type": event_type, "attempt": attempt, "data": data}
        )
    return rows


@functools.cache
def events_from_runs_statement(*, data_from_error: bool = False) -> Insert:
    """One event for each of the runs ``ids``, at its next ``seq``: an ``INSERT … SELECT``.

    For a transition that just changed the runs' rows in the caller's transaction: the event's
    attempt is the row's ``attempt``, its time the row's ``updated_at`` (the transition's
    database time), its type the ``type`` parameter and its data the ``data`` parameter, or
    the row's ``error`` with ``data_from_error``. Each run's ``seq`` is one past its last
    event, read by the statement itself: the caller holds the runs' rows (their locks, or
    SQLite's write lock) and every event writer of a run holds its row, so no event of these
    runs lands between that read and the insert, and the statement, starting after the rows
    were taken, sees every earlier writer's commit. One statement for the whole batch, and no
    ``max(seq)`` round trip or per-event parameters.
    """
    chosen = _one_event_per_row(runs, data_from_error=data_from_error)
    return _insert_events(chosen.where(runs.c.id.in_(bindparam("ids", expanding=True))))


@functools.lru_cache(maxsize=128)
def transition_with_events(transition: Update, *, data_from_error: bool = False) -> Insert:
    """``transition`` and :func:`events_from_runs_statement`'s events, as one statement.

    ``WITH moved AS (UPDATE runs … RETURNING …) INSERT INTO events … SELECT … FROM moved``:
    one event per run the UPDATE changed, from its new row, for backends with the capability
    ``dml_in_cte``; a round trip less than the two statements. The statement's rowcount is
    the number of runs changed. ``transition`` must be a statement built once (it is the
    cache's key) whose parameters are not named ``type`` or ``data``.
    """
    returned = (runs.c.id, runs.c.attempt, runs.c.updated_at, runs.c.error)
    moved = transition.returning(*returned).cte("moved")
    return _insert_events(_one_event_per_row(moved, data_from_error=data_from_error)).add_cte(moved)


def _one_event_per_row(source: FromClause, *, data_from_error: bool) -> Select[Any]:
    """One event's columns per row of ``source`` (runs, or runs just changed)."""
    prior = events.alias("prior")
    last_seq = (
        select(func.coalesce(func.max(prior.c.seq), 0))
        .where(prior.c.run_id == source.c.id)
        .scalar_subquery()
    )
    data = source.c.error if data_from_error else bindparam("data", type_=events.c.data.type)
    return select(
        source.c.id,
        last_seq + 1,
        bindparam("type", type_=events.c.type.type),
        source.c.attempt,
        data,
        source.c.updated_at,
    )


def _insert_events(chosen: Select[Any]) -> Insert:
    columns = ["run_id", "seq", "type", "attempt", "data", "created_at"]
    return insert(events).from_select(columns, chosen)


def first_event_statement(source: CTE, condition: ColumnElement[bool] | None = None) -> Insert:
    """The first event of each run a CTE just inserted, in the CTE's own statement.

    ``source`` is an ``INSERT INTO runs … RETURNING id, attempt, updated_at``; one event per
    row it returns, at ``seq`` 1 (a new run has no event yet), with the row's attempt and
    ``updated_at``, the ``type`` and ``data`` parameters. The CTE goes to the top of the
    statement, where PostgreSQL wants data-modifying ones. Returns each event's ``run_id`` and
    ``created_at``, so a caller that let the database set the time learns it here.
    ``condition``: a true condition the events' ``SELECT`` is to evaluate for what it does (a
    backend's ``notify_condition``).
    """
    chosen = select(
        source.c.id,
        literal(1, type_=events.c.seq.type),
        bindparam("type", type_=events.c.type.type),
        source.c.attempt,
        bindparam("data", type_=events.c.data.type),
        source.c.updated_at,
    )
    if condition is not None:
        chosen = chosen.where(condition)
    stmt = _insert_events(chosen).add_cte(source)
    return stmt.returning(events.c.run_id, events.c.created_at)


def event_from_row(row: RowMapping) -> Event:
    """The :class:`Event` an ``events`` row holds."""
    return Event(
        run_id=RunId(row["run_id"]),
        seq=row["seq"],
        type=row["type"],
        attempt=Attempt(row["attempt"]),
        data=row["data"],
        created_at=row["created_at"],
    )


async def append_fenced_events_txn(
    conn: AsyncConnection,
    dialect: DialectName,
    fence: Fence,
    items: Sequence[tuple[str, JSONObject]],
) -> list[Event]:
    """Append ``(type, data)`` events under ``fence``; the caller already holds the fence.

    Args:
        conn: The caller's connection, inside its write transaction, after
            :func:`~moorline.db.repos.fences.hold_fence_txn`.
        dialect: The database's dialect.
        fence: The attempt the events are written under.
        items: ``(event type, data)`` per event.

    Returns:
        The events as stored, in item order.
    """
    if not items:
        return []
    now: datetime = (await conn.execute(backend_for(dialect).select_now())).scalar_one()
    rows = [(fence.run_id, fence.attempt, event_type, data) for event_type, data in items]
    seqs = await append_events_txn(conn, dialect, rows, now=now)
    return [
        Event(
            run_id=fence.run_id,
            seq=seq,
            type=event_type,
            attempt=fence.attempt,
            data=data,
            created_at=now,
        )
        for seq, (event_type, data) in zip(seqs, items, strict=True)
    ]


class EventsRepo:
    """Reads a run's events; appends a workflow's own events under the attempt's fence."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db
        self._backend: Backend = db.backend

    async def append_many(
        self, fence: Fence, items: Sequence[tuple[str, JSONObject]]
    ) -> builtins.list[Event]:
        """Append ``(type, data)`` events to the fence's run, at consecutive ``seq``, if it holds.

        One transaction: the fence's row lock serialises the run's writers, which makes the
        ``seq`` safe. Not wrapped in ``with_retry``: an append is not idempotent, and a retry
        after a lost commit acknowledgement would record the events twice.

        Returns:
            The events as stored, in item order.

        Raises:
            LeaseLost: The fence no longer holds; nothing was written.
        """
        if not items:
            return []
        async with self._db.write_transaction() as conn:
            await hold_fence_txn(conn, self._backend.name, fence, f"{len(items)} events")
            return await append_fenced_events_txn(conn, self._backend.name, fence, items)

    async def list(
        self, run_id: RunId, *, after_seq: int = 0, limit: int = DEFAULT_LIST_LIMIT
    ) -> list[Event]:
        """The run's events with ``seq`` above ``after_seq``, in ``seq`` order.

        Args:
            run_id: The run whose events to read; an unknown run has none.
            after_seq: Return only events after this one (an SSE ``Last-Event-ID``).
            limit: Most events to return; page on with the last ``seq`` returned.
        """
        if limit < 1:
            return []
        stmt = (
            select(events)
            .where(events.c.run_id == run_id, events.c.seq > after_seq)
            .order_by(events.c.seq)
            .limit(limit)
        )

        async def read() -> list[Event]:
            async with self._db.connect() as conn:
                return [event_from_row(row) for row in (await conn.execute(stmt)).mappings()]

        return await self._db.with_retry(read)
