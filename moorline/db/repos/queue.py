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
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
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
    run_id: RunId
    lane: str
    attempt: Attempt
    max_attempts: int
    cancel_requested: bool


class QueueRepo:
    """Claims, leases, reaping and leader leases over one :class:`DatabaseManager`."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db
        self._dialect: DialectName = db.dialect

    @asynccontextmanager
    async def _write(self) -> AsyncIterator[AsyncConnection]:
        level = dialects.write_isolation_level(self._dialect)
        if level is None:
            async with self._db.transaction() as conn:
                yield conn
            return
        async with self._db.connect() as conn:
            await conn.execution_options(isolation_level=level)
            async with conn.begin():
                yield conn

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
        async with self._write() as conn:
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
            async with self._write() as conn:
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
        async with self._write() as conn:
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

        Each run is moved by its own conditional statement and transaction: same id, same
        attempt, still ``running``, lease still expired (and the cancel flag and attempt budget
        as read), so concurrent reapers, a late heartbeat or a finishing worker each make it
        match zero rows. A reaper that dies mid-batch leaves the rest for the next pass.

        * cancel requested → ``cancelled`` (never resurrected), event ``cancelled``;
        * ``attempt >= max_attempts`` → ``failed`` with ``error.reason == "max attempts"``,
          event ``failed``;
        * otherwise → ``queued`` with ``attempt`` unchanged (the next claim increments it),
          ``not_before`` = database time + ``backoff(attempt)``, event ``reclaimed``.

        Args:
            limit: Most runs to examine in this call.
            backoff: Seconds before a reclaimed run may be claimed again; None for at once.

        Returns:
            The runs this call moved; runs another reaper got first are not included.
        """

        async def find() -> list[_Expired]:
            stmt = (
                select(
                    runs.c.id,
                    runs.c.lane,
                    runs.c.attempt,
                    runs.c.max_attempts,
                    runs.c.cancel_requested_at.is_not(None).label("cancel_requested"),
                )
                .where(runs.c.status == _RUNNING, runs.c.lease_expires_at < db_now(self._dialect))
                .order_by(runs.c.lease_expires_at)
                .limit(limit)
            )
            async with self._db.connect() as conn:
                rows = (await conn.execute(stmt)).all()
            return [
                _Expired(
                    run_id=RunId(row.id),
                    lane=row.lane,
                    attempt=Attempt(row.attempt),
                    max_attempts=row.max_attempts,
                    cancel_requested=bool(row.cancel_requested),
                )
                for row in rows
            ]

        reaped: list[Reaped] = []
        for expired in await self._db.with_retry(find):
            outcome = await self._db.with_retry(partial(self._reap_one, expired, backoff))
            if outcome is not None:
                reaped.append(outcome)
        return reaped

    async def _reap_one(
        self, expired: _Expired, backoff: Callable[[Attempt], float] | None
    ) -> Reaped | None:
        d = self._dialect
        now = db_now(d)
        cleared: dict[str, Any] = {"lease_owner": None, "lease_expires_at": None, "updated_at": now}
        data: JSONObject
        if expired.cancel_requested:
            status, event = RunStatus.CANCELLED, EVENT_CANCELLED
            values = {**cleared, "finished_at": now}
            data = {"reason": "cancelled"}
        elif expired.attempt >= expired.max_attempts:
            status, event = RunStatus.FAILED, EVENT_FAILED
            message = f"lease expired on attempt {expired.attempt} of {expired.max_attempts}"
            data = {"reason": MAX_ATTEMPTS_REASON, "message": message}
            values = {**cleared, "finished_at": now, "error": data}
        else:
            status, event = RunStatus.QUEUED, EVENT_RECLAIMED
            delay_s = backoff(expired.attempt) if backoff is not None else 0.0
            values = {**cleared, "not_before": db_now(d, plus_s=delay_s)}
            data = {"reason": "lease expired"}
        cancel_as_read = (
            runs.c.cancel_requested_at.is_not(None)
            if expired.cancel_requested
            else runs.c.cancel_requested_at.is_(None)
        )
        async with self._write() as conn:
            result = await conn.execute(
                update(runs)
                .where(
                    runs.c.id == expired.run_id,
                    runs.c.attempt == expired.attempt,
                    runs.c.max_attempts == expired.max_attempts,
                    runs.c.status == _RUNNING,
                    runs.c.lease_expires_at < now,
                    cancel_as_read,
                )
                .values(status=status.value, **values)
            )
            if result.rowcount != 1:
                return None
            await append_events_txn(conn, d, [(expired.run_id, expired.attempt, event, data)])
        logger.info(
            "reaped run with an expired lease to %s",
            status.value,
            extra={"run_id": expired.run_id, "attempt": expired.attempt},
        )
        return Reaped(
            run_id=expired.run_id, lane=expired.lane, attempt=expired.attempt, status=status
        )

    # --- leader lease -----------------------------------------------------------------------

    async def try_acquire_leader(self, name: str, holder: str, ttl_s: float) -> bool:
        """Hold (or keep holding) the leader lease ``name`` for ``ttl_s`` seconds of DB time.

        Three conditional statements, the first that changes a row wins: renew when ``holder``
        holds it, take over when it expired, insert when absent. Concurrent callers are
        serialised by the row (or the primary key), so at most one holds it at a time.

        Returns:
            Whether ``holder`` holds the lease now.
        """
        lease = leader_leases.c
        d = self._dialect

        async def acquire() -> bool:
            expires = db_now(d, plus_s=ttl_s)
            async with self._write() as conn:
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
            async with self._write() as conn:
                result = await conn.execute(
                    delete(leader_leases).where(lease.name == name, lease.holder == holder)
                )
            return result.rowcount == 1

        return await self._db.with_retry(resign)


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
