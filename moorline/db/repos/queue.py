"""Dispatch-side SQL: claiming runs, renewing and releasing leases, reaping, the leader lease.

Every transition here is a conditional statement whose predicate sits on the row it changes, and
every rowcount is checked (RELIABILITY.md §0.6): a predicate hidden in a subquery is not
re-evaluated after a lock wait, and two claimers then take the same run.

**Claim** (one transaction per batch):

1. *Rank* the lane's eligible runs (``queued``, ``not_before`` ≤ database time): priority
   first, then round-robin between tenants, then FIFO. The round-robin key of a tenant's n-th
   queued run is ``running + n`` (``row_number()`` per tenant plus its live ``running``
   count): every tenant's next run comes before any tenant's second, and a tenant with fewer
   runs in flight goes first, also when workers claim one run at a time. A tenant at its
   concurrency cap contributes nothing and one with ``k`` free slots at most ``k`` runs. One
   tenant's backlog thus delays another tenant of the same lane and priority by at most one
   run per slot. Priority still dominates: fairness applies between equal priorities.
2. On PostgreSQL and MariaDB, *lock the tenant rows* of the ranked runs, in id order (no
   deadlock between claimers), then count each tenant's ``running`` runs again and keep only
   as many candidates as that fresh count leaves free. Every claimer of a tenant holds that
   lock from its count to its commit, so counts and claims of one tenant are serialised and
   the cap holds at every commit, under any number of claimers. The count is of live rows,
   not a counter, so a dead worker's runs stop counting the moment the reaper takes them back.
   The ranking reads twice the batch, leaving spare candidates for those a concurrent claimer
   took while this one waited. On SQLite, ``BEGIN IMMEDIATE`` holds the database's single
   write lock for the whole claim, so the ranking's own count is already exact.
3. ``SELECT … FOR UPDATE SKIP LOCKED`` the chosen runs (server databases), then ``UPDATE``
   exactly those ids with the eligibility predicate repeated; SQLite updates with
   ``RETURNING``. The claim sets ``running``, ``attempt + 1`` (the fencing token), the owner,
   ``lease_expires_at`` from database time, ``started_at`` the first time, and appends one
   ``started`` event per run in the same transaction.

Claims are not wrapped in ``with_retry``: a commit whose acknowledgement was lost would be
repeated as a second batch, orphaning the first until its leases expire.
"""

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any

from sqlalchemy import (
    ColumnElement,
    RowMapping,
    Select,
    and_,
    case,
    delete,
    func,
    literal,
    select,
    tuple_,
    update,
)
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db import dialects
from moorline.db.dialects import DialectName, db_now
from moorline.db.manager import DatabaseManager

# The event names moved to events.py; re-exported (``as``) so imports from here keep working.
from moorline.db.repos.events import EVENT_CANCELLED as EVENT_CANCELLED
from moorline.db.repos.events import EVENT_FAILED as EVENT_FAILED
from moorline.db.repos.events import EVENT_RECLAIMED as EVENT_RECLAIMED
from moorline.db.repos.events import EVENT_RELEASED as EVENT_RELEASED
from moorline.db.repos.events import EVENT_STARTED as EVENT_STARTED
from moorline.db.repos.events import append_events_txn
from moorline.db.repos.records import Fence, Run, run_from_row
from moorline.db.schema import leader_leases, runs, tenants
from moorline.types import Attempt, JSONObject, RunId, RunStatus

logger = logging.getLogger(__name__)

MAX_ATTEMPTS_REASON = "max attempts"
"""``error.reason`` of a run the reaper failed because its attempts were used up."""

DEFAULT_REAP_LIMIT = 100

_REAP_CHUNK = 500
"""Runs per reaper UPDATE (three bound parameters each), whatever the batch limit."""

_QUEUED = RunStatus.QUEUED.value
_RUNNING = RunStatus.RUNNING.value


@dataclass(frozen=True, slots=True, kw_only=True)
class Claim:
    """A run this worker now holds: the fence for its writes and the run as claimed."""

    fence: Fence
    run: Run


@dataclass(frozen=True, slots=True, kw_only=True)
class Reaped:
    """A run the reaper took back from an expired lease, and where it went."""

    run_id: RunId
    lane: str
    attempt: Attempt
    status: RunStatus


@dataclass(frozen=True, slots=True, kw_only=True)
class _Candidate:
    run_id: str
    tenant_id: str
    cap: int
    free: int


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
    ) -> "_Expired":
        """Cancelled when asked to, failed when out of attempts, else requeued."""
        status: RunStatus
        data: JSONObject
        if cancel_requested:
            status, event, data = RunStatus.CANCELLED, EVENT_CANCELLED, {"reason": "cancelled"}
        elif attempt >= max_attempts:
            status, event = RunStatus.FAILED, EVENT_FAILED
            message = f"lease expired on attempt {attempt} of {max_attempts}"
            data = {"reason": MAX_ATTEMPTS_REASON, "message": message}
        else:
            status, event, data = RunStatus.QUEUED, EVENT_RECLAIMED, {"reason": "lease expired"}
        return cls(
            run_id=run_id,
            lane=lane,
            attempt=attempt,
            max_attempts=max_attempts,
            status=status,
            event=event,
            data=data,
        )


class QueueRepo:
    """Claims, leases, reaping and leader leases over one :class:`DatabaseManager`."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db
        self._dialect: DialectName = db.dialect

    # --- claim ------------------------------------------------------------------------------

    async def claim_batch(
        self,
        lane: str,
        owner: str,
        *,
        limit: int,
        lease_ttl_s: float,
        tenant_caps: Mapping[str, int],
        default_cap: int = 1,
    ) -> list[Claim]:
        """Claim up to ``limit`` runs of ``lane`` for ``owner``, in one transaction.

        Args:
            lane: The lane to claim from.
            owner: This worker's lease owner id (unique per worker process).
            limit: Most runs to claim; usually the worker's free slots in the lane.
            lease_ttl_s: Seconds until the lease expires without a heartbeat.
            tenant_caps: Plan name → most ``running`` runs a tenant on that plan may have.
            default_cap: The cap of a tenant whose plan is not in ``tenant_caps``; small on
                purpose, so a misconfigured plan under-runs instead of flooding.

        Returns:
            The claimed runs, highest priority first; fewer than ``limit`` (or none) when no
            more are eligible, or when another claimer took them first.
        """
        if limit < 1:
            return []
        caps = _cap_expression(tenant_caps, default_cap)
        row_locks = dialects.uses_row_locks(self._dialect)
        async with self._db.write_transaction() as conn:
            # Under row locks the ranking reads a snapshot that the tenant locks below may
            # outdate; ranking twice the batch leaves spare candidates for runs a concurrent
            # claimer of the same tenant took while this one waited for the lock.
            ranked = await self._rank_txn(conn, lane, limit * (2 if row_locks else 1), caps)
            if not ranked:
                return []
            free = {candidate.tenant_id: candidate.free for candidate in ranked}
            if row_locks:
                free = await self._lock_and_count_txn(conn, {c.tenant_id: c.cap for c in ranked})
            chosen = _take_within_caps(ranked, free, limit)
            order = {run_id: index for index, run_id in enumerate(chosen)}
            rows = await self._claim_rows_txn(conn, lane, owner, chosen, lease_ttl_s)
            rows.sort(key=lambda row: order[row["id"]])
            claims = [_claim_from_row(row) for row in rows]
            await append_events_txn(
                conn,
                self._dialect,
                [(c.fence.run_id, c.fence.attempt, EVENT_STARTED, {}) for c in claims],
            )
        return claims

    async def _lock_and_count_txn(
        self, conn: AsyncConnection, caps: Mapping[str, int]
    ) -> dict[str, int]:
        """Lock the tenants' rows, then return each one's free slots counted from live rows.

        The locks are taken in id order so two claimers never wait on each other in a cycle,
        and held to commit, so no other claimer of these tenants counts or claims in between.
        The count is a new statement after the lock wait: under READ COMMITTED it sees every
        claim the previous lock holder committed.
        """
        tenant_ids = sorted(caps)
        lock = select(tenants.c.id).where(tenants.c.id.in_(tenant_ids)).order_by(tenants.c.id)
        await conn.execute(dialects.lock_rows(lock, self._dialect))
        count = (
            select(runs.c.tenant_id, func.count().label("n"))
            .where(runs.c.tenant_id.in_(tenant_ids), runs.c.status == _RUNNING)
            .group_by(runs.c.tenant_id)
        )
        running = {row.tenant_id: row.n for row in await conn.execute(count)}
        return {tenant_id: cap - running.get(tenant_id, 0) for tenant_id, cap in caps.items()}

    async def _rank_txn(
        self, conn: AsyncConnection, lane: str, limit: int, caps: ColumnElement[int]
    ) -> list[_Candidate]:
        """The next ``limit`` runs to claim, in claim order (see the module docstring)."""
        stmt = self._rank_statement(lane, limit, caps)
        return [
            _Candidate(run_id=row.id, tenant_id=row.tenant_id, cap=row.cap, free=row.free)
            for row in await conn.execute(stmt)
        ]

    def _rank_statement(
        self, lane: str, limit: int, caps: ColumnElement[int]
    ) -> Select[tuple[str, str, int, int]]:
        busy = (
            select(runs.c.tenant_id, func.count().label("n"))
            .where(runs.c.status == _RUNNING)
            .group_by(runs.c.tenant_id)
            .subquery("busy")
        )
        turn = func.row_number().over(
            partition_by=runs.c.tenant_id,
            order_by=(runs.c.priority.desc(), runs.c.not_before, runs.c.id),
        )
        ranked = (
            select(
                runs.c.id,
                runs.c.tenant_id,
                runs.c.priority,
                runs.c.not_before,
                turn.label("turn"),
                func.coalesce(busy.c.n, 0).label("busy"),
                caps.label("cap"),
                (caps - func.coalesce(busy.c.n, 0)).label("free"),
            )
            .select_from(
                runs.join(tenants, tenants.c.id == runs.c.tenant_id).outerjoin(
                    busy, busy.c.tenant_id == runs.c.tenant_id
                )
            )
            .where(
                runs.c.status == _QUEUED,
                runs.c.lane == lane,
                runs.c.not_before <= db_now(self._dialect),
            )
            .subquery("ranked")
        )
        return (
            select(ranked.c.id, ranked.c.tenant_id, ranked.c.cap, ranked.c.free)
            # A tenant with k free slots contributes its first k runs; one at its cap, none.
            .where(ranked.c.turn <= ranked.c.free)
            # Round-robin over live state: a tenant's n-th queued run counts as its
            # (running + n)-th, so the tenant with fewer runs in flight goes first even when
            # workers claim one run at a time.
            .order_by(
                ranked.c.priority.desc(),
                ranked.c.busy + ranked.c.turn,
                ranked.c.not_before,
                ranked.c.id,
            )
            .limit(limit)
        )

    async def _claim_rows_txn(
        self,
        conn: AsyncConnection,
        lane: str,
        owner: str,
        run_ids: list[str],
        lease_ttl_s: float,
    ) -> list[RowMapping]:
        """Move the still-eligible runs among ``run_ids`` to ``running``; their new rows."""
        if not run_ids:
            return []
        d = self._dialect

        def eligible(ids: Iterable[str]) -> ColumnElement[bool]:
            # Repeated on every statement that touches the rows: a predicate checked only in
            # an earlier query is not re-checked after a lock wait.
            return and_(
                runs.c.id.in_(list(ids)),
                runs.c.status == _QUEUED,
                runs.c.lane == lane,
                runs.c.not_before <= db_now(d),
            )

        if dialects.uses_row_locks(d):
            lockable = dialects.lock_rows_skip_locked(select(runs.c.id).where(eligible(run_ids)), d)
            run_ids = list((await conn.execute(lockable)).scalars())
            if not run_ids:
                return []
        now = db_now(d)
        claim = (
            update(runs)
            .where(eligible(run_ids))
            .values(
                status=_RUNNING,
                attempt=runs.c.attempt + 1,
                lease_owner=owner,
                lease_expires_at=db_now(d, plus_s=lease_ttl_s),
                started_at=func.coalesce(runs.c.started_at, now),
                updated_at=now,
            )
        )
        if dialects.supports_update_returning(d):
            return list((await conn.execute(claim.returning(*runs.c))).mappings())
        result = await conn.execute(claim)
        # We hold every row's lock, so each must have matched; anything else is a bug worth a
        # loud log, and the re-read below returns only what was really claimed.
        if result.rowcount != len(run_ids):
            logger.error("claimed %d of %d locked runs", result.rowcount, len(run_ids))
        mine = select(runs).where(
            runs.c.id.in_(run_ids), runs.c.status == _RUNNING, runs.c.lease_owner == owner
        )
        return list((await conn.execute(mine)).mappings())

    # --- leases -----------------------------------------------------------------------------

    async def renew_lease(self, fence: Fence, lease_ttl_s: float) -> bool:
        """Extend one lease (see :meth:`renew_leases`); False when it is lost."""
        return bool(await self.renew_leases([fence], lease_ttl_s))

    async def renew_leases(
        self, fences: Sequence[Fence], lease_ttl_s: float
    ) -> set[tuple[RunId, Attempt]]:
        """Extend leases to database time + ``lease_ttl_s``, all in one statement.

        Conditional on each fence only, not on the lease being unexpired: an expired lease that
        no reaper has taken yet is still this worker's to renew. Together with the reaper's
        "still expired" predicate that makes a heartbeat and a reap racing at the expiry
        instant resolve to exactly one winner, whichever statement runs first.

        One statement per heartbeat, whatever the number of runs a worker holds: renewing them
        one by one would let a busy database push the last renewal past its deadline.

        Returns:
            ``(run id, attempt)`` of the leases renewed; a fence missing from it lost its lease.
        """
        if not fences:
            return set()
        owners = {fence.owner for fence in fences}
        if len(owners) != 1:
            raise ValueError("renew_leases renews the leases of one owner at a time")
        [owner] = owners
        keys = sorted({(fence.run_id, fence.attempt) for fence in fences})
        held = and_(
            runs.c.lease_owner == owner,
            runs.c.status == _RUNNING,
            tuple_(runs.c.id, runs.c.attempt).in_(keys),
        )

        async def renew() -> set[tuple[RunId, Attempt]]:
            async with self._db.write_transaction() as conn:
                await conn.execute(
                    update(runs)
                    .where(held)
                    .values(
                        lease_expires_at=db_now(self._dialect, plus_s=lease_ttl_s),
                        updated_at=db_now(self._dialect),
                    )
                )
                # Read back in the same transaction: the rows matching now are exactly the
                # ones the UPDATE matched (it holds their locks; no fence can newly match).
                rows = await conn.execute(select(runs.c.id, runs.c.attempt).where(held))
                return {(RunId(row.id), Attempt(row.attempt)) for row in rows}

        return await self._db.with_retry(renew)

    async def release(self, fence: Fence) -> bool:
        """Give a running run back to the queue at once (graceful shutdown).

        The lease is cleared and ``not_before`` set to database time, so any worker may claim
        it immediately; the next claim increments ``attempt``, which fences this one out.

        Returns:
            False when the lease was already lost (reaped, cancelled, finished).
        """
        async with self._db.write_transaction() as conn:
            now = db_now(self._dialect)
            result = await conn.execute(
                update(runs)
                .where(fence.clause())
                .values(
                    status=_QUEUED,
                    lease_owner=None,
                    lease_expires_at=None,
                    not_before=now,
                    updated_at=now,
                )
            )
            if result.rowcount != 1:
                return False
            await append_events_txn(
                conn, self._dialect, [(fence.run_id, fence.attempt, EVENT_RELEASED, {})]
            )
        return True

    # --- reaper -----------------------------------------------------------------------------

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
          ``not_before`` = database time + ``backoff(attempt)``, event ``reclaimed``.

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
        stmt = select(runs.c.id).where(*_expired_by(db_now(self._dialect)))
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
        d = self._dialect
        async with self._db.write_transaction() as conn:
            now: datetime = (await conn.execute(select(db_now(d)))).scalar_one()
            expired = await self._lock_expired_txn(conn, now, limit, only)
            if not expired:
                return []
            moved = await self._move_expired_txn(conn, expired, now, backoff)
            reaped = [e for e in expired if e.run_id in moved]
            await append_events_txn(
                conn, d, [(e.run_id, e.attempt, e.event, e.data) for e in reaped], now=now
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
                runs.c.cancel_requested_at.is_not(None).label("cancel_requested"),
            )
            .where(*_expired_by(now))
            .order_by(runs.c.lease_expires_at, runs.c.id)
            .limit(limit)
        )
        if only is None:
            stmt = dialects.lock_rows_skip_locked(stmt, self._dialect)
        else:
            stmt = dialects.lock_rows(stmt.where(runs.c.id.in_(only)), self._dialect)
        rows = await conn.execute(stmt)
        return [
            _Expired.classify(
                run_id=RunId(row.id),
                lane=row.lane,
                attempt=Attempt(row.attempt),
                max_attempts=row.max_attempts,
                cancel_requested=bool(row.cancel_requested),
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
        d = self._dialect
        cleared: dict[str, Any] = {"lease_owner": None, "lease_expires_at": None, "updated_at": now}
        cancelled = [e for e in expired if e.status is RunStatus.CANCELLED]
        failed = [e for e in expired if e.status is RunStatus.FAILED]
        requeued = [e for e in expired if e.status is RunStatus.QUEUED]
        moves: list[tuple[list[_Expired], ColumnElement[bool], dict[str, Any]]] = []
        if cancelled:
            moves.append(
                (
                    cancelled,
                    runs.c.cancel_requested_at.is_not(None),
                    {**cleared, "status": RunStatus.CANCELLED.value, "finished_at": now},
                )
            )
        # The error names the attempt and its budget, so each pair read is its own group
        # (almost always one): the predicate pins max_attempts to the value in the message.
        budgets: dict[tuple[int, int], list[_Expired]] = {}
        for e in failed:
            budgets.setdefault((e.attempt, e.max_attempts), []).append(e)
        for (_, max_attempts), group in budgets.items():
            moves.append(
                (
                    group,
                    and_(
                        runs.c.cancel_requested_at.is_(None),
                        runs.c.max_attempts == max_attempts,
                        runs.c.attempt >= runs.c.max_attempts,
                    ),
                    {
                        **cleared,
                        "status": RunStatus.FAILED.value,
                        "finished_at": now,
                        "error": group[0].data,
                    },
                )
            )
        if requeued:
            delays = {
                e.attempt: backoff(e.attempt) if backoff is not None else 0.0 for e in requeued
            }
            not_before: ColumnElement[datetime] | datetime
            if set(delays.values()) == {0.0}:
                not_before = now
            else:
                # Database time plus the attempt's backoff, per attempt in one CASE.
                not_before = case(
                    {a: db_now(d, plus_s=s) for a, s in sorted(delays.items())},
                    value=runs.c.attempt,
                )
            moves.append(
                (
                    requeued,
                    and_(
                        runs.c.cancel_requested_at.is_(None),
                        runs.c.attempt < runs.c.max_attempts,
                    ),
                    {**cleared, "status": RunStatus.QUEUED.value, "not_before": not_before},
                )
            )
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
        if dialects.supports_update_returning(self._dialect):
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

    # --- leader lease -----------------------------------------------------------------------

    async def try_acquire_leader(self, name: str, holder: str, ttl_s: float) -> bool:
        """Hold (or keep holding) the leader lease ``name`` for ``ttl_s`` seconds of DB time.

        First a plain read: while another holder's lease is unexpired the answer is no, with
        no write transaction (a follower asks every tick; on SQLite a write would take the
        database's write lock each time). Otherwise three conditional statements, the first
        that changes a row wins: renew when ``holder`` holds it, take over when it expired,
        insert when absent. Concurrent callers are serialised by the row (or the primary key),
        so at most one holds it at a time.

        Returns:
            Whether ``holder`` holds the lease now.
        """
        lease = leader_leases.c
        d = self._dialect
        held_by_another = select(literal(1)).where(
            lease.name == name, lease.holder != holder, lease.expires_at > db_now(d)
        )

        async def acquire() -> bool:
            async with self._db.connect() as conn:
                if (await conn.execute(held_by_another)).first() is not None:
                    return False
            expires = db_now(d, plus_s=ttl_s)
            async with self._db.write_transaction() as conn:
                renewed = await conn.execute(
                    update(leader_leases)
                    .where(lease.name == name, lease.holder == holder)
                    .values(expires_at=expires)
                )
                if renewed.rowcount == 1:
                    return True
                taken = await conn.execute(
                    update(leader_leases)
                    .where(lease.name == name, lease.expires_at < db_now(d))
                    .values(holder=holder, term=lease.term + 1, expires_at=expires)
                )
                if taken.rowcount == 1:
                    return True
                inserted = await conn.execute(
                    dialects.insert_ignoring_duplicates(leader_leases, d).values(
                        name=name, holder=holder, term=1, expires_at=expires
                    )
                )
                return inserted.rowcount == 1

        return await self._db.with_retry(acquire)

    async def is_leader(self, name: str, holder: str) -> bool:
        """Whether ``holder`` holds the unexpired leader lease ``name`` by database time."""
        lease = leader_leases.c
        stmt = select(literal(1)).where(
            lease.name == name, lease.holder == holder, lease.expires_at > db_now(self._dialect)
        )

        async def read() -> bool:
            async with self._db.connect() as conn:
                return (await conn.execute(stmt)).first() is not None

        return await self._db.with_retry(read)

    async def resign_leader(self, name: str, holder: str) -> bool:
        """Give up the leader lease so another process takes over without waiting the TTL."""
        lease = leader_leases.c

        async def resign() -> bool:
            async with self._db.write_transaction() as conn:
                result = await conn.execute(
                    delete(leader_leases).where(lease.name == name, lease.holder == holder)
                )
            return result.rowcount == 1

        return await self._db.with_retry(resign)


def _expired_by(now: datetime | ColumnElement[datetime]) -> tuple[ColumnElement[bool], ...]:
    """A running run whose lease expired before ``now`` (the reaper's predicate on the row)."""
    return (runs.c.status == _RUNNING, runs.c.lease_expires_at < now)


def _take_within_caps(
    ranked: Sequence[_Candidate], free: Mapping[str, int], limit: int
) -> list[str]:
    """The first ``limit`` candidates, at most ``free[tenant]`` per tenant, in rank order."""
    taken: Counter[str] = Counter()
    chosen: list[str] = []
    for candidate in ranked:
        if len(chosen) == limit:
            break
        if taken[candidate.tenant_id] < free.get(candidate.tenant_id, 0):
            taken[candidate.tenant_id] += 1
            chosen.append(candidate.run_id)
    return chosen


def _cap_expression(caps: Mapping[str, int], default_cap: int) -> ColumnElement[int]:
    """The joined tenant's cap as SQL: ``CASE tenants.plan WHEN … THEN … ELSE default END``."""
    if not caps:
        return literal(default_cap)
    return case(dict(caps), value=tenants.c.plan, else_=literal(default_cap))


def _claim_from_row(row: RowMapping) -> Claim:
    run = run_from_row(row)
    owner = run.lease_owner
    if owner is None:  # pragma: no cover - the claim statement always sets it
        raise AssertionError(f"claimed run {run.run_id} has no lease owner")
    return Claim(fence=Fence(run_id=run.run_id, attempt=run.attempt, owner=owner), run=run)
