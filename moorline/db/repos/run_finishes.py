"""How attempts end: :meth:`RunFinishes.finish_many` and the outcomes a worker reports.

An outcome applies only under its fence (run, attempt, owner, ``running``); a worker whose
lease was taken over matches no row and writes nothing, not even an event. A run whose cancel
is recorded ends ``cancelled`` unless its workflow returned: the request wins over a failure or
a retry not yet written, but a success is the workflow's code having run to its end, every
side effect done, so its output is kept (a cancel is a request; once the code has returned
there is nothing left to stop, docs/api.md "Cancel").

The time comes from the database only, read in the statement that locks the rows and bound as
a value (rather than the SQL function per row), so a batch has one clock reading.
"""

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple, TypeAlias

from sqlalchemy import (
    Executable,
    Select,
    String,
    Update,
    and_,
    bindparam,
    case,
    func,
    null,
    select,
    tuple_,
    update,
)
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.backends import DialectName, backend_for
from moorline.db.repos.events import (
    EVENT_CANCELLED,
    EVENT_FAILED,
    EVENT_RETRYING,
    EVENT_SUCCEEDED,
    EVENT_TIMED_OUT,
    append_events_txn,
    events_from_runs_statement,
    numbered_event_rows,
    transition_with_events,
    transition_with_given_events,
)
from moorline.db.repos.records import Fence, is_running
from moorline.db.repos.run_reads import IN_CHUNK, RunRepoBase, db_now_txn
from moorline.db.schema import runs
from moorline.types import JSONObject, JSONValue, RunId, RunStatus


@dataclass(frozen=True, slots=True, kw_only=True)
class Succeeded:
    """The attempt under ``fence`` returned ``output``: the run ends ``succeeded``.

    Attributes:
        fence: The attempt's fence.
        output: What the workflow returned.
        events: The attempt's last events, ``(type, data)``, not written yet: appended
            before the outcome's own event, in the same transaction, if the outcome applies
            (every outcome has them: a workflow that returned may still end otherwise).
    """

    fence: Fence
    output: JSONValue
    events: Sequence[tuple[str, JSONObject]] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Failed:
    """The attempt under ``fence`` raised.

    Attributes:
        fence: The attempt's fence.
        error: What went wrong, e.g. ``{"type": "ValueError", "message": "…", "reason": "retry"}``
            (``reason`` is the retry policy's: ``retry``, ``max attempts``, ``non-retryable``).
        retry_delay_s: None to fail the run for good (``failed``); a number of seconds to put
            it back to ``queued``, claimable from database time + that delay.
        events: As :attr:`Succeeded.events`.
    """

    fence: Fence
    error: JSONObject
    retry_delay_s: float | None
    events: Sequence[tuple[str, JSONObject]] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Stopped:
    """The attempt under ``fence`` was stopped from outside: the run ends ``status``, for good.

    Attributes:
        fence: The attempt's fence.
        status: ``cancelled`` (the run's cancel was seen) or ``timed_out`` (the attempt ran
            past its hard time limit).
        error: What stopped it, kept as the run's ``error`` and as the event's data, e.g.
            ``{"type": "TimeLimitExceeded", "message": "…", "reason": "timeout"}``; None for
            a cancel (its event is ``{"reason": "cancelled"}``, as the reaper writes it).
        events: As :attr:`Succeeded.events`.
    """

    fence: Fence
    status: RunStatus
    error: JSONObject | None = None
    events: Sequence[tuple[str, JSONObject]] = ()

    def __post_init__(self) -> None:
        if self.status not in _STOPPED_STATUSES:
            raise ValueError(f"a stopped attempt ends cancelled or timed_out, not {self.status}")


_STOPPED_STATUSES = frozenset({RunStatus.CANCELLED, RunStatus.TIMED_OUT})

Outcome: TypeAlias = Succeeded | Failed | Stopped


class _Held(NamedTuple):
    """A running run as ``finish_many`` found it under its row lock."""

    attempt: int
    owner: str | None
    started_at: datetime
    is_cancel_requested: bool

    def is_held_by(self, fence: Fence) -> bool:
        return (self.attempt, self.owner) == (fence.attempt, fence.owner)


class RunFinishes(RunRepoBase):
    """Records how attempts ended, each under its fence."""

    async def finish_many(self, outcomes: Sequence[Outcome]) -> list[bool]:
        """Record how attempts ended, each under its fence, all in one transaction.

        The runs' rows are locked first (with the database time read beside them), and an
        outcome applies only when its fence holds on its row. The applied outcomes of one
        kind are written by one UPDATE carrying every one of their fences, its rowcount
        checked, and their events by one ``INSERT … SELECT`` (``retrying``: one multi-row
        INSERT); an outcome that did not apply writes nothing:

        * :class:`Succeeded` → ``succeeded`` with ``output`` (``error`` cleared), event
          ``succeeded`` (every outcome's ``events`` come before its own event);
        * :class:`Failed` with ``retry_delay_s`` → ``queued``, claimable from database time +
          the delay, ``error`` kept, ``attempt`` unchanged (the next claim increments it),
          event ``retrying`` ``{"delay_s", "error"}``;
        * :class:`Failed` without → ``failed`` with ``error``, event ``failed`` (data: the
          error);
        * :class:`Stopped` → ``cancelled`` (event ``cancelled`` ``{"reason": "cancelled"}``,
          ``cancel_requested_at`` set if the cancel came through the RuntimeStore only) or
          ``timed_out`` with ``error`` (event ``timed_out``, data: the error).

        Any outcome but a success of a run whose cancel is recorded (``cancel_requested_at``,
        read under the row lock) is written as a cancel: a requested cancel ends the run
        ``cancelled``, never ``queued`` again, never ``failed``. A success is written as a
        success, the request kept in ``cancel_requested_at``: the workflow returned before it
        saw the request, and its output is the truth about what was done.

        Every applied outcome clears the lease; the terminal ones set ``finished_at`` and
        ``elapsed_time`` (seconds from the first ``started_at``), from database time.

        A batch retried after a lost connection reports False for outcomes its first try had
        already committed (their fences no longer match); the runs are finished all the same.

        Returns:
            Per outcome, in the order given, whether it applied; False when the fence no
            longer holds (the run was reclaimed, cancelled, finished, or never ours), also
            when an earlier outcome of the same batch ended the run.
        """
        if not outcomes:
            return []

        async def write() -> list[bool]:
            async with self._db.write_transaction() as conn:
                return await self.finish_txn(conn, outcomes, ends_transaction=True)

        return await self._db.with_retry(write)

    async def finish_txn(
        self,
        conn: AsyncConnection,
        outcomes: Sequence[Outcome],
        *,
        ends_transaction: bool,
        then_claims: bool = False,
    ) -> list[bool]:
        """:meth:`finish_many` in the caller's write transaction (not retried here).

        ``ends_transaction``: nothing is written after, so the last statement may carry the
        commit; False when the caller goes on (a claim of the freed slots).
        ``then_claims``: a claim follows in the transaction; when there are outcomes, their
        runs' lock also makes the rest of the transaction read in index order
        (``Backend.index_order_condition``), so the claim need not.
        """
        applied = [False] * len(outcomes)
        if not outcomes:
            return applied
        trailing: dict[RunId, Sequence[tuple[str, JSONObject]]] = {}
        running, now = await self._lock_running_txn(conn, outcomes, then_claims)
        if not running:
            return applied
        groups: dict[str, list[_Finish]] = {}
        for index, outcome in enumerate(outcomes):
            fence = outcome.fence
            held = running.get(fence.run_id)
            if held is None or not held.is_held_by(fence):
                # The fence does not hold: the run was reclaimed, finished, or ended by an
                # earlier outcome of this batch (a stale attempt and the current one of the
                # same run may come together).
                continue
            del running[fence.run_id]
            if held.is_cancel_requested and not isinstance(outcome, Succeeded):
                outcome = Stopped(fence=fence, status=RunStatus.CANCELLED, events=outcome.events)
            finish = _finish_of(outcome, now, held.started_at)
            groups.setdefault(finish.kind, []).append(finish)
            applied[index] = True
            trailing[fence.run_id] = outcome.events
        chunks = [
            (kind, group[offset : offset + _FINISH_CHUNK])
            for kind, group in groups.items()
            for offset in range(0, len(group), _FINISH_CHUNK)
        ]
        if self._with_given_events and any(trailing.values()):
            for kind, chunk in chunks:
                await self._finish_group_with_events_txn(conn, kind, chunk, now, trailing)
            return applied
        # Before the terminal events, which take the next seq after them.
        items = [
            (finish.fence.run_id, finish.fence.attempt, *event)
            for group in groups.values()
            for finish in group
            for event in trailing[finish.fence.run_id]
        ]
        await append_events_txn(conn, self._backend.name, items, now=now)
        for index, (kind, chunk) in enumerate(chunks):
            is_last = ends_transaction and index == len(chunks) - 1
            await self._finish_group_txn(conn, kind, chunk, now, is_last=is_last)
        return applied

    @functools.cached_property
    def _with_given_events(self) -> bool:
        """Whether an attempt's last events can go in its outcome's statement (PostgreSQL).

        Only outcomes that carry events take that way: without any, the outcome's event comes
        from its UPDATE's returned rows, with no rows parameter to encode and read.
        """
        probe = _finish_update(EVENT_SUCCEEDED, 1)
        return transition_with_given_events(self._backend.name, probe) is not None

    async def _finish_group_with_events_txn(
        self,
        conn: AsyncConnection,
        kind: str,
        group: Sequence["_Finish"],
        now: datetime,
        trailing: Mapping[RunId, Sequence[tuple[str, JSONObject]]],
    ) -> None:
        """End ``group`` with one statement: its UPDATE, each attempt's last events, its event.

        Each run's events are its attempt's own last ones, then the outcome's
        (:func:`~moorline.db.repos.events.transition_with_given_events`).
        """
        finish, params = _finish_statement(kind, group, now)
        stmt = transition_with_given_events(self._backend.name, finish)
        assert stmt is not None  # _with_given_events
        items = [
            (f.fence.run_id, f.fence.attempt, *event)
            for f in group
            for event in (*trailing[f.fence.run_id], (kind, f.event_data))
        ]
        params["events"] = numbered_event_rows(items)
        result = await conn.execute(stmt, params)
        # An event is written only for a run the UPDATE changed: all of them, or a lock failed.
        if result.rowcount != len(items):  # pragma: no cover - would be a locking bug
            raise AssertionError(f"finish {kind}: {result.rowcount} of {len(items)} events")

    async def _finish_group_txn(
        self,
        conn: AsyncConnection,
        kind: str,
        group: Sequence["_Finish"],
        now: datetime,
        *,
        is_last: bool,
    ) -> None:
        """End ``group`` (outcomes of one kind) with one UPDATE, then append their events.

        The UPDATE carries every fence and its rowcount is checked; the rows are locked (or,
        on SQLite, the whole database is), so every fence found holding still holds here.
        ``is_last``: the transaction ends after this group, so an events statement executed
        once may carry its commit (``DatabaseManager.commit_with_next_statement``).
        """
        finish, params = _finish_statement(kind, group, now)
        from_error = kind in _EVENT_DATA_IS_ERROR
        # One event per run, from its new row: with the UPDATE in one statement where it can.
        merged = (from_error or kind in _EVENT_DATA) and self._backend.capabilities.dml_in_cte
        stmt: Executable = finish
        if merged:
            stmt = transition_with_events(finish, data_from_error=from_error)
            params |= {"type": kind, "data": _EVENT_DATA.get(kind)}
        result = await conn.execute(stmt, params)
        if result.rowcount != len(group):  # pragma: no cover - would be a locking bug
            raise AssertionError(f"finish {kind}: {result.rowcount} of {len(group)} locked runs")
        if merged:
            return
        if from_error or kind in _EVENT_DATA:
            # The event's data is the same for every run of the group, or is the error the
            # UPDATE just stored: one INSERT … SELECT reads each run's next seq itself.
            ids = [finish.fence.run_id for finish in group]
            params = {"ids": ids, "type": kind, "data": _EVENT_DATA.get(kind)}
            if is_last:
                await self._db.commit_with_next_statement(conn)
            await conn.execute(events_from_runs_statement(data_from_error=from_error), params)
            return
        items = [(f.fence.run_id, f.fence.attempt, kind, f.event_data) for f in group]
        await append_events_txn(conn, self._backend.name, items, now=now)

    async def _lock_running_txn(
        self, conn: AsyncConnection, outcomes: Sequence[Outcome], then_claims: bool = False
    ) -> tuple[dict[str, _Held], datetime]:
        """Lock the outcomes' runs; the ones still running, and the time to finish them at.

        Server databases lock the rows (``FOR UPDATE``, in id order so two batches never
        deadlock) and read their latest committed version after any wait; SQLite's ``BEGIN
        IMMEDIATE`` already holds the only write lock. Either way a fence found holding on
        these rows cannot be broken before this transaction commits. Each outcome's fence is
        compared by the caller: two outcomes of one run may carry different fences.

        The database time comes with the rows, saving a round trip; on a server it may be
        read before a wait for a row lock, which only makes the finish look that much
        earlier. ``then_claims``: see :meth:`finish_txn`.
        """
        run_ids = sorted({outcome.fence.run_id for outcome in outcomes})
        running: dict[str, _Held] = {}
        now: datetime | None = None
        for offset in range(0, len(run_ids), IN_CHUNK):
            chunk = run_ids[offset : offset + IN_CHUNK]
            # The index order is set by the first chunk's statement (the condition's effect
            # lasts to the transaction's end).
            stmt = _lock_running_statement(self._backend.name, then_claims and offset == 0)
            for row in await conn.execute(stmt, {"ids": chunk}):
                now = row.db_now if now is None else min(now, row.db_now)
                running[row.id] = _Held(
                    row.attempt,
                    row.lease_owner,
                    row.started_at,
                    row.cancel_requested_at is not None,
                )
        if now is None:
            now = await db_now_txn(conn, self._backend)
        return running, now


_CLEARED = {"lease_owner": None, "lease_expires_at": None}

_FINISH_CHUNK = 256
"""Outcomes per finish UPDATE: a few bound parameters each, far below every backend's limit."""

_EVENT_DATA: dict[str, JSONObject] = {
    EVENT_SUCCEEDED: {},
    EVENT_CANCELLED: {"reason": "cancelled"},
}
"""The event data of the kinds whose event data is the same for every run."""

_EVENT_DATA_IS_ERROR = frozenset({EVENT_FAILED, EVENT_TIMED_OUT})
"""The kinds whose event data is the error their UPDATE stores in the run's row.

Only ``retrying`` (its data carries the delay) needs per-event parameters.
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Finish:
    """One applied outcome: its fence, the kind of finish, its per-run values and event data."""

    fence: Fence
    kind: str
    values: dict[str, Any]
    """Per-run column values: ``output``, ``error``, ``elapsed_time``, ``not_before``."""
    event_data: JSONObject


_FINISH_VALUES: dict[str, dict[str, Any]] = {
    EVENT_SUCCEEDED: {"status": RunStatus.SUCCEEDED.value, "error": null()},
    EVENT_RETRYING: {"status": RunStatus.QUEUED.value},
    EVENT_FAILED: {"status": RunStatus.FAILED.value},
    EVENT_CANCELLED: {"status": RunStatus.CANCELLED.value},
    EVENT_TIMED_OUT: {"status": RunStatus.TIMED_OUT.value},
}
"""The columns a kind sets to the same value on every run (besides the lease and times)."""

_PER_RUN: dict[str, tuple[str, ...]] = {
    EVENT_SUCCEEDED: ("output", "elapsed_time"),
    EVENT_RETRYING: ("not_before", "error"),
    EVENT_FAILED: ("error", "elapsed_time"),
    EVENT_CANCELLED: ("elapsed_time",),
    EVENT_TIMED_OUT: ("error", "elapsed_time"),
}
"""The columns a kind sets per run, from :attr:`_Finish.values`."""


def _size_class(count: int) -> int:
    """The next power of two: finish statements are built (and cached) per size class."""
    return 1 << max(0, count - 1).bit_length()


@functools.lru_cache(maxsize=64)
def _finish_update(kind: str, size: int) -> Update:
    """The UPDATE ending up to ``size`` runs the same way, each under its fence.

    The fences are one row-value ``IN`` list (``id IN`` beside it lets every backend find the
    rows by primary key); the per-run values are ``CASE id WHEN …`` over ``size`` slots, of
    which the unused ones name no run. One statement for a whole batch: MariaDB's driver sends
    an ``executemany`` of UPDATEs as one round trip per row.
    """
    ids = [bindparam(f"id_{index}", type_=String()) for index in range(size)]
    values: dict[str, Any] = {**_CLEARED, **_FINISH_VALUES[kind]}
    for column in _PER_RUN[kind]:
        whens = {
            run_id: bindparam(f"{column}_{index}", type_=runs.c[column].type)
            for index, run_id in enumerate(ids)
        }
        values[column] = case(whens, value=runs.c.id)
    values["updated_at"] = bindparam("now", type_=runs.c.updated_at.type)
    if kind != EVENT_RETRYING:
        values["finished_at"] = values["updated_at"]
    if kind == EVENT_CANCELLED:
        # Set by request_cancel; a cancel signalled through the RuntimeStore alone is dated
        # here, so every cancelled run has the time its cancel was recorded.
        values["cancel_requested_at"] = func.coalesce(
            runs.c.cancel_requested_at, values["updated_at"]
        )
    fenced = and_(
        runs.c.id.in_(bindparam("fence_ids", expanding=True)),
        tuple_(runs.c.id, runs.c.attempt, runs.c.lease_owner).in_(
            bindparam("fences", expanding=True)
        ),
        is_running(),
    )
    return update(runs).where(fenced).values(**values)


def _finish_statement(
    kind: str, group: Sequence[_Finish], now: datetime
) -> tuple[Update, dict[str, Any]]:
    """The UPDATE ending ``group`` (one kind) at ``now``, and its parameters."""
    size = _size_class(len(group))
    params: dict[str, Any] = {
        "now": now,
        "fence_ids": [f.fence.run_id for f in group],
        "fences": [(f.fence.run_id, f.fence.attempt, f.fence.owner) for f in group],
    }
    columns = _PER_RUN[kind]
    for index in range(size):
        finish = group[index] if index < len(group) else None
        # An unused slot names no run (NULL never equals an id) and sets nothing.
        params[f"id_{index}"] = None if finish is None else finish.fence.run_id
        for column in columns:
            params[f"{column}_{index}"] = None if finish is None else finish.values[column]
    return _finish_update(kind, size), params


def _finish_of(outcome: Outcome, now: datetime, started_at: datetime) -> _Finish:
    """How an applied ``outcome`` ends its run at ``now``: kind, column values, event data."""
    fence = outcome.fence
    elapsed_s = max(0.0, (now - started_at).total_seconds())
    if isinstance(outcome, Succeeded):
        values: dict[str, Any] = {"output": outcome.output, "elapsed_time": elapsed_s}
        return _Finish(fence=fence, kind=EVENT_SUCCEEDED, values=values, event_data={})
    if isinstance(outcome, Stopped):
        if outcome.status is RunStatus.CANCELLED:
            values = {"elapsed_time": elapsed_s}
            data: JSONObject = {"reason": "cancelled"}
            return _Finish(fence=fence, kind=EVENT_CANCELLED, values=values, event_data=data)
        error: JSONObject = outcome.error if outcome.error is not None else {"reason": "timeout"}
        values = {"error": error, "elapsed_time": elapsed_s}
        return _Finish(fence=fence, kind=EVENT_TIMED_OUT, values=values, event_data=error)
    if outcome.retry_delay_s is not None:
        delay_s = max(0.0, outcome.retry_delay_s)
        values = {"not_before": now + timedelta(seconds=delay_s), "error": outcome.error}
        data = {"delay_s": delay_s, "error": outcome.error}
        return _Finish(fence=fence, kind=EVENT_RETRYING, values=values, event_data=data)
    values = {"error": outcome.error, "elapsed_time": elapsed_s}
    return _Finish(fence=fence, kind=EVENT_FAILED, values=values, event_data=outcome.error)


@functools.cache
def _lock_running_statement(name: DialectName, index_order: bool = False) -> Select[Any]:
    """The running runs among ``ids`` (locked on the servers), with the database time.

    ``index_order``: the statement also makes the rest of its transaction read in index
    order, where the backend has a condition for it.
    """
    backend = backend_for(name)
    stmt = (
        select(
            runs.c.id,
            runs.c.attempt,
            runs.c.lease_owner,
            runs.c.started_at,
            runs.c.cancel_requested_at,
            backend.now().label("db_now"),
        )
        .where(
            runs.c.id.in_(bindparam("ids", expanding=True)),
            is_running(),
        )
        .order_by(runs.c.id)
    )
    condition = backend.index_order_condition() if index_order else None
    if condition is not None:
        stmt = stmt.where(condition)
    return stmt.with_for_update() if backend.capabilities.row_locks else stmt
