"""The reaper's SQL: taking back runs whose lease expired, fenced by the attempt.

Every move is one conditional UPDATE with the whole eligibility predicate on the row it
changes (same id, same attempt, still ``running``, lease expired), and only the runs that really
moved get their event, in the same transaction. A late heartbeat, a finishing worker or another
reaper makes it match zero rows. Where a reaped run goes is
:func:`moorline.db.fairness.expired_lease_outcome`.
"""

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any

from sqlalchemy import ColumnElement, and_, case, select, tuple_, update
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.backends import Backend
from moorline.db.fairness import expired_lease_outcome
from moorline.db.manager import DatabaseManager
from moorline.db.repos.events import (
    EVENT_CANCELLED,
    EVENT_FAILED,
    EVENT_RECLAIMED,
    append_events_txn,
)
from moorline.db.schema import runs
from moorline.types import Attempt, JSONObject, RunId, RunStatus

logger = logging.getLogger(__name__)

MAX_ATTEMPTS_REASON = "max attempts"
"""``error.reason`` of a run the reaper failed because its attempts were used up."""

DEFAULT_REAP_LIMIT = 100

_REAP_CHUNK = 500
"""Runs per reaper UPDATE (three bound parameters each), whatever the batch limit."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Reaped:
    """A run the reaper took back from an expired lease, and where it went."""

    run_id: RunId
    lane: str
    attempt: Attempt
    status: RunStatus


@dataclass(frozen=True, slots=True, kw_only=True)
class _Expired:
    """An expired run as the reaper read it, and the outcome that state decides."""

    run_id: RunId
    lane: str
    attempt: Attempt
    max_attempts: int
    status: RunStatus
    event: str
    data: JSONObject

    @classmethod
    def classify(
        cls,
        *,
        run_id: RunId,
        lane: str,
        attempt: Attempt,
        max_attempts: int,
        cancel_requested: bool,
        resumes: int = 0,
    ) -> "_Expired":
        """The run with its outcome (:func:`expired_lease_outcome`), event and event data.

        Claims after a resume are no failures: the budget counts ``attempt - resumes``.
        """
        tries = attempt - resumes
        status = expired_lease_outcome(
            attempt=tries, max_attempts=max_attempts, cancel_requested=cancel_requested
        )
        event, reason = _EVENTS[status]
        data: JSONObject = {"reason": reason}
        if status is RunStatus.FAILED:
            data["message"] = f"lease expired on attempt {tries} of {max_attempts}"
        return cls(
            run_id=run_id,
            lane=lane,
            attempt=attempt,
            max_attempts=max_attempts,
            status=status,
            event=event,
            data=data,
        )


_EVENTS: dict[RunStatus, tuple[str, str]] = {
    RunStatus.CANCELLED: (EVENT_CANCELLED, "cancelled"),
    RunStatus.FAILED: (EVENT_FAILED, MAX_ATTEMPTS_REASON),
    RunStatus.QUEUED: (EVENT_RECLAIMED, "lease expired"),
}
"""Each outcome's event and its ``reason``."""


_Move = tuple[list[_Expired], ColumnElement[bool], dict[str, Any]]
"""Runs moving to one outcome: the runs, the outcome's predicate on the row, the new values."""


def _expired_by(now: datetime | ColumnElement[datetime]) -> tuple[ColumnElement[bool], ...]:
    """A running run whose lease expired before ``now`` (the reaper's predicate on the row)."""
    return (runs.c.status == RunStatus.RUNNING.value, runs.c.lease_expires_at < now)


class ReapingRepo:
    """The reaper's statements over one :class:`DatabaseManager`."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db

    async def reap_expired(
        self,
        *,
        limit: int = DEFAULT_REAP_LIMIT,
        backoff: Callable[[Attempt], float] | None = None,
    ) -> list[Reaped]:
        """Take back up to ``limit`` runs whose lease expired by database time.

        One transaction per batch. It reads database time once (``now``), then takes the
        expired runs, oldest lease first: ``SELECT … FOR UPDATE SKIP LOCKED`` on PostgreSQL and
        MariaDB, so concurrent reapers split the expired runs instead of queueing behind each
        other, and a run whose heartbeat holds its row is skipped; on SQLite ``BEGIN
        IMMEDIATE`` already holds the database's write lock. One ``UPDATE`` per outcome then
        moves exactly those runs, each with the whole eligibility predicate repeated on the
        row: same id, same attempt, still ``running``, lease expired before ``now``, and the
        cancel flag and attempt budget of its outcome. A late heartbeat, a finishing worker or
        another reaper thus makes it match zero rows. The runs that really moved (``RETURNING``
        on SQLite and PostgreSQL; a re-read under the row locks on MariaDB) get their event in
        the same transaction. A reaper that dies mid-batch moves nothing of it; the next pass
        takes it.

        A run this call saw expired (a plain read first) but the batch skipped was locked by
        another transaction, usually a fenced write of the old attempt. If it still looks
        expired once the batch has committed, it is waited for in a transaction of its own
        (one row lock, so no deadlock) and moved by the same predicate, so a call takes every
        expired run it saw unless someone else renewed, finished or reaped it.

        * cancel requested → ``cancelled`` (never resurrected), event ``cancelled``;
        * ``attempt >= max_attempts`` → ``failed`` with ``error.reason == "max attempts"``,
          event ``failed``;
        * otherwise → ``queued`` with ``attempt`` unchanged (the next claim increments it),
          event ``reclaimed``; ``not_before`` unchanged (its place in the lane's order) or,
          with a ``backoff``, database time + ``backoff(attempt)``.

        A call that finds nothing expired is that one plain read: no write transaction, so an
        idle reaper never takes SQLite's write lock.

        Args:
            limit: Most runs to examine in this call.
            backoff: Seconds before a reclaimed run may be claimed again; None for at once.

        Returns:
            The runs this call moved, the batch's oldest lease first; runs another reaper got
            first are not included.
        """
        if limit < 1:
            return []
        seen = await self._db.with_retry(partial(self._expired_ids, limit, None))
        if not seen:
            return []
        reaped = await self._db.with_retry(partial(self._reap_batch, limit, backoff, None))
        # Runs seen expired that the batch skipped were locked by another transaction: a
        # fenced write of the old attempt, a heartbeat, another reaper. Each one still expired
        # once re-read is waited for, alone in its transaction (one row lock held, so no
        # deadlock), and taken if its lease is still expired then.
        taken = {run.run_id for run in reaped}
        left = [run_id for run_id in seen if run_id not in taken]
        while left:
            left = await self._db.with_retry(partial(self._expired_ids, len(left), left))
            if not left:
                break
            one, left = left[:1], left[1:]
            reaped += await self._db.with_retry(partial(self._reap_batch, 1, backoff, one))
        for run in reaped:
            logger.info(
                "reaped run with an expired lease to %s",
                run.status.value,
                extra={"run_id": run.run_id, "attempt": run.attempt},
            )
        return reaped

    async def _expired_ids(self, limit: int, among: Sequence[RunId] | None) -> list[RunId]:
        """A plain read (no lock, no write transaction) of expired runs, oldest lease first."""
        stmt = select(runs.c.id).where(*_expired_by(self._db.backend.now()))
        if among is not None:
            stmt = stmt.where(runs.c.id.in_(among))
        stmt = stmt.order_by(runs.c.lease_expires_at, runs.c.id).limit(limit)
        async with self._db.connect() as conn:
            return [RunId(run_id) for run_id in (await conn.execute(stmt)).scalars()]

    async def _reap_batch(
        self,
        limit: int,
        backoff: Callable[[Attempt], float] | None,
        only: Sequence[RunId] | None,
    ) -> list[Reaped]:
        """One transaction: lock expired runs, move them, append their events.

        ``only`` None: any expired runs, skipping locked rows. Otherwise just those runs,
        waiting for their locks (the caller passes one at a time).
        """
        backend = self._db.backend
        async with self._db.write_transaction() as conn:
            now: datetime = (await conn.execute(backend.select_now())).scalar_one()
            expired = await self._lock_expired_txn(conn, now, limit, only)
            if not expired:
                return []
            moved = await self._move_expired_txn(conn, expired, now, backoff)
            reaped = [e for e in expired if e.run_id in moved]
            await append_events_txn(
                conn,
                backend.name,
                [(e.run_id, e.attempt, e.event, e.data) for e in reaped],
                now=now,
            )
        return [
            Reaped(run_id=e.run_id, lane=e.lane, attempt=e.attempt, status=e.status) for e in reaped
        ]

    async def _lock_expired_txn(
        self, conn: AsyncConnection, now: datetime, limit: int, only: Sequence[RunId] | None
    ) -> list[_Expired]:
        """The ``limit`` runs whose lease expired longest before ``now``, locked (servers).

        Rows other transactions hold are skipped, unless ``only`` names the runs: then their
        locks are waited for, and a run whose row changed meanwhile no longer matches.
        """
        stmt = (
            select(
                runs.c.id,
                runs.c.lane,
                runs.c.attempt,
                runs.c.max_attempts,
                runs.c.resumes,
                runs.c.cancel_requested_at.is_not(None).label("cancel_requested"),
            )
            .where(*_expired_by(now))
            .order_by(runs.c.lease_expires_at, runs.c.id)
            .limit(limit)
        )
        if only is None:
            stmt = self._db.backend.lock_rows_skip_locked(stmt)
        else:
            stmt = self._db.backend.lock_rows(stmt.where(runs.c.id.in_(only)))
        rows = await conn.execute(stmt)
        return [
            _Expired.classify(
                run_id=RunId(row.id),
                lane=row.lane,
                attempt=Attempt(row.attempt),
                max_attempts=row.max_attempts,
                cancel_requested=bool(row.cancel_requested),
                resumes=row.resumes,
            )
            for row in rows
        ]

    async def _move_expired_txn(
        self,
        conn: AsyncConnection,
        expired: Sequence[_Expired],
        now: datetime,
        backoff: Callable[[Attempt], float] | None,
    ) -> set[RunId]:
        """Move ``expired`` to their outcomes, one UPDATE per outcome; the ids that moved."""
        cleared: dict[str, Any] = {"lease_owner": None, "lease_expires_at": None, "updated_at": now}
        cancelled = [e for e in expired if e.status is RunStatus.CANCELLED]
        failed = [e for e in expired if e.status is RunStatus.FAILED]
        requeued = [e for e in expired if e.status is RunStatus.QUEUED]
        moves: list[_Move] = []
        if cancelled:
            moves.append(
                (
                    cancelled,
                    runs.c.cancel_requested_at.is_not(None),
                    {**cleared, "status": RunStatus.CANCELLED.value, "finished_at": now},
                )
            )
        moves += _fail_moves(failed, cleared, now)
        if requeued:
            moves.append(_requeue_move(requeued, cleared, backoff, self._db.backend))
        moved: set[RunId] = set()
        for group, outcome, values in moves:
            for offset in range(0, len(group), _REAP_CHUNK):
                chunk = group[offset : offset + _REAP_CHUNK]
                moved |= await self._move_txn(conn, chunk, now, outcome, values)
        return moved

    async def _move_txn(
        self,
        conn: AsyncConnection,
        group: Sequence[_Expired],
        now: datetime,
        outcome: ColumnElement[bool],
        values: Mapping[str, Any],
    ) -> set[RunId]:
        """One conditional UPDATE of ``group`` to one outcome; the ids it moved."""
        run_ids = [e.run_id for e in group]
        keys = [(e.run_id, e.attempt) for e in group]
        move = (
            update(runs)
            .where(
                # The whole predicate on the row being updated: a heartbeat that renewed the
                # lease, a worker that finished, or another reaper that moved the run make it
                # match nothing. ``id IN`` lets every backend find the rows by primary key.
                runs.c.id.in_(run_ids),
                tuple_(runs.c.id, runs.c.attempt).in_(keys),
                *_expired_by(now),
                outcome,
            )
            .values(**values)
        )
        if self._db.backend.capabilities.update_returning:
            result = await conn.execute(move.returning(runs.c.id))
            return {RunId(run_id) for run_id in result.scalars()}
        result = await conn.execute(move)
        # MariaDB: we hold every row's lock, so each must have matched; anything else is a bug
        # worth a loud log, and the re-read below returns only what this UPDATE moved (a locked
        # row leaves ``running`` only by this transaction, and only one UPDATE matches it).
        if result.rowcount != len(group):
            logger.error("reaped %d of %d locked runs", result.rowcount, len(group))
        gone = select(runs.c.id).where(
            runs.c.id.in_(run_ids),
            tuple_(runs.c.id, runs.c.attempt).in_(keys),
            runs.c.status == values["status"],
            runs.c.lease_owner.is_(None),
        )
        return {RunId(run_id) for run_id in (await conn.execute(gone)).scalars()}


def _fail_moves(
    failed: Sequence[_Expired], cleared: Mapping[str, Any], now: datetime
) -> list[_Move]:
    """The moves of runs out of attempts to ``failed``, one per (attempt, budget) read."""
    # The error names the attempt and its budget, so each pair read is its own group (almost
    # always one): the predicate pins max_attempts to the value in the message.
    budgets: dict[tuple[int, int], list[_Expired]] = {}
    for e in failed:
        budgets.setdefault((e.attempt, e.max_attempts), []).append(e)
    return [
        (
            group,
            and_(
                runs.c.cancel_requested_at.is_(None),
                runs.c.max_attempts == max_attempts,
                runs.c.attempt - runs.c.resumes >= runs.c.max_attempts,
            ),
            {
                **cleared,
                "status": RunStatus.FAILED.value,
                "finished_at": now,
                "error": group[0].data,
            },
        )
        for (_, max_attempts), group in budgets.items()
    ]


def _requeue_move(
    requeued: list[_Expired],
    cleared: Mapping[str, Any],
    backoff: Callable[[Attempt], float] | None,
    backend: Backend,
) -> _Move:
    """The move of runs with attempts left back to ``queued``, each after its backoff.

    Without a backoff a run keeps its ``not_before`` (in the past: it was claimed), which is
    its place in its lane's FIFO order: it is claimed again ahead of what was queued after
    it, so recovery costs the lease and a reaper pass, not the time to drain the backlog. A
    backoff places it at the time it becomes claimable.
    """
    delays = {e.attempt: backoff(e.attempt) if backoff is not None else 0.0 for e in requeued}
    values: dict[str, Any] = {**cleared, "status": RunStatus.QUEUED.value}
    if set(delays.values()) != {0.0}:
        # Database time plus the attempt's backoff, per attempt in one CASE.
        values["not_before"] = case(
            {a: backend.now(plus_s=s) for a, s in sorted(delays.items())},
            value=runs.c.attempt,
        )
    return (
        requeued,
        and_(
            runs.c.cancel_requested_at.is_(None),
            runs.c.attempt - runs.c.resumes < runs.c.max_attempts,
        ),
        values,
    )
