"""Run transitions outside an attempt: out of ``pending``, and a tenant's cancel.

Each is one conditional statement whose rowcount (or returned ids) is checked, in a
transaction of its own:

* **enqueue** — ``pending → queued`` (:meth:`RunTransitions.enqueue`) or ``pending →
  rate_limited`` (:meth:`RunTransitions.mark_rate_limited`), each conditional on the run still
  being ``pending``, so two API processes deciding about one run move it once.
* **cancel** — :meth:`RunTransitions.request_cancel` records a tenant's cancel under the run's
  row lock: a run nobody executes (``pending``, ``queued``, ``waiting``) ends ``cancelled``
  in that same transaction; a ``running`` one keeps its lease with ``cancel_requested_at``
  set, which its worker learns from the RuntimeStore's signal or, should that be lost, from its next
  heartbeat. From then on no step starts (``StepsRepo.start`` refuses), no claim takes the
  run, and the reaper and a shutdown release end it ``cancelled`` instead of requeueing it.
"""

from collections.abc import Iterable, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.backends import Backend
from moorline.db.repos.events import EVENT_CANCELLED, EVENT_QUEUED, append_events_txn
from moorline.db.repos.parking import deny_pending_txn
from moorline.db.repos.records import DecisionReason, Run, run_from_row
from moorline.db.repos.run_reads import IN_CHUNK, RunRepoBase, db_now_txn
from moorline.db.schema import runs
from moorline.errors import RunFinished, RunNotFound
from moorline.types import Attempt, JSONObject, RunId, RunStatus, TenantId

_PENDING = RunStatus.PENDING.value

_EventItem = tuple[RunId, Attempt, str, JSONObject]


class RunTransitions(RunRepoBase):
    """Moves runs out of ``pending``, and records cancels."""

    async def enqueue(self, run_ids: Sequence[RunId]) -> list[RunId]:
        """Move ``pending`` runs to ``queued``, with one ``queued`` event each, in one transaction.

        Conditional on each run still being ``pending``: a run already queued, refused or
        unknown is left alone, so a repeated or concurrent enqueue moves each run once. The
        run keeps the ``not_before`` fixed at insert.

        Returns:
            The ids this call moved, in the order given.
        """
        wanted = list(dict.fromkeys(run_ids))
        if not wanted:
            return []

        async def write() -> set[str]:
            async with self._db.write_transaction() as conn:
                now = await db_now_txn(conn, self._backend)
                moved = await self._move_pending_txn(
                    conn, sorted(wanted), {"status": RunStatus.QUEUED.value, "updated_at": now}
                )
                queued: list[_EventItem] = [
                    (RunId(run_id), Attempt(0), EVENT_QUEUED, {}) for run_id in moved
                ]
                await append_events_txn(conn, self._backend.name, queued, now=now)
            return set(moved)

        moved = await self._db.with_retry(write)
        return [run_id for run_id in wanted if run_id in moved]

    async def mark_rate_limited(self, run_id: RunId, error: JSONObject) -> bool:
        """Refuse a ``pending`` run: it ends ``rate_limited`` (terminal) with ``error``.

        Returns:
            False when the run is not ``pending`` (already decided, or unknown).
        """

        async def write() -> bool:
            async with self._db.write_transaction() as conn:
                now = await db_now_txn(conn, self._backend)
                values = {
                    "status": RunStatus.RATE_LIMITED.value,
                    "error": error,
                    "finished_at": now,
                    "updated_at": now,
                }
                moved = await self._move_pending_txn(conn, [run_id], values)
            return moved == [run_id]

        return await self._db.with_retry(write)

    async def _move_pending_txn(
        self, conn: AsyncConnection, run_ids: Sequence[str], values: dict[str, Any]
    ) -> list[str]:
        """Apply ``values`` to those of ``run_ids`` still ``pending``; the ids it changed."""
        moved: list[str] = []
        for offset in range(0, len(run_ids), IN_CHUNK):
            chunk = list(run_ids[offset : offset + IN_CHUNK])
            moved += await self._move_pending_chunk_txn(conn, chunk, values)
        return moved

    async def _move_pending_chunk_txn(
        self, conn: AsyncConnection, run_ids: list[str], values: dict[str, Any]
    ) -> list[str]:
        def still_pending(ids: Iterable[str]) -> ColumnElement[bool]:
            # On the UPDATE itself too: a predicate checked only by the earlier SELECT would
            # not be re-checked after a lock wait.
            return and_(runs.c.id.in_(list(ids)), runs.c.status == _PENDING)

        if self._backend.capabilities.update_returning:
            stmt = update(runs).where(still_pending(run_ids)).values(**values)
            return list((await conn.execute(stmt.returning(runs.c.id))).scalars())
        lock = self._backend.lock_rows(select(runs.c.id).where(still_pending(run_ids)))
        locked = list((await conn.execute(lock)).scalars())
        if not locked:
            return []
        result = await conn.execute(update(runs).where(still_pending(locked)).values(**values))
        # Every locked row is still pending (we hold its lock), so each must have matched.
        if result.rowcount != len(locked):  # pragma: no cover - would be a locking bug
            raise AssertionError(f"moved {result.rowcount} of {len(locked)} locked pending runs")
        return locked

    async def request_cancel(self, tenant_id: TenantId, run_id: RunId) -> Run:
        """Record the tenant's request to cancel ``run_id``, in one transaction.

        The run's row is locked first and the database time read only then, so
        ``cancel_requested_at`` is later than every step start that committed before it, and
        every later step start sees the request (see ``StepsRepo.start``):

        * ``pending``, ``queued`` or ``waiting`` → ``cancelled`` at once (a waiting run's
          pending interrupts denied with reason ``cancelled``) (``finished_at`` set, event
          ``cancelled`` ``{"reason": "cancelled"}``): nobody runs it, nobody will;
        * ``running`` → ``cancel_requested_at`` set, the run keeps its lease; its worker ends
          it ``cancelled`` when it sees the request (signal the RuntimeStore after this call:
          ``moorline.dispatch.cancel.cancel_run`` does both). A repeated request changes
          nothing.

        Returns:
            The run after the call: ``cancelled``, or ``running`` with ``cancel_requested_at``.

        Raises:
            RunNotFound: The tenant has no run ``run_id`` (another tenant's run included).
            RunFinished: The run already ended (any terminal status); nothing was changed.
        """
        tries = 0

        async def write() -> Run:
            nonlocal tries
            tries += 1
            async with self._db.write_transaction() as conn:
                mine = select(runs).where(runs.c.id == run_id, runs.c.tenant_id == tenant_id)
                locked = self._backend.lock_rows(mine)
                row = (await conn.execute(locked)).mappings().first()
                if row is None:
                    raise RunNotFound(f"no run {run_id!r}")
                run = run_from_row(row)
                if run.status.is_terminal:
                    if tries > 1 and run.status is RunStatus.CANCELLED:
                        return run  # cancelled by our first try, whose commit went unanswered
                    raise RunFinished(f"run {run_id} already ended {run.status.value}")
                if run.cancel_requested_at is not None:
                    return run
                now = await db_now_txn(conn, self._backend)
                return await cancel_locked_txn(conn, self._backend, run, now)

        return await self._db.with_retry(write)


async def cancel_locked_txn(
    conn: AsyncConnection, backend: Backend, run: Run, now: datetime
) -> Run:
    """Cancel the locked, unfinished ``run`` at ``now``: at once unless it is running.

    The caller holds the run's row lock and checked that it has not ended and has no cancel
    request yet (:meth:`RunTransitions.request_cancel`, a bulk cancel's batch).
    """
    if run.status is RunStatus.RUNNING:
        values: dict[str, Any] = {"cancel_requested_at": now, "updated_at": now}
        changed = replace(run, cancel_requested_at=now, updated_at=now)
    else:
        elapsed_s = None if run.started_at is None else (now - run.started_at).total_seconds()
        values = {
            "lease_owner": None,
            "lease_expires_at": None,
            "status": RunStatus.CANCELLED.value,
            "cancel_requested_at": now,
            "finished_at": now,
            "updated_at": now,
            "elapsed_time": None if elapsed_s is None else max(0.0, elapsed_s),
            "waiting_for": None,
            "wake_at": None,
        }
        changed = replace(
            run,
            status=RunStatus.CANCELLED,
            waiting_for=None,
            wake_at=None,
            lease_owner=None,
            lease_expires_at=None,
            cancel_requested_at=now,
            finished_at=now,
            updated_at=now,
            elapsed_time=values["elapsed_time"],
        )
    result = await conn.execute(
        update(runs)
        .where(runs.c.id == run.run_id, runs.c.status == run.status.value)
        .values(**values)
    )
    # The row is locked (or, on SQLite, the whole database is): it cannot have moved.
    if result.rowcount != 1:  # pragma: no cover - would be a locking bug
        raise AssertionError(f"cancel of locked run {run.run_id} changed {result.rowcount}")
    if run.status is RunStatus.WAITING:
        # A waiting run's open question is closed too: nobody will act on its answer.
        await deny_pending_txn(conn, run.run_id, DecisionReason.CANCELLED, now)
    if changed.status is RunStatus.CANCELLED:
        cancelled: list[_EventItem] = [
            (run.run_id, run.attempt, EVENT_CANCELLED, {"reason": "cancelled"})
        ]
        await append_events_txn(conn, backend.name, cancelled, now=now)
    return changed
