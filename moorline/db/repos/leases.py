"""Leases of claimed runs: renewed by their worker's heartbeat, released at shutdown.

Every statement is fenced by ``(run_id, attempt)`` and the owner; a lease the reaper took back,
a cancelled or finished run matches zero rows, and the caller learns it lost the lease.
"""

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Select, Update, and_, bindparam, select, tuple_, update
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.backends import DialectName, backend_for
from moorline.db.manager import DatabaseManager
from moorline.db.repos.events import EVENT_CANCELLED, EVENT_RELEASED, append_events_txn
from moorline.db.repos.records import Fence, is_running
from moorline.db.schema import runs
from moorline.types import Attempt, JSONObject, RunId, RunStatus


@dataclass(frozen=True, slots=True, kw_only=True)
class Renewal:
    """What one heartbeat statement did: the leases it renewed, the cancels it saw.

    Attributes:
        renewed: ``(run id, attempt)`` of the leases renewed; a fence missing from it lost
            its lease.
        cancel_requested: Those renewed runs whose cancel is recorded: their worker learns of
            it here at the latest, however the RuntimeStore's signal fared.
        parked: ``(run id, attempt)`` of fences not renewed because that very attempt parked
            its run (``waiting``): the lease went with the park, it was not taken over.
    """

    renewed: frozenset[tuple[RunId, Attempt]]
    cancel_requested: frozenset[RunId]
    parked: frozenset[tuple[RunId, Attempt]] = frozenset()


class LeasesRepo:
    """Lease renewal and release over one :class:`DatabaseManager`."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db

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
        held, renew_statement = _renew_statements(self._db.backend.name, lease_ttl_s)
        values = {"owner": owner, "keys": keys}

        async def renew() -> Renewal:
            async with self._db.write_transaction() as conn:
                # Lock first, in id order: a slot handoff locks the runs it ends in id order,
                # and an UPDATE alone would lock in its plan's order, so the two could each
                # hold a run the other waits for. The rows read are the ones the UPDATE then
                # matches (no fence can newly match, and we hold their locks).
                rows = (await conn.execute(held, values)).all()
                if rows:
                    await conn.execute(renew_statement, values)
                renewed = frozenset((RunId(row.id), Attempt(row.attempt)) for row in rows)
                missed = [key for key in keys if key not in renewed]
                parked = await self._parked_txn(conn, missed) if missed else frozenset()
            return Renewal(
                renewed=renewed,
                cancel_requested=frozenset(
                    RunId(row.id) for row in rows if row.cancel_requested_at is not None
                ),
                parked=parked,
            )

        return await self._db.with_retry(renew)

    @staticmethod
    async def _parked_txn(
        conn: AsyncConnection, missed: Sequence[tuple[str, int]]
    ) -> frozenset[tuple[RunId, Attempt]]:
        """Of the fences a heartbeat missed, those whose own attempt parked the run.

        A park ends the lease between two heartbeats while the attempt still winds down
        (``finally`` blocks, buffered events); only a park by attempt N leaves a run
        ``waiting`` at attempt N, as any later claim increments it.
        """
        found = select(runs.c.id, runs.c.attempt).where(
            tuple_(runs.c.id, runs.c.attempt).in_(missed),
            runs.c.status == RunStatus.WAITING.value,
        )
        rows = (await conn.execute(found)).all()
        return frozenset((RunId(row.id), Attempt(row.attempt)) for row in rows)

    async def release(self, fence: Fence) -> bool:
        """Give a running run back to the queue at once (graceful shutdown).

        The lease is cleared and ``not_before`` set to database time, so any worker may claim
        it immediately; the next claim increments ``attempt``, which fences this one out. A
        run whose cancel is recorded is not requeued (no claim would take it): it ends
        ``cancelled`` instead, with its ``cancelled`` event.

        Returns:
            False when the lease was already lost (reaped, cancelled, finished).
        """
        backend = self._db.backend
        async with self._db.write_transaction() as conn:
            now = backend.now()
            cleared = {"lease_owner": None, "lease_expires_at": None, "updated_at": now}
            requeued = await conn.execute(
                update(runs)
                .where(fence.clause(), runs.c.cancel_requested_at.is_(None))
                .values(**cleared, status=RunStatus.QUEUED.value, not_before=now)
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
            await append_events_txn(conn, backend.name, [(fence.run_id, fence.attempt, *event)])
        return True


@functools.cache
def _renew_statements(dialect: DialectName, lease_ttl_s: float) -> tuple[Select[Any], Update]:
    """A heartbeat's lock of the leases it holds, and its ``UPDATE`` of them, built once per TTL.

    The lock reads the rows in id order (locking them where the backend has row locks) after
    any wait, so a lease reaped meanwhile drops out of both. Parameters: ``owner`` and
    ``keys``, the ``(run id, attempt)`` of each lease.
    """
    held = and_(
        runs.c.lease_owner == bindparam("owner"),
        is_running(),
        tuple_(runs.c.id, runs.c.attempt).in_(bindparam("keys", expanding=True)),
    )
    backend = backend_for(dialect)
    renew = (
        update(runs)
        .where(held)
        .values(lease_expires_at=backend.now(plus_s=lease_ttl_s), updated_at=backend.now())
    )
    lock = select(runs.c.id, runs.c.attempt, runs.c.cancel_requested_at).where(held)
    return backend.lock_rows(lock.order_by(runs.c.id)), renew
