"""Parking: a run that waits gives back its lease, slot and cap unit, and is re-queued later.

A workflow that waits longer than ``park_after`` (for a decision, a timer, a message) parks:
:meth:`ParkingRepo.park` moves its run from ``running`` to ``waiting`` under the attempt's
fence, and the attempt ends without an outcome. The next attempt replays the run from its
checkpoints to the same wait, which then finds what it waited for.

Every writer that can end a wait locks the run's row *first*, as the park does (its fenced
UPDATE), so the two serialise on that row:

* the park, holding the row, reads whether what it waits for arrived (the decision recorded,
  a message stored, the timer due); if so it parks nothing and the workflow goes on in
  memory;
* a decision (:meth:`~moorline.db.repos.interrupts.InterruptsRepo.resolve`) or a message
  (:meth:`~moorline.db.repos.messages.MessagesRepo.post`), holding the row, re-queues a run
  that waits for it with :func:`resume_txn`, in the same transaction as its own write.

Whichever commits first, the other sees it, so nothing that ends a wait is missed. The timer
sweep (:meth:`ParkingRepo.resume_due`, leader-elected) re-queues waiting runs whose timer is
due, expiring their permission as a ``timeout``, and ends ``timed_out`` those past their
deadline. A re-queued run keeps its ``not_before`` (in the past), so it is claimed ahead of
the runs queued after it in its lane.
"""

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import RowMapping, Select, and_, bindparam, exists, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.backends import Backend, DialectName, backend_for
from moorline.db.manager import DatabaseManager
from moorline.db.repos.events import (
    EVENT_RESUMED,
    EVENT_TIMED_OUT,
    EVENT_WAITING,
    append_events_txn,
)
from moorline.db.repos.fences import hold_fence_txn
from moorline.db.repos.records import DecisionReason, Fence, InterruptStatus
from moorline.db.schema import interrupts, messages, runs
from moorline.errors import LeaseLost
from moorline.types import TERMINAL_STATUSES, Attempt, JSONObject, RunId, RunStatus

_IN_CHUNK = 500
"""Ids per ``IN`` list: well under every backend's bound-parameter limit."""

NO_TIMER = datetime(9999, 1, 1, tzinfo=UTC)
"""``wake_at`` of a wait without a time limit (a message wait without a timeout)."""

DEFAULT_SWEEP_LIMIT = 500
"""Due waiting runs one sweep transaction moves."""

_WAITING = RunStatus.WAITING.value
_PENDING = InterruptStatus.PENDING.value


class WaitKind(StrEnum):
    """What a waiting run waits for (``waiting_for.kind``; persisted, contract)."""

    PERMISSION = "permission"
    SLEEP = "sleep"
    MESSAGE = "message"
    CHILDREN = "children"
    CAPACITY = "capacity"
    """Provider capacity for a model call (the limiter's wait was longer than park_after)."""


class ResumeReason(StrEnum):
    """Why a waiting run was re-queued (the ``resumed`` event's ``reason``; contract)."""

    DECISION = "decision"
    MESSAGE = "message"
    TIMER = "timer"
    CHILDREN = "children"


@dataclass(frozen=True, slots=True, kw_only=True)
class Wait:
    """One wait of a workflow, as a parked run records it.

    Attributes:
        kind: What the run waits for.
        until: When the wait ends by itself (a permission's deadline, a sleep's end, a
            message wait's timeout); None for a message wait without a timeout.
        interrupt_id: The interrupt a permission wait waits for.
    """

    kind: WaitKind
    until: datetime | None
    interrupt_id: str | None = None
    children: tuple[str, ...] = ()
    """The child runs a ``children`` wait awaits (every one must end)."""
    model: str | None = None
    """The model a ``capacity`` wait waits for."""

    def describe(self) -> JSONObject:
        """``waiting_for`` as stored and shown: ``{"kind", "until", "interrupt_id"?, …}``."""
        described: JSONObject = {
            "kind": self.kind.value,
            "until": None if self.until is None else self.until.isoformat(),
        }
        if self.interrupt_id is not None:
            described["interrupt_id"] = self.interrupt_id
        if self.kind is WaitKind.CHILDREN:
            described["children"] = len(self.children)
        if self.model is not None:
            described["model"] = self.model
        return described


@dataclass(frozen=True, slots=True, kw_only=True)
class Resumed:
    """A waiting run the timer sweep moved, and where to."""

    run_id: RunId
    lane: str
    status: RunStatus


class ParkingRepo:
    """Parks runs under their attempt's fence; re-queues them when their timer is due."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db
        self._backend: Backend = db.backend

    async def park(
        self, fence: Fence, wait: Wait, *, deadline_at: datetime | None = None, emits: int = 0
    ) -> bool:
        """Move the fence's run to ``waiting`` for ``wait``, unless what it waits for is here.

        Args:
            fence: The attempt's fence; the attempt writes nothing after a park.
            wait: What the run waits for.
            deadline_at: The run's wall-clock limit, recorded if the run has none yet.
            emits: The workflow's ``ctx.emit`` calls outside steps so far (recorded: the
                replay skips them).

        Returns:
            True when the run is now ``waiting``; False when the decision, a message or the
            timer was already there (nothing was written: the workflow goes on).

        Raises:
            LeaseLost: The fence no longer holds; nothing was written.
            CancelRequested: The run's cancel is recorded; nothing was written.
        """
        tries = 0

        async def attempt() -> bool:
            nonlocal tries
            tries += 1
            async with self._db.write_transaction() as conn:
                try:
                    action = f"park ({wait.kind})"
                    await hold_fence_txn(
                        conn, self._backend.name, fence, action, refuse_cancelled=True
                    )
                except LeaseLost:
                    if tries > 1 and await self._parked_txn(conn, fence):
                        return True  # our first try committed unanswered
                    raise
                return await self._park_txn(conn, fence, wait, deadline_at, emits)

        return await self._db.with_retry(attempt)

    async def _park_txn(
        self,
        conn: AsyncConnection,
        fence: Fence,
        wait: Wait,
        deadline_at: datetime | None,
        emits: int,
    ) -> bool:
        now: datetime = (await conn.execute(self._backend.select_now())).scalar_one()
        if await self._arrived_txn(conn, fence.run_id, wait, now):
            return False
        held = (
            await conn.execute(select(runs.c.deadline_at).where(runs.c.id == fence.run_id))
        ).scalar_one()
        deadline = held if held is not None else deadline_at
        wake_at = min((t for t in (wait.until, deadline) if t is not None), default=None)
        if wake_at is None and wait.kind is not WaitKind.CHILDREN:
            # No timer: a time no sweep reaches. NULL is left to children waits alone, so the
            # backstop that wakes parents reads their range of ``ix_runs_wake`` and no other.
            wake_at = NO_TIMER
        values: dict[str, Any] = {
            "status": _WAITING,
            "waiting_for": wait.describe(),
            "wake_at": wake_at,
            "deadline_at": deadline,
            "emits": emits,
            "lease_owner": None,
            "lease_expires_at": None,
            "updated_at": now,
        }
        result = await conn.execute(update(runs).where(fence.clause()).values(**values))
        # The fence's row is locked by hold_fence_txn: it cannot have moved since.
        if result.rowcount != 1:  # pragma: no cover - would be a locking bug
            raise AssertionError(f"park of locked run {fence.run_id} changed {result.rowcount}")
        waiting = (fence.run_id, fence.attempt, EVENT_WAITING, wait.describe())
        await append_events_txn(conn, self._backend.name, [waiting], now=now)
        return True

    async def _arrived_txn(
        self, conn: AsyncConnection, run_id: RunId, wait: Wait, now: datetime
    ) -> bool:
        """Whether what ``wait`` waits for is already here, read under the run's row lock."""
        if wait.until is not None and wait.until <= now:
            return True
        if wait.kind is WaitKind.PERMISSION:
            status = (
                await conn.execute(
                    select(interrupts.c.status).where(interrupts.c.id == wait.interrupt_id)
                )
            ).scalar_one_or_none()
            return status != _PENDING
        if wait.kind is WaitKind.CHILDREN:
            return not await mark_awaited_txn(conn, self._backend, run_id, wait.children)
        if wait.kind is WaitKind.MESSAGE:
            waiting = exists().where(
                messages.c.run_id == run_id, messages.c.delivered_attempt.is_(None)
            )
            return bool((await conn.execute(select(waiting))).scalar())
        return False

    async def _parked_txn(self, conn: AsyncConnection, fence: Fence) -> bool:
        parked = select(runs.c.id).where(
            runs.c.id == fence.run_id, runs.c.attempt == fence.attempt, runs.c.status == _WAITING
        )
        return (await conn.execute(parked)).first() is not None

    async def resume_due(self, *, limit: int = DEFAULT_SWEEP_LIMIT) -> list[Resumed]:
        """Re-queue waiting runs whose timer is due; end those past their deadline.

        A due permission wait has its interrupt denied with reason ``timeout`` in the same
        transaction, so its replay returns that decision. Rows another sweep holds are
        skipped, and every UPDATE re-checks ``waiting``, so two sweeps that both believe they
        lead move each run once.

        Returns:
            The runs this call moved: ``queued`` (timer due) or ``timed_out`` (deadline).
        """

        async def sweep() -> list[Resumed]:
            async with self._db.write_transaction() as conn:
                now: datetime = (await conn.execute(self._backend.select_now())).scalar_one()
                due = self._backend.lock_rows_skip_locked(
                    select(runs)
                    .where(runs.c.status == _WAITING, runs.c.wake_at <= now)
                    .order_by(runs.c.wake_at)
                    .limit(limit)
                )
                rows = (await conn.execute(due)).mappings().all()
                moved: list[Resumed] = []
                for row in rows:
                    deadline = row["deadline_at"]
                    if deadline is not None and deadline <= now:
                        status = await self._time_out_txn(conn, row, now)
                    else:
                        status = await resume_txn(
                            conn, self._backend, row, ResumeReason.TIMER, now=now
                        )
                    if status is not None:
                        moved.append(Resumed(run_id=row["id"], lane=row["lane"], status=status))
                return moved

        return await self._db.with_retry(sweep)

    async def _time_out_txn(
        self, conn: AsyncConnection, row: RowMapping, now: datetime
    ) -> RunStatus | None:
        await deny_pending_txn(conn, row["id"], DecisionReason.TIMEOUT, now)
        error: JSONObject = {
            "type": "DeadlineExceeded",
            "message": f"the run's deadline {row['deadline_at'].isoformat()} passed while it "
            "was waiting",
            "reason": "deadline",
        }
        started = row["started_at"]
        result = await conn.execute(
            update(runs)
            .where(runs.c.id == row["id"], runs.c.status == _WAITING)
            .values(
                status=RunStatus.TIMED_OUT.value,
                waiting_for=None,
                wake_at=None,
                error=error,
                finished_at=now,
                updated_at=now,
                elapsed_time=None if started is None else max(0.0, (now - started).total_seconds()),
            )
        )
        if result.rowcount != 1:
            return None
        data: JSONObject = {"reason": "deadline"}
        event = (RunId(row["id"]), Attempt(row["attempt"]), EVENT_TIMED_OUT, data)
        await append_events_txn(conn, self._backend.name, [event], now=now)
        return RunStatus.TIMED_OUT


async def lock_wait_state_txn(
    conn: AsyncConnection, backend: Backend, run_id: str, tenant_id: str | None = None
) -> RowMapping | None:
    """Lock the run's row (as a park locks it) and read what ending its wait needs.

    Every write that can end a wait (a decision, a message, a child's end) takes the row
    first, so it and a concurrent park serialise on it (see the module docstring). With
    ``tenant_id``, only a run of that tenant.
    """
    values = {"run_id": run_id} if tenant_id is None else {"run_id": run_id, "tenant": tenant_id}
    wanted = _wait_state_statement(backend.name, tenant_id is not None)
    found: RowMapping | None = (await conn.execute(wanted, values)).mappings().first()
    return found


@functools.cache
def _wait_state_statement(dialect: DialectName, of_tenant: bool) -> Select[Any]:
    wanted = select(
        runs.c.id, runs.c.status, runs.c.attempt, runs.c.waiting_for, runs.c.lane
    ).where(runs.c.id == bindparam("run_id"))
    if of_tenant:
        wanted = wanted.where(runs.c.tenant_id == bindparam("tenant"))
    return backend_for(dialect).lock_rows(wanted)


async def resume_txn(
    conn: AsyncConnection,
    backend: Backend,
    row: RowMapping | dict[str, Any],
    reason: ResumeReason,
    *,
    now: datetime | None = None,
) -> RunStatus | None:
    """Re-queue the waiting run ``row`` (the caller holds its row lock), expiring a due wait.

    Args:
        conn: The caller's write transaction, which locked the run's row.
        backend: The database's backend.
        row: The run's row as read under the lock (``id``, ``attempt``, ``status``,
            ``waiting_for``).
        reason: What ended the wait.
        now: Database time read in this transaction, if the caller has it.

    Returns:
        ``queued`` when the run was waiting and is now queued; None when it was not waiting.
    """
    if row["status"] != _WAITING:
        return None
    if now is None:
        now = (await conn.execute(backend.select_now())).scalar_one()
    waited: Any = row["waiting_for"] or {}
    if reason is ResumeReason.TIMER and waited.get("kind") == WaitKind.PERMISSION.value:
        # The deadline passed: the decision is ``timeout``, recorded before the replay reads it.
        await deny_pending_txn(conn, row["id"], DecisionReason.TIMEOUT, now)
    result = await conn.execute(
        update(runs)
        .where(runs.c.id == row["id"], runs.c.status == _WAITING)
        .values(
            status=RunStatus.QUEUED.value,
            waiting_for=None,
            wake_at=None,
            resumes=runs.c.resumes + 1,
            updated_at=now,
        )
    )
    if result.rowcount != 1:  # pragma: no cover - the caller holds the row lock
        return None
    data: JSONObject = {"reason": reason.value, "waited_for": waited.get("kind")}
    event = (RunId(row["id"]), Attempt(row["attempt"]), EVENT_RESUMED, data)
    await append_events_txn(conn, backend.name, [event], now=now)
    return RunStatus.QUEUED


async def deny_pending_txn(
    conn: AsyncConnection, run_id: str, reason: DecisionReason, now: datetime
) -> int:
    """Deny every pending interrupt of ``run_id`` for ``reason``; how many were pending."""
    result = await conn.execute(
        update(interrupts)
        .where(interrupts.c.run_id == run_id, interrupts.c.status == _PENDING)
        .values(status=InterruptStatus.DENIED.value, reason=reason.value, resolved_at=now)
    )
    return int(result.rowcount)


async def mark_awaited_txn(
    conn: AsyncConnection, backend: Backend, parent_id: str, child_ids: Sequence[str]
) -> bool:
    """Mark the parent's children ``child_ids`` awaited; whether any of them has not ended.

    The UPDATE locks the children's rows, so a child finishing meanwhile either committed
    before (and the read after it sees it ended) or finds the mark and wakes the parent
    (:meth:`~moorline.db.repos.children.ChildrenRepo.wake_parents`). Where there are row
    locks they are taken first, in id order: the slot handoff that ends several of the
    children locks them in that order, and an UPDATE alone locks in its plan's.
    """
    ordered = sorted(child_ids)
    for offset in range(0, len(ordered), _IN_CHUNK):
        chunk = ordered[offset : offset + _IN_CHUNK]
        theirs = and_(runs.c.parent_run_id == parent_id, runs.c.id.in_(chunk))
        if backend.capabilities.row_locks:
            await conn.execute(
                backend.lock_rows(select(runs.c.id).where(theirs).order_by(runs.c.id))
            )
        await conn.execute(update(runs).where(theirs).values(awaited=1))
    return await has_unfinished_awaited_txn(conn, parent_id)


async def has_unfinished_awaited_txn(conn: AsyncConnection, parent_id: str) -> bool:
    """Whether a child the parent awaits has not ended yet."""
    unfinished = exists().where(
        runs.c.parent_run_id == parent_id,
        runs.c.awaited == 1,
        runs.c.status.not_in([status.value for status in TERMINAL_STATUSES]),
    )
    return bool((await conn.execute(select(unfinished))).scalar())
