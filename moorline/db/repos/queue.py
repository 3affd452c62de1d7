"""Dispatch-side SQL: claiming runs, renewing and releasing leases, reaping, the leader lease.

Every transition here is a conditional statement whose predicate sits on the row it changes, and
every rowcount is checked (RELIABILITY.md §0.6): a predicate hidden in a subquery is not
re-evaluated after a lock wait, and two claimers then take the same run.

**Claim** (one transaction per batch):

1. *Find the waiting tenants*: those with eligible runs (``queued``, ``not_before`` ≤ database
   time) in the lane, each with its live ``running`` count and its next run, by skipping
   through ``ix_runs_lane_tenant`` one tenant at a time, so the cost follows the number of
   tenants waiting, never the length of a backlog. *Allot* the batch between them: priority
   first, then round-robin, then FIFO. The round-robin key of a tenant's n-th run is
   ``running + n``: every tenant's next run comes before any tenant's second, and a tenant with
   fewer runs in flight goes first, also when workers claim one run at a time. A tenant at its
   concurrency cap gets nothing and one with ``k`` free slots at most ``k`` runs. One tenant's
   backlog thus delays another tenant of the same lane and priority by at most one run per
   slot. Priority still dominates: fairness applies between equal priorities.
2. On PostgreSQL and MariaDB, *lock the tenant rows* of the allotted tenants, in id order (no
   deadlock between claimers). One statement then reads, for each allotted tenant, its
   ``running`` count again and its next runs (one index range per tenant, ``UNION ALL``),
   locking those runs ``FOR UPDATE SKIP LOCKED`` with the eligibility predicate on the rows
   being locked. It starts once the tenant locks are granted, so under READ COMMITTED its count
   sees every claim the previous lock holder committed; every claimer of a tenant holds that
   lock from its count to its commit, so counts and claims of one tenant are serialised and
   the cap holds at every commit, under any number of claimers. The count is of live rows,
   not a counter, so a dead worker's runs stop counting the moment the reaper takes them back.
   The allotment covers twice the batch (no tenant more than the batch), leaving spare
   candidates for slots a concurrent claimer took while this one waited. On SQLite, ``BEGIN
   IMMEDIATE`` holds the database's single write lock for the whole claim, so the first count
   is already exact and the allotment fits every tenant's free slots and the batch: all the
   runs the per-tenant reads find are claimed, so those reads are the claim UPDATE's own
   subquery. Candidates are ordered by the same key as the allotment and taken up to each
   tenant's free slots.
3. The servers ``UPDATE`` exactly the locked ids (no predicate is needed on rows this
   transaction holds) with the database time the locking read returned, and build the claimed
   rows from the locked ones, so MariaDB needs no re-read; SQLite's UPDATE repeats the
   eligibility predicate on each row and returns the claimed rows (``RETURNING``). The claim
   sets ``running``, ``attempt + 1`` (the fencing token), the owner, ``lease_expires_at`` from
   database time, ``started_at`` the first time, and appends one ``started`` event per run in
   the same transaction, with one ``INSERT … SELECT`` that reads each run's next ``seq``
   itself.

Claims are not wrapped in ``with_retry``: a commit whose acknowledgement was lost would be
repeated as a second batch, orphaning the first until its leases expire.
"""

import functools
import heapq
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from sqlalchemy import (
    ColumnElement,
    CompoundSelect,
    Integer,
    RowMapping,
    Select,
    String,
    and_,
    bindparam,
    case,
    cast,
    delete,
    func,
    literal,
    select,
    tuple_,
    union_all,
    update,
)
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.dml import Update
from sqlalchemy.sql.elements import BindParameter

from moorline.db import dialects
from moorline.db.dialects import DialectName, db_now, select_db_now
from moorline.db.manager import DatabaseManager

# The event names moved to events.py; re-exported (``as``) so imports from here keep working.
from moorline.db.repos.events import EVENT_CANCELLED as EVENT_CANCELLED
from moorline.db.repos.events import EVENT_FAILED as EVENT_FAILED
from moorline.db.repos.events import EVENT_RECLAIMED as EVENT_RECLAIMED
from moorline.db.repos.events import EVENT_RELEASED as EVENT_RELEASED
from moorline.db.repos.events import EVENT_STARTED as EVENT_STARTED
from moorline.db.repos.events import append_events_txn, events_from_runs_statement
from moorline.db.repos.records import Fence, Run, run_from_row
from moorline.db.schema import leader_leases, runs, tenants
from moorline.types import Attempt, JSONObject, RunId, RunStatus, TenantId

logger = logging.getLogger(__name__)

MAX_ATTEMPTS_REASON = "max attempts"
"""``error.reason`` of a run the reaper failed because its attempts were used up."""

DEFAULT_REAP_LIMIT = 100

_UNION_CHUNK = 400
"""Tenants per claim read: SQLite allows at most 500 members in one compound SELECT."""

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
class ClaimBatch:
    """What one claim took, and whether a tenant's cap kept eligible runs back.

    Attributes:
        claims: The runs claimed, highest priority first.
        is_capped: Some tenant with eligible runs in the lane is at its concurrency cap after
            this claim (or may be: a tenant whose last eligible run was just taken counts
            too). A slot freed by one of its runs may make one claimable again.
        began_monotonic_s: ``time.monotonic()`` once the claim's transaction had begun, before
            its first read: every run committed before this instant was visible to it.
    """

    claims: list[Claim]
    is_capped: bool
    began_monotonic_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Renewal:
    """What one heartbeat statement did: the leases it renewed, the cancels it saw.

    Attributes:
        renewed: ``(run id, attempt)`` of the leases renewed; a fence missing from it lost
            its lease.
        cancel_requested: Those renewed runs whose cancel is recorded: their worker learns of
            it here at the latest, however the RuntimeStore's signal fared.
    """

    renewed: frozenset[tuple[RunId, Attempt]]
    cancel_requested: frozenset[RunId]


@dataclass(frozen=True, slots=True, kw_only=True)
class Reaped:
    """A run the reaper took back from an expired lease, and where it went."""

    run_id: RunId
    lane: str
    attempt: Attempt
    status: RunStatus


@dataclass(frozen=True, slots=True, kw_only=True)
class _Waiting:
    """A tenant with eligible queued runs in the lane being claimed from."""

    tenant_id: str
    plan: str
    busy: int
    """Its ``running`` runs, in every lane."""
    priority: int
    not_before: datetime
    """Priority and eligibility time of its next run in claim order."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Candidate:
    """One of a tenant's next runs: its ``turn``-th in that tenant's claim order."""

    run_id: str
    tenant_id: str
    priority: int
    not_before: datetime
    turn: int


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

        The same as :meth:`claim`, returning only the claimed runs.
        """
        batch = await self.claim(
            lane,
            owner,
            limit=limit,
            lease_ttl_s=lease_ttl_s,
            tenant_caps=tenant_caps,
            default_cap=default_cap,
        )
        return batch.claims

    async def claim(
        self,
        lane: str,
        owner: str,
        *,
        limit: int,
        lease_ttl_s: float,
        tenant_caps: Mapping[str, int],
        default_cap: int = 1,
    ) -> ClaimBatch:
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
            The claimed runs, highest priority first: fewer than ``limit`` (or none) when no
            more are eligible, when tenants are at their caps, or when another claimer took
            them first; and whether a cap kept eligible runs back.
        """
        if limit < 1:
            return ClaimBatch(claims=[], is_capped=False, began_monotonic_s=time.monotonic())
        row_locks = dialects.uses_row_locks(self._dialect)
        async with self._db.write_transaction() as conn:
            began = time.monotonic()
            waiting = await self._waiting_tenants_txn(conn, lane)
            # Under row locks the tenants' counts may change before their rows are locked
            # below; allotting twice the batch leaves spare candidates for slots a concurrent
            # claimer of the same tenant took while this one waited for the lock.
            allotted = _allot(waiting, tenant_caps, default_cap, limit * (2 if row_locks else 1))
            if not allotted:
                return ClaimBatch(claims=[], is_capped=bool(waiting), began_monotonic_s=began)
            plans = {tenant.tenant_id: tenant.plan for tenant in waiting}
            caps = {t: _cap_of(tenant_caps, default_cap, plans[t]) for t in allotted}
            busy = {tenant.tenant_id: tenant.busy for tenant in waiting}
            if row_locks:
                claims, fresh = await self._claim_locked_txn(
                    conn, lane, owner, allotted, caps, limit, lease_ttl_s
                )
                busy.update(fresh)
            else:
                claims = await self._claim_serialised_txn(
                    conn, lane, owner, allotted, caps, busy, limit, lease_ttl_s
                )
            if claims:
                ids = [claim.fence.run_id for claim in claims]
                params = {"ids": ids, "type": EVENT_STARTED, "data": {}}
                await self._db.commit_with_next_statement(conn)
                await conn.execute(events_from_runs_statement(), params)
        taken: Counter[str] = Counter(claim.run.tenant_id for claim in claims)
        is_capped = any(
            busy[t.tenant_id] + taken[t.tenant_id] >= _cap_of(tenant_caps, default_cap, t.plan)
            for t in waiting
        )
        return ClaimBatch(claims=claims, is_capped=is_capped, began_monotonic_s=began)

    async def _waiting_tenants_txn(self, conn: AsyncConnection, lane: str) -> list[_Waiting]:
        """The tenants with eligible queued runs in ``lane``, with their next run and load.

        The tenants are found by skipping through ``ix_runs_lane_tenant`` (a recursive query
        that seeks the next tenant id after each one), so the cost follows the number of
        tenants waiting in the lane, not the length of their backlogs; a tenant whose runs are
        all delayed (``not_before`` ahead) has no next run and is left out.
        """
        rows = await conn.execute(_waiting_statement(self._dialect), {"lane": lane})
        return [
            _Waiting(
                tenant_id=row.tenant_id,
                plan=row.plan,
                busy=row.busy,
                priority=row.priority,
                not_before=row.not_before,
            )
            for row in rows
            if row.priority is not None
        ]

    async def _claim_locked_txn(
        self,
        conn: AsyncConnection,
        lane: str,
        owner: str,
        allotted: Mapping[str, int],
        caps: Mapping[str, int],
        limit: int,
        lease_ttl_s: float,
    ) -> tuple[list[Claim], dict[str, int]]:
        """Servers: lock the tenants, then count, pick, lock and claim their next runs.

        The tenant rows are locked in id order, so two claimers never wait on each other in a
        cycle, and held to commit, so no other claimer of these tenants counts or claims in
        between. One statement then reads, for every allotted tenant, its ``running`` count
        and its next runs, locking those (``FOR UPDATE SKIP LOCKED``). It starts after the
        tenant locks were granted, so under READ COMMITTED its count sees every claim the
        previous lock holder committed. The chosen runs are moved by primary key; their new
        rows are the locked rows with the claim's changes, so no re-read is needed.
        """
        d = self._dialect
        await conn.execute(_lock_tenants_statement(d), {"ids": sorted(caps)})
        # A tenant never gets more than the whole batch, however much it was allotted.
        wanted = {tenant: min(count, limit) for tenant, count in allotted.items()}
        read = await self._next_runs_txn(conn, lane, wanted, locked=True)
        # The read's predicate holds on the rows as locked; checked again here all the same,
        # as the old separate lock statement did, since a claim of a row that changed under
        # it would be the double claim RELIABILITY.md §0.6 warns of.
        rows = [row for row in read if _is_claimable(row, lane)]
        # A tenant without candidates left is not claimed from, so its count is not needed.
        busy = {row["tenant_id"]: row["busy"] for row in rows}
        free = {tenant: caps[tenant] - count for tenant, count in busy.items()}
        chosen = _take_in_claim_order(_candidates(rows), busy, free, limit)
        if not chosen:
            return [], busy
        # Database time, read by the statement that locked the rows: the lease runs from a
        # moment before the UPDATE, so it never lasts longer than ``lease_ttl_s``.
        now: datetime = min(row["db_now"] for row in rows)
        expires = now + timedelta(seconds=lease_ttl_s)
        params = {"ids": chosen, "new_owner": owner, "claimed_at": now, "expires_at": expires}
        result = await conn.execute(_claim_locked_statement(), params)
        # Every chosen row is locked by this transaction and was eligible as locked.
        if result.rowcount != len(chosen):  # pragma: no cover - would be a locking bug
            raise AssertionError(f"claimed {result.rowcount} of {len(chosen)} locked runs")
        by_id = {row["id"]: row for row in rows}
        return [_claim_of(by_id[run_id], owner, now, expires) for run_id in chosen], busy

    async def _claim_serialised_txn(
        self,
        conn: AsyncConnection,
        lane: str,
        owner: str,
        allotted: Mapping[str, int],
        caps: Mapping[str, int],
        busy: Mapping[str, int],
        limit: int,
        lease_ttl_s: float,
    ) -> list[Claim]:
        """SQLite: read and claim the allotted runs in one ``UPDATE … RETURNING``.

        Under ``BEGIN IMMEDIATE`` the counts of the waiting read are exact, so the allotment
        never exceeds a tenant's free slots nor, in all, the batch: every run the per-tenant
        reads find is claimed. They are therefore the UPDATE's own subquery, and the UPDATE
        repeats the eligibility predicate on each row. The claimed rows are put in claim order
        afterwards.
        """
        free = {t: caps[t] - busy[t] for t in caps}
        wanted = sorted((t, min(count, free[t])) for t, count in allotted.items() if free[t] > 0)
        claimed: list[RowMapping] = []
        for offset in range(0, len(wanted), _UNION_CHUNK):
            chunk = wanted[offset : offset + _UNION_CHUNK]
            params: dict[str, Any] = {"in_lane": lane, "new_owner": owner}
            for index, (tenant_id, count) in enumerate(chunk):
                params[f"tenant_{index}"] = tenant_id
                params[f"count_{index}"] = count
            stmt = _claim_next_statement(self._dialect, len(chunk), lease_ttl_s)
            claimed += (await conn.execute(stmt, params)).mappings()
        order = _take_in_claim_order(_candidates(claimed), busy, free, limit)
        if len(order) != len(claimed):  # pragma: no cover - the allotment fits the batch
            raise AssertionError(f"claimed {len(claimed)} runs for a batch of {len(order)}")
        by_id = {row["id"]: row for row in claimed}
        return [_claim_from_row(by_id[run_id]) for run_id in order]

    async def _next_runs_txn(
        self, conn: AsyncConnection, lane: str, wanted: Mapping[str, int], *, locked: bool
    ) -> list[RowMapping]:
        """Each tenant's next ``wanted[tenant]`` eligible runs of ``lane``.

        One ``UNION ALL`` of per-tenant index range reads (``ix_runs_lane_tenant``), each
        stopping after its own limit, in chunks under SQLite's limit on compound selects.
        ``locked``: whole rows, each tenant's fresh ``busy`` count and the database time
        (``db_now``) beside them, locked ``FOR UPDATE SKIP LOCKED``; otherwise the columns the
        claim order needs.
        """
        members = sorted(wanted.items())
        rows: list[RowMapping] = []
        for offset in range(0, len(members), _UNION_CHUNK):
            chunk = members[offset : offset + _UNION_CHUNK]
            params: dict[str, Any] = {"in_lane": lane}
            for index, (tenant_id, count) in enumerate(chunk):
                params[f"tenant_{index}"] = tenant_id
                params[f"count_{index}"] = count
            stmt = _next_runs_statement(self._dialect, len(chunk), locked)
            rows += (await conn.execute(stmt, params)).mappings()
        return rows

    # --- leases -----------------------------------------------------------------------------

    async def renew_lease(self, fence: Fence, lease_ttl_s: float) -> bool:
        """Extend one lease (see :meth:`renew_leases`); False when it is lost."""
        return bool((await self.renew_leases([fence], lease_ttl_s)).renewed)

    async def renew_leases(self, fences: Sequence[Fence], lease_ttl_s: float) -> Renewal:
        """Extend leases to database time + ``lease_ttl_s``, all in one statement.

        Conditional on each fence only, not on the lease being unexpired: an expired lease that
        no reaper has taken yet is still this worker's to renew. Together with the reaper's
        "still expired" predicate that makes a heartbeat and a reap racing at the expiry
        instant resolve to exactly one winner, whichever statement runs first.

        One statement per heartbeat, whatever the number of runs a worker holds: renewing them
        one by one would let a busy database push the last renewal past its deadline.

        The read-back that reports the renewed leases also reports which of those runs have a
        recorded cancel: a cancel whose RuntimeStore signal was lost costs at most one
        heartbeat interval.

        Returns:
            The leases renewed (a fence missing from them lost its lease), and the renewed
            runs whose cancel is recorded.
        """
        if not fences:
            return Renewal(renewed=frozenset(), cancel_requested=frozenset())
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

        async def renew() -> Renewal:
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
                back = select(runs.c.id, runs.c.attempt, runs.c.cancel_requested_at).where(held)
                rows = (await conn.execute(back)).all()
            return Renewal(
                renewed=frozenset((RunId(row.id), Attempt(row.attempt)) for row in rows),
                cancel_requested=frozenset(
                    RunId(row.id) for row in rows if row.cancel_requested_at is not None
                ),
            )

        return await self._db.with_retry(renew)

    async def release(self, fence: Fence) -> bool:
        """Give a running run back to the queue at once (graceful shutdown).

        The lease is cleared and ``not_before`` set to database time, so any worker may claim
        it immediately; the next claim increments ``attempt``, which fences this one out. A
        run whose cancel is recorded is not requeued (no claim would take it): it ends
        ``cancelled`` instead, with its ``cancelled`` event.

        Returns:
            False when the lease was already lost (reaped, cancelled, finished).
        """
        async with self._db.write_transaction() as conn:
            now = db_now(self._dialect)
            cleared = {"lease_owner": None, "lease_expires_at": None, "updated_at": now}
            requeued = await conn.execute(
                update(runs)
                .where(fence.clause(), runs.c.cancel_requested_at.is_(None))
                .values(**cleared, status=_QUEUED, not_before=now)
            )
            event: tuple[str, JSONObject] = (EVENT_RELEASED, {})
            if requeued.rowcount != 1:
                cancelled = await conn.execute(
                    update(runs)
                    .where(fence.clause(), runs.c.cancel_requested_at.is_not(None))
                    .values(**cleared, status=RunStatus.CANCELLED.value, finished_at=now)
                )
                if cancelled.rowcount != 1:
                    return False
                event = (EVENT_CANCELLED, {"reason": "cancelled"})
            await append_events_txn(conn, self._dialect, [(fence.run_id, fence.attempt, *event)])
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
            now: datetime = (await conn.execute(select_db_now(d))).scalar_one()
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


# --- claim statements ----------------------------------------------------------------------
# Built once per dialect (and shape) with bound parameters, then reused: building a statement
# with table aliases costs more CPU than the database spends running it, and a reused statement
# object also keeps its cache key.


def _id_list() -> BindParameter[Any]:
    """The ``ids`` parameter: a list expanded into ``IN (…)`` at execution."""
    return bindparam("ids", expanding=True)


@functools.cache
def _waiting_statement(d: DialectName) -> Select[Any]:
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
        return (
            select(column)
            .where(ahead.c.status == _QUEUED, ahead.c.lane == lane)
            .where(ahead.c.tenant_id == waiting.c.tenant_id, ahead.c.not_before <= db_now(d))
            .order_by(ahead.c.priority.desc(), ahead.c.not_before, ahead.c.id)
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


@functools.cache
def _lock_tenants_statement(d: DialectName) -> Select[Any]:
    ids = _id_list()
    return dialects.lock_rows(
        select(tenants.c.id).where(tenants.c.id.in_(ids)).order_by(tenants.c.id), d
    )


@functools.cache
def _next_runs_statement(
    d: DialectName, tenants_count: int, locked: bool
) -> Select[Any] | CompoundSelect[Any]:
    """Each of ``tenants_count`` tenants' next ``count_<i>`` eligible runs of ``lane``.

    ``locked``: the whole rows, locked ``FOR UPDATE SKIP LOCKED`` (the lock sits in each
    member's own sub-select, where PostgreSQL and MariaDB allow it under a ``UNION``), with
    the tenant's ``running`` count (``busy``) and the database time (``db_now``) beside them.
    The eligibility predicate is on the rows being locked, so a row another transaction
    changed is checked again as locked (RELIABILITY.md §0.6).
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
            .where(runs.c.not_before <= db_now(d))
            # Never set on a queued run (a cancel ends one at once); kept so that no path
            # to ``queued`` can ever hand a cancelled run to a worker.
            .where(runs.c.cancel_requested_at.is_(None))
            .order_by(runs.c.priority.desc(), runs.c.not_before, runs.c.id)
            .limit(bindparam(f"count_{index}", type_=Integer()))
        )
        if not locked:
            return select(nxt.subquery())
        held = dialects.lock_rows_skip_locked(nxt, d).subquery()
        load = runs.alias()
        busy = (
            select(func.count())
            .select_from(load)
            .where(load.c.tenant_id == tenant, load.c.status == _RUNNING)
            .scalar_subquery()
        )
        return select(held, busy.label("busy"), db_now(d).label("db_now"))

    members = [next_of(index) for index in range(tenants_count)]
    return members[0] if len(members) == 1 else union_all(*members)


@functools.cache
def _claim_next_statement(d: DialectName, tenants_count: int, lease_ttl_s: float) -> Update:
    """SQLite's claim: the allotted tenants' next runs, read and claimed by one statement.

    The eligibility predicate is repeated on the rows being updated, checked under the write
    lock; every column of the claimed rows is returned.
    """
    chosen = _next_runs_statement(d, tenants_count, False).subquery()
    now = db_now(d)
    return (
        update(runs)
        .where(
            runs.c.id.in_(select(chosen.c.id)),
            runs.c.status == _QUEUED,
            runs.c.lane == bindparam("in_lane", type_=String()),
            runs.c.not_before <= now,
            runs.c.cancel_requested_at.is_(None),
        )
        .values(
            status=_RUNNING,
            attempt=runs.c.attempt + 1,
            lease_owner=bindparam("new_owner", type_=String()),
            lease_expires_at=db_now(d, plus_s=lease_ttl_s),
            started_at=func.coalesce(runs.c.started_at, now),
            updated_at=now,
        )
        .returning(*runs.c)
    )


@functools.cache
def _claim_locked_statement() -> Update:
    """The servers' claim of rows this transaction holds locked: by primary key alone.

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


def _cap_of(caps: Mapping[str, int], default_cap: int, plan: str) -> int:
    return caps.get(plan, default_cap)


def _allot(
    waiting: Sequence[_Waiting], caps: Mapping[str, int], default_cap: int, limit: int
) -> Counter[str]:
    """How many of the next ``limit`` claims each waiting tenant gets (tenant id → count).

    Priority first; between equal priorities round-robin over live load: a tenant's n-th run
    ranks as its ``busy + n``-th, so the tenant with fewer runs in flight goes first, and
    among equals the one whose next run is oldest. A tenant at its cap gets nothing.
    """
    heap: list[tuple[int, int, datetime, str, int]] = []
    for tenant in waiting:
        free = _cap_of(caps, default_cap, tenant.plan) - tenant.busy
        if free > 0:
            key = (-tenant.priority, tenant.busy + 1, tenant.not_before, tenant.tenant_id)
            heap.append((*key, free))
    heapq.heapify(heap)
    allotted: Counter[str] = Counter()
    for _ in range(limit):
        if not heap:
            break
        priority, rank, not_before, tenant_id, free = heapq.heappop(heap)
        allotted[tenant_id] += 1
        if free > 1:
            heapq.heappush(heap, (priority, rank + 1, not_before, tenant_id, free - 1))
    return allotted


def _take_in_claim_order(
    candidates: Sequence[_Candidate],
    busy: Mapping[str, int],
    free: Mapping[str, int],
    limit: int,
) -> list[str]:
    """The first ``limit`` candidates in claim order, at most ``free[tenant]`` per tenant.

    Claim order: priority first, then round-robin over live load (``busy + turn``), then
    oldest eligible first.
    """
    ordered = sorted(
        candidates,
        key=lambda c: (-c.priority, busy.get(c.tenant_id, 0) + c.turn, c.not_before, c.run_id),
    )
    taken: Counter[str] = Counter()
    chosen: list[str] = []
    for candidate in ordered:
        if len(chosen) == limit:
            break
        if taken[candidate.tenant_id] < free.get(candidate.tenant_id, 0):
            taken[candidate.tenant_id] += 1
            chosen.append(candidate.run_id)
    return chosen


def _claim_from_row(row: RowMapping) -> Claim:
    run = run_from_row(row)
    owner = run.lease_owner
    if owner is None:  # pragma: no cover - the claim statement always sets it
        raise AssertionError(f"claimed run {run.run_id} has no lease owner")
    return Claim(fence=Fence(run_id=run.run_id, attempt=run.attempt, owner=owner), run=run)


def _is_claimable(row: RowMapping, lane: str) -> bool:
    """Whether a run's locked row is still eligible: queued in ``lane``, due, not cancelled."""
    return (
        row["status"] == _QUEUED
        and row["lane"] == lane
        and row["not_before"] <= row["db_now"]
        and row["cancel_requested_at"] is None
    )


def _claim_of(row: RowMapping, owner: str, now: datetime, expires: datetime) -> Claim:
    """The claim of a run whose locked row ``row`` the claim UPDATE has just changed."""
    # Built once from the row with the claim's changes (not read, then ``replace``d): this
    # runs for every claimed run and was half of a drain's claim CPU.
    run_id = RunId(row["id"])
    attempt = Attempt(row["attempt"] + 1)
    started_at = row["started_at"]
    claimed = Run(
        run_id=run_id,
        tenant_id=TenantId(row["tenant_id"]),
        workflow=row["workflow"],
        status=RunStatus.RUNNING,
        lane=row["lane"],
        priority=row["priority"],
        attempt=attempt,
        max_attempts=row["max_attempts"],
        lease_owner=owner,
        lease_expires_at=expires,
        not_before=row["not_before"],
        idempotency_key=row["idempotency_key"],
        input_hash=row["input_hash"],
        conversation_id=row["conversation_id"],
        input=row["input"],
        output=row["output"],
        error=row["error"],
        timeout_s=row["timeout_s"],
        cancel_requested_at=row["cancel_requested_at"],
        created_at=row["created_at"],
        updated_at=now,
        started_at=started_at if started_at is not None else now,
        finished_at=row["finished_at"],
        elapsed_time=row["elapsed_time"],
        prompt_tokens=row["prompt_tokens"],
        completion_tokens=row["completion_tokens"],
    )
    return Claim(fence=Fence(run_id=run_id, attempt=attempt, owner=owner), run=claimed)


def _candidates(rows: Sequence[RowMapping]) -> list[_Candidate]:
    """The rows read for a claim, each numbered by its turn in its tenant's claim order."""
    # A UNION ALL keeps no order, not even its members' own: number each tenant's runs
    # after sorting them here.
    ordered = sorted(
        rows, key=lambda row: (row["tenant_id"], -row["priority"], row["not_before"], row["id"])
    )
    turn: Counter[str] = Counter()
    candidates: list[_Candidate] = []
    for row in ordered:
        turn[row["tenant_id"]] += 1
        candidates.append(
            _Candidate(
                run_id=row["id"],
                tenant_id=row["tenant_id"],
                priority=row["priority"],
                not_before=row["not_before"],
                turn=turn[row["tenant_id"]],
            )
        )
    return candidates
