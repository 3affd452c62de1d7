"""Claiming runs: one transaction per batch, in the order :mod:`moorline.db.fairness` promises.

Every transition here is a conditional statement whose predicate sits on the row it changes, and
every rowcount is checked (docs/reliability.md §0.6): a predicate hidden in a subquery is not
re-evaluated after a lock wait, and two claimers then take the same run.

1. *Find the waiting tenants*: those with eligible runs (``queued``, ``not_before`` ≤ database
   time) in the lane, each with its live ``running`` count and its next run, by skipping
   through ``ix_runs_lane_tenant`` one tenant at a time, so the cost follows the number of
   tenants waiting, never the length of a backlog. *Allot* the batch between them
   (:func:`~moorline.db.fairness.allot`: priority first, then round-robin over live load,
   then FIFO, never past a tenant's cap).
2. Then one of two strategies, which the backend's ``Capabilities.row_locks`` picks:

   * **Row locks** (PostgreSQL, MariaDB): *lock the tenant rows* of the allotted tenants, in
     id order (no deadlock between claimers). One statement then reads, for each allotted
     tenant, its ``running`` count again and its next runs (one index range per tenant,
     ``UNION ALL``), locking those runs ``FOR UPDATE SKIP LOCKED`` with the eligibility
     predicate on the rows being locked. It starts once the tenant locks are granted, so under
     READ COMMITTED its count sees every claim the previous lock holder committed; every
     claimer of a tenant holds that lock from its count to its commit, so counts and claims of
     one tenant are serialised and the cap holds at every commit, under any number of
     claimers. The count is of live rows, not a counter, so a dead worker's runs stop counting
     the moment the reaper takes them back. The allotment covers twice the batch (no tenant
     more than the batch), leaving spare candidates for slots a concurrent claimer took while
     this one waited. The ``UPDATE`` then moves exactly the locked ids (no predicate is needed
     on rows this transaction holds) with the database time the locking read returned, and the
     claimed rows are built from the locked ones, so MariaDB needs no re-read.
   * **Serialised** (SQLite): ``BEGIN IMMEDIATE`` holds the database's single write lock for
     the whole claim, so the first count is already exact and the allotment fits every
     tenant's free slots and the batch: all the runs the per-tenant reads find are claimed, so
     those reads are the claim UPDATE's own subquery. The UPDATE repeats the eligibility
     predicate on each row and returns the claimed rows (``RETURNING``).

   Either way the candidates are put in claim order
   (:func:`~moorline.db.fairness.take_in_claim_order`) and taken up to each tenant's free
   slots.
3. The claim sets ``running``, ``attempt + 1`` (the fencing token), the owner,
   ``lease_expires_at`` from database time, ``started_at`` the first time, and appends one
   ``started`` event per run in the same transaction, with one ``INSERT … SELECT`` that reads
   each run's next ``seq`` itself: on PostgreSQL in the claim's own statement, fed by the
   ``UPDATE … RETURNING`` (``dml_in_cte``), elsewhere as the transaction's last statement.

A worker claims only the workflows it serves (``workflows``): every read above filters on
them, on the last column of ``ix_runs_lane_tenant``, so a run that no worker of the lane
serves (a rolling deploy, a worker started with another app) stays ``queued`` for one that
does, instead of failing as ``workflow_not_found`` in the wrong worker.

Claims are not wrapped in ``with_retry``: a commit whose acknowledgement was lost would be
repeated as a second batch, orphaning the first until its leases expire.
"""

import time
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.backends import Backend
from moorline.db.fairness import (
    QueuedRun,
    WaitingTenant,
    allot,
    take_in_claim_order,
    tenant_cap,
)
from moorline.db.manager import DatabaseManager
from moorline.db.repos.claim_statements import (
    claim_locked_statement,
    claim_next_statement,
    lock_tenants_statement,
    next_runs_statement,
    union_chunk,
    waiting_statement,
)
from moorline.db.repos.events import (
    EVENT_STARTED,
    events_from_runs_statement,
    transition_with_events,
)
from moorline.db.repos.records import Fence, Run, run_from_row
from moorline.types import Attempt, RunStatus

_QUEUED = RunStatus.QUEUED.value


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
class ClaimRequest:
    """What one claim asks for: the arguments of :meth:`ClaimsRepo.claim`, which says each."""

    lane: str
    owner: str
    limit: int
    lease_ttl_s: float
    tenant_caps: Mapping[str, int]
    default_cap: int = 1
    workflows: Collection[str] | None = None

    @property
    def asks_nothing(self) -> bool:
        """No run can be claimed for it: no slot to fill, or no workflow served."""
        return self.limit < 1 or (self.workflows is not None and not self.workflows)


class _ClaimStrategy(Protocol):
    """How the allotted runs are read and claimed, inside the claim's write transaction."""

    oversample: int
    """The allotment covers ``oversample`` times the batch."""

    async def claim_txn(
        self,
        conn: AsyncConnection,
        lane: str,
        owner: str,
        allotted: Mapping[str, int],
        caps: Mapping[str, int],
        busy: Mapping[str, int],
        limit: int,
        lease_ttl_s: float,
        workflows: Sequence[str] | None,
    ) -> tuple[list[Claim], Mapping[str, int]]:
        """The claims in claim order, and the tenants' ``running`` counts read afresh."""
        ...


class ClaimsRepo:
    """Claims of queued runs over one :class:`DatabaseManager`."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db
        backend = db.backend
        self._claim_strategy: _ClaimStrategy = (
            _LockedClaim(backend) if backend.capabilities.row_locks else _SerialisedClaim(backend)
        )

    async def claim_batch(
        self,
        lane: str,
        owner: str,
        *,
        limit: int,
        lease_ttl_s: float,
        tenant_caps: Mapping[str, int],
        default_cap: int = 1,
        workflows: Collection[str] | None = None,
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
            workflows=workflows,
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
        workflows: Collection[str] | None = None,
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
            workflows: The workflows ``owner`` can run: runs of others are left queued. None
                claims every workflow (tests, benchmarks).

        Returns:
            The claimed runs, highest priority first: fewer than ``limit`` (or none) when no
            more are eligible, when tenants are at their caps, or when another claimer took
            them first; and whether a cap kept eligible runs back.
        """
        return await self.claim_as(
            ClaimRequest(
                lane=lane,
                owner=owner,
                limit=limit,
                lease_ttl_s=lease_ttl_s,
                tenant_caps=tenant_caps,
                default_cap=default_cap,
                workflows=workflows,
            )
        )

    async def claim_as(self, request: ClaimRequest) -> ClaimBatch:
        """:meth:`claim`, its arguments in one value."""
        if request.asks_nothing:  # no transaction for it
            return ClaimBatch(claims=[], is_capped=False, began_monotonic_s=time.monotonic())
        async with self._db.write_transaction() as conn:
            return await self.claim_txn(conn, request)

    async def claim_txn(
        self, conn: AsyncConnection, request: ClaimRequest, *, in_index_order: bool = False
    ) -> ClaimBatch:
        """:meth:`claim_as` in the caller's write transaction, as its last statements.

        The caller may have written before in it (a worker's outcomes,
        :meth:`~moorline.db.repos.handoffs.HandoffsRepo.finish_and_claim`): the counts read
        here see those writes, so a run it just ended no longer counts against its tenant's
        cap. Nothing may be written after: the claim's last statement may carry the commit.
        ``in_index_order``: the transaction already reads in index order (a statement before
        carried ``Backend.index_order_condition``), so the claim does not set it again.
        """
        lane, owner, limit = request.lane, request.owner, request.limit
        tenant_caps, default_cap = request.tenant_caps, request.default_cap
        began = time.monotonic()
        if request.asks_nothing:
            return ClaimBatch(claims=[], is_capped=False, began_monotonic_s=began)
        served = None if request.workflows is None else sorted(set(request.workflows))
        strategy = self._claim_strategy
        if not in_index_order:
            await self._db.backend.read_in_index_order(conn)
        waiting = await self._waiting_tenants_txn(conn, lane, served)
        # Under row locks the tenants' counts may change before their rows are locked;
        # allotting more than the batch leaves spare candidates for slots a concurrent
        # claimer of the same tenant took while this one waited for the lock.
        allotted = allot(waiting, tenant_caps, default_cap, limit * strategy.oversample)
        if not allotted:
            return ClaimBatch(claims=[], is_capped=bool(waiting), began_monotonic_s=began)
        plans = {tenant.tenant_id: tenant.plan for tenant in waiting}
        caps = {t: tenant_cap(tenant_caps, default_cap, plans[t]) for t in allotted}
        busy = {tenant.tenant_id: tenant.busy for tenant in waiting}
        claims, fresh = await strategy.claim_txn(
            conn, lane, owner, allotted, caps, busy, limit, request.lease_ttl_s, served
        )
        busy.update(fresh)
        taken: Counter[str] = Counter(claim.run.tenant_id for claim in claims)
        # A tenant's first count (``t.busy``) sized its allotment, and so how many of its runs
        # were read; a run of it that ended before the recount leaves the fresh count lower.
        # Capped by either count: a cap that kept runs unread must not read as "lane empty",
        # or the worker waits for a wake-up that those runs already sent.
        is_capped = any(
            max(t.busy, busy[t.tenant_id]) + taken[t.tenant_id]
            >= tenant_cap(tenant_caps, default_cap, t.plan)
            for t in waiting
        )
        return ClaimBatch(claims=claims, is_capped=is_capped, began_monotonic_s=began)

    async def _waiting_tenants_txn(
        self, conn: AsyncConnection, lane: str, served: Sequence[str] | None
    ) -> list[WaitingTenant]:
        """The tenants with eligible queued runs in ``lane``, with their next run and load.

        A tenant whose runs are all delayed (``not_before`` ahead), or of workflows outside
        ``served``, has no next run and is left out.
        """
        stmt = waiting_statement(self._db.backend, served is not None)
        params: dict[str, Any] = {"lane": lane}
        if served is not None:
            params["workflows"] = served
        rows = await conn.execute(stmt, params)
        return [
            WaitingTenant(
                tenant_id=row.tenant_id,
                plan=row.plan,
                busy=row.busy,
                priority=row.priority,
                not_before=row.not_before,
            )
            for row in rows
            if row.priority is not None
        ]


class _LockedClaim:
    """Servers: lock the tenants, then count, pick, lock and claim their next runs.

    The tenant rows are locked in id order, so two claimers never wait on each other in a
    cycle, and held to commit, so no other claimer of these tenants counts or claims in
    between. One statement then reads, for every allotted tenant, its ``running`` count and
    its next runs, locking those (``FOR UPDATE SKIP LOCKED``). It starts after the tenant
    locks were granted, so under READ COMMITTED its count sees every claim the previous lock
    holder committed. The chosen runs are moved by primary key; their new rows are the locked
    rows with the claim's changes, so no re-read is needed.
    """

    oversample = 2

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    async def claim_txn(
        self,
        conn: AsyncConnection,
        lane: str,
        owner: str,
        allotted: Mapping[str, int],
        caps: Mapping[str, int],
        busy: Mapping[str, int],
        limit: int,
        lease_ttl_s: float,
        workflows: Sequence[str] | None,
    ) -> tuple[list[Claim], Mapping[str, int]]:
        await conn.execute(lock_tenants_statement(self._backend), {"ids": sorted(caps)})
        # A tenant never gets more than the whole batch, however much it was allotted.
        wanted = {tenant: min(count, limit) for tenant, count in allotted.items()}
        read = await self._next_runs_txn(conn, lane, wanted, workflows)
        # The read's predicate holds on the rows as locked; checked again here all the same,
        # since a claim of a row that changed under it would be a double claim.
        served = None if workflows is None else frozenset(workflows)
        rows = [row for row in read if _is_claimable(row, lane, served)]
        # A tenant without candidates left is not claimed from, so its count is not needed.
        fresh = {row["tenant_id"]: row["busy"] for row in rows}
        free = {tenant: caps[tenant] - count for tenant, count in fresh.items()}
        chosen = take_in_claim_order(_queued_runs(rows), fresh, free, limit)
        if not chosen:
            return [], fresh
        # Database time, read by the statement that locked the rows: the lease runs from a
        # moment before the UPDATE, so it never lasts longer than ``lease_ttl_s``.
        now: datetime = min(row["db_now"] for row in rows)
        expires = now + timedelta(seconds=lease_ttl_s)
        params = {"ids": chosen, "new_owner": owner, "claimed_at": now, "expires_at": expires}
        merged = self._backend.capabilities.dml_in_cte
        if merged:
            # The claim and its started events in one statement; its rowcount is the events'.
            stmt = transition_with_events(claim_locked_statement())
            result = await conn.execute(stmt, {**params, **_STARTED})
        else:
            result = await conn.execute(claim_locked_statement(), params)
        # Every chosen row is locked by this transaction and was eligible as locked.
        if result.rowcount != len(chosen):  # pragma: no cover - would be a locking bug
            raise AssertionError(f"claimed {result.rowcount} of {len(chosen)} locked runs")
        if not merged:
            await _append_started_txn(conn, self._backend, chosen)
        by_id = {row["id"]: row for row in rows}
        return [_claim_of(by_id[run_id], owner, now, expires) for run_id in chosen], fresh

    async def _next_runs_txn(
        self,
        conn: AsyncConnection,
        lane: str,
        wanted: Mapping[str, int],
        workflows: Sequence[str] | None,
    ) -> list[RowMapping]:
        """Each tenant's next ``wanted[tenant]`` eligible runs of ``lane``, locked.

        One ``UNION ALL`` of per-tenant index range reads (``ix_runs_lane_tenant``), each
        stopping after its own limit, in chunks; whole rows, each tenant's fresh ``busy`` count
        and the database time (``db_now``) beside them.
        """
        members = sorted(wanted.items())
        rows: list[RowMapping] = []
        step = union_chunk(0 if workflows is None else len(workflows))
        for offset in range(0, len(members), step):
            chunk = members[offset : offset + step]
            params = _chunk_params(lane, chunk, workflows)
            stmt = next_runs_statement(self._backend, len(chunk), True, workflows is not None)
            rows += (await conn.execute(stmt, params)).mappings()
        return rows


class _SerialisedClaim:
    """SQLite: read and claim the allotted runs in one ``UPDATE … RETURNING``.

    Under ``BEGIN IMMEDIATE`` the counts of the waiting read are exact, so the allotment never
    exceeds a tenant's free slots nor, in all, the batch: every run the per-tenant reads find
    is claimed. They are therefore the UPDATE's own subquery, and the UPDATE repeats the
    eligibility predicate on each row. The claimed rows are put in claim order afterwards.
    """

    oversample = 1

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    async def claim_txn(
        self,
        conn: AsyncConnection,
        lane: str,
        owner: str,
        allotted: Mapping[str, int],
        caps: Mapping[str, int],
        busy: Mapping[str, int],
        limit: int,
        lease_ttl_s: float,
        workflows: Sequence[str] | None,
    ) -> tuple[list[Claim], Mapping[str, int]]:
        free = {t: caps[t] - busy[t] for t in caps}
        wanted = sorted((t, min(count, free[t])) for t, count in allotted.items() if free[t] > 0)
        claimed: list[RowMapping] = []
        step = union_chunk(0 if workflows is None else len(workflows))
        for offset in range(0, len(wanted), step):
            chunk = wanted[offset : offset + step]
            params = _chunk_params(lane, chunk, workflows)
            params["new_owner"] = owner
            stmt = claim_next_statement(
                self._backend, len(chunk), lease_ttl_s, workflows is not None
            )
            claimed += (await conn.execute(stmt, params)).mappings()
        order = take_in_claim_order(_queued_runs(claimed), busy, free, limit)
        if len(order) != len(claimed):  # pragma: no cover - the allotment fits the batch
            raise AssertionError(f"claimed {len(claimed)} runs for a batch of {len(order)}")
        by_id = {row["id"]: row for row in claimed}
        if order:
            await _append_started_txn(conn, self._backend, order)
        # The counts read at the start are still exact: nothing else wrote meanwhile.
        return [_claim_from_row(by_id[run_id]) for run_id in order], {}


_STARTED: dict[str, Any] = {"type": EVENT_STARTED, "data": {}}
"""The parameters of the ``started`` events of a claim."""


async def _append_started_txn(conn: AsyncConnection, backend: Backend, ids: Sequence[str]) -> None:
    """The ``started`` event of each claimed run: the claim transaction's last statement."""
    await backend.commit_with_next_statement(conn)
    await conn.execute(events_from_runs_statement(), {"ids": list(ids), **_STARTED})


def _chunk_params(
    lane: str, chunk: Sequence[tuple[str, int]], workflows: Sequence[str] | None
) -> dict[str, Any]:
    """The parameters of one claim read over ``chunk``'s (tenant, count) members."""
    params: dict[str, Any] = {"in_lane": lane}
    if workflows is not None:
        params["workflows"] = workflows
    for index, (tenant_id, count) in enumerate(chunk):
        params[f"tenant_{index}"] = tenant_id
        params[f"count_{index}"] = count
    return params


def _queued_runs(rows: Sequence[RowMapping]) -> list[QueuedRun]:
    """The rows read for a claim, as the claim order sees them."""
    return [
        QueuedRun(
            run_id=row["id"],
            tenant_id=row["tenant_id"],
            priority=row["priority"],
            not_before=row["not_before"],
        )
        for row in rows
    ]


def _is_claimable(row: RowMapping, lane: str, served: frozenset[str] | None) -> bool:
    """Whether a locked run is still eligible: queued in ``lane``, due, not cancelled, served.

    ``served``: the workflows the claiming worker runs; None, any.
    """
    return (
        row["status"] == _QUEUED
        and row["lane"] == lane
        and row["not_before"] <= row["db_now"]
        and row["cancel_requested_at"] is None
        and (served is None or row["workflow"] in served)
    )


def _claim_from_row(row: RowMapping) -> Claim:
    run = run_from_row(row)
    owner = run.lease_owner
    if owner is None:  # pragma: no cover - the claim statement always sets it
        raise AssertionError(f"claimed run {run.run_id} has no lease owner")
    return Claim(fence=Fence(run_id=run.run_id, attempt=run.attempt, owner=owner), run=run)


def _claim_of(row: RowMapping, owner: str, now: datetime, expires: datetime) -> Claim:
    """The claim of a run whose locked row ``row`` the claim UPDATE has just changed."""
    # The row with the claim's changes, not read back: one more round trip per claim.
    attempt = Attempt(row["attempt"] + 1)
    started_at = row["started_at"]
    claimed = run_from_row(
        {
            **row,
            "status": RunStatus.RUNNING,
            "attempt": attempt,
            "lease_owner": owner,
            "lease_expires_at": expires,
            "updated_at": now,
            "started_at": started_at if started_at is not None else now,
        }
    )
    run_id = claimed.run_id
    return Claim(fence=Fence(run_id=run_id, attempt=attempt, owner=owner), run=claimed)
