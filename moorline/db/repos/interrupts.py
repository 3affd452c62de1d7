"""Interrupts: the durable side of ``ctx.request_permission``.

The database is the source of truth for every interrupt and its decision; a RuntimeStore only
delivers wake-ups, and a lost wake-up is recovered by reading the row again.

* :meth:`InterruptsRepo.open` is fenced like a step checkpoint and idempotent per
  ``(run id, key)``: a run replayed after a reclaim gets the interrupt it opened before, with
  the decision if one was recorded, so both attempts act on the same decision. The deadline is
  set once, from database time, when the interrupt is first opened.
* :meth:`InterruptsRepo.resolve` records the first decision with one statement conditional on
  ``pending``; a repeat of the same decision returns the row, a different one is refused
  (first writer wins, docs/reliability.md D2). Approvals and denials by a person must also arrive
  before the deadline by database time, so a late person cannot overturn the timeout a worker
  may already have acted on; the worker's own outcomes (``timeout``, ``cancelled``,
  ``shutdown``) are accepted whenever the interrupt is still pending. A worker whose own
  resolution is refused reads the winner with :meth:`InterruptsRepo.get` and acts on it.
* :meth:`InterruptsRepo.expire_due` resolves overdue interrupts as timeouts, one conditional
  statement each, so concurrent callers report each one exactly once.
"""

import builtins
import uuid
from functools import partial
from typing import Any

from sqlalchemy import RowMapping, Select, Update, bindparam, insert, null, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.backends import Backend
from moorline.db.manager import DatabaseManager
from moorline.db.repos.fences import hold_fence_txn
from moorline.db.repos.parking import ResumeReason, lock_wait_state_txn, resume_txn
from moorline.db.repos.records import DecisionReason, Fence, Interrupt, InterruptStatus
from moorline.db.schema import interrupts, runs
from moorline.errors import Conflict, MoorlineError, NotFound
from moorline.types import Attempt, JSONObject, JSONValue, RunId

DEFAULT_EXPIRE_LIMIT = 100

_PENDING = InterruptStatus.PENDING.value

# Decisions a person makes; they must arrive before the deadline.
_PERSON_REASONS = frozenset({DecisionReason.APPROVED, DecisionReason.DENIED})


class InterruptResolved(Conflict):
    """The interrupt already has a different decision (or expired); nothing was changed."""

    code = "interrupt_resolved"


class InterruptMismatch(MoorlineError):
    """A replay opened an interrupt key that was recorded for another action.

    The decision recorded for one action is never handed to a different one: the workflow's
    code changed between attempts, or it reused an interrupt key.
    """

    code = "interrupt_mismatch"


class InterruptsRepo:
    """Interrupts of runs: opened under a fence, resolved by people, timeouts or the worker."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db
        self._backend: Backend = db.backend
        # Built once: building an UPDATE … RETURNING costs as much as running it on SQLite.
        self._resolves = {
            (by_person, with_data): _resolve_statement(
                self._backend, by_person=by_person, with_data=with_data
            )
            for by_person in (False, True)
            for with_data in (False, True)
        }
        self._get = select(interrupts).where(
            interrupts.c.id == bindparam("interrupt_id", type_=interrupts.c.id.type)
        )

    async def open(
        self, fence: Fence, key: str, action: str, data: JSONValue, timeout_s: float
    ) -> Interrupt:
        """Open interrupt ``key`` of the fence's run, or return the one opened before.

        Args:
            fence: The attempt's fence.
            key: The interrupt's key, unique within the run (its position in the workflow).
            action: What permission is asked for, shown to the approver.
            data: Details for the approver.
            timeout_s: Seconds, from database time now, before the interrupt expires.

        Returns:
            The interrupt: new and pending, or as recorded before (pending, or resolved with
            its decision).

        Raises:
            LeaseLost: The fence no longer holds; nothing was written.
            CancelRequested: The run's cancel is recorded; nothing was written.
            InterruptMismatch: ``key`` was opened before for another action.
        """
        decided = await self._decided(fence, key, action)
        if decided is not None:
            return decided

        async def attempt() -> Interrupt:
            async with self._db.write_transaction() as conn:
                await hold_fence_txn(
                    conn, self._backend.name, fence, f"interrupt {key!r}", refuse_cancelled=True
                )
                found = await _select_txn(conn, _BY_KEY, run_id=fence.run_id, key=key)
                if found is not None:
                    return _check_replay(found, fence.run_id, key, action)
                now = self._backend.now()
                interrupt_id = str(uuid.uuid4())
                await conn.execute(
                    insert(interrupts).values(
                        id=interrupt_id,
                        run_id=fence.run_id,
                        key=key,
                        action=action,
                        data=data,
                        status=_PENDING,
                        attempt=fence.attempt,
                        created_at=now,
                        expires_at=self._backend.now(plus_s=timeout_s),
                    )
                )
                return await _reread_txn(conn, interrupt_id)

        return await self._db.with_retry(attempt)

    async def _decided(self, fence: Fence, key: str, action: str) -> Interrupt | None:
        """The decided interrupt ``key`` when the fence holds and no cancel is recorded.

        None otherwise, and :meth:`open`'s fenced transaction decides.

        A resumed run's replay opens the interrupt it parked on, already decided: one read
        instead of a write transaction. A decision never changes once recorded, and the fence
        and the cancel are read in the same statement, so the answer is the one the fenced
        path would have given at that instant.
        """
        held = (
            select(interrupts)
            .select_from(interrupts.join(runs, runs.c.id == interrupts.c.run_id))
            .where(
                interrupts.c.run_id == fence.run_id,
                interrupts.c.key == key,
                interrupts.c.status != _PENDING,
                fence.clause(),
                runs.c.cancel_requested_at.is_(None),
            )
        )
        async with self._db.connect() as conn:
            row = (await conn.execute(held)).mappings().first()
        return None if row is None else _check_replay(row, fence.run_id, key, action)

    async def resolve(
        self,
        run_id: RunId,
        interrupt_id: str,
        *,
        approved: bool,
        reason: str,
        data: JSONObject | None,
    ) -> Interrupt:
        """Record the decision of a pending interrupt of ``run_id``.

        Args:
            run_id: The run the interrupt must belong to (the caller checked the tenant).
            interrupt_id: The interrupt.
            approved: The decision.
            reason: A :class:`DecisionReason` value; ``approved`` exactly when approving.
            data: The approver's data, handed to the workflow with the decision.

        Returns:
            The resolved interrupt; also when the same decision was recorded before.

        Raises:
            NotFound: No such interrupt in this run.
            InterruptResolved: A different decision was recorded first, or a person's
                decision arrived after the deadline (the interrupt is then expired).
            ValueError: ``reason`` is unknown or contradicts ``approved``.
        """
        cause = DecisionReason(reason)
        if approved != (cause is DecisionReason.APPROVED):
            raise ValueError(f"reason {cause.value!r} contradicts approved={approved}")
        status = InterruptStatus.APPROVED if approved else InterruptStatus.DENIED

        async def attempt() -> Interrupt | InterruptResolved:
            async with self._db.write_transaction() as conn:
                # The run's row first, as a park takes it: a run parking for this interrupt
                # either sees the decision or is re-queued by it (moorline.db.repos.parking).
                run = await lock_wait_state_txn(conn, self._backend, run_id)
                outcome = await self._resolve_txn(conn, run_id, interrupt_id, status, cause, data)
                waited: Any = None if run is None else run["waiting_for"]
                if (
                    not isinstance(outcome, InterruptResolved)
                    and waited is not None
                    and waited.get("interrupt_id") == interrupt_id
                ):
                    assert run is not None
                    await resume_txn(conn, self._backend, run, ResumeReason.DECISION)
                return outcome

        outcome = await self._db.with_retry(attempt)
        # Raised only after the commit: a refusal may come with an expiry to keep.
        if isinstance(outcome, InterruptResolved):
            raise outcome
        return outcome

    async def _resolve_txn(
        self,
        conn: AsyncConnection,
        run_id: RunId,
        interrupt_id: str,
        status: InterruptStatus,
        cause: DecisionReason,
        data: JSONObject | None,
    ) -> Interrupt | InterruptResolved:
        """The resolved interrupt, or the refusal to raise once the transaction committed."""
        decide = self._resolves[cause in _PERSON_REASONS, data is not None]
        parameters: dict[str, Any] = {
            "interrupt_id": interrupt_id,
            "interrupt_run_id": run_id,
            "decided_status": status.value,
            "decided_reason": cause.value,
        }
        if data is not None:
            parameters["decided_data"] = data
        if self._backend.capabilities.update_returning:
            # One statement where the database can return what it wrote.
            row = (await conn.execute(decide, parameters)).mappings().first()
            if row is not None:
                return _interrupt_from_row(row)
        elif (await conn.execute(decide, parameters)).rowcount == 1:
            return await _reread_txn(conn, interrupt_id)
        found = await _select_txn(conn, _IN_RUN, interrupt_id=interrupt_id, run_id=run_id)
        if found is None:
            raise NotFound(f"no interrupt {interrupt_id} in run {run_id}")
        if found["status"] == _PENDING:
            # Pending but past its deadline: a person came too late. Expire it now, so the
            # refusal and the recorded outcome agree.
            await self._expire_txn(conn, interrupt_id)
            expired = await _reread_txn(conn, interrupt_id)
            return InterruptResolved(
                f"interrupt {interrupt_id} of run {run_id} expired at "
                f"{expired.expires_at.isoformat()}; it was denied (timeout)"
            )
        recorded = _interrupt_from_row(found)
        if (recorded.status, recorded.reason, recorded.decision) == (status, cause, data):
            return recorded
        return InterruptResolved(
            f"interrupt {interrupt_id} of run {run_id} was already resolved: "
            f"{recorded.status.value} ({_reason_text(recorded)}) at {_resolved_text(recorded)}"
        )

    async def expire_due(self, *, limit: int = DEFAULT_EXPIRE_LIMIT) -> builtins.list[Interrupt]:
        """Deny every pending interrupt past its deadline by database time, reason ``timeout``.

        Args:
            limit: Most interrupts to examine in this call.

        Returns:
            The interrupts this call expired; ones another caller got first are not included.
        """
        find = (
            select(interrupts.c.id)
            .where(interrupts.c.status == _PENDING, interrupts.c.expires_at <= self._backend.now())
            .order_by(interrupts.c.expires_at, interrupts.c.id)
            .limit(limit)
        )

        async def due() -> builtins.list[str]:
            async with self._db.connect() as conn:
                return list((await conn.execute(find)).scalars())

        async def expire(interrupt_id: str) -> Interrupt | None:
            async with self._db.write_transaction() as conn:
                if not await self._expire_txn(conn, interrupt_id):
                    return None
                return await _reread_txn(conn, interrupt_id)

        expired: builtins.list[Interrupt] = []
        for interrupt_id in await self._db.with_retry(due):
            outcome = await self._db.with_retry(partial(expire, interrupt_id))
            if outcome is not None:
                expired.append(outcome)
        return expired

    async def _expire_txn(self, conn: AsyncConnection, interrupt_id: str) -> bool:
        """Deny one overdue pending interrupt as a timeout; False when it is not (any more)."""
        now = self._backend.now()
        result = await conn.execute(
            update(interrupts)
            .where(
                interrupts.c.id == interrupt_id,
                interrupts.c.status == _PENDING,
                interrupts.c.expires_at <= now,
            )
            .values(
                status=InterruptStatus.DENIED.value,
                reason=DecisionReason.TIMEOUT.value,
                resolved_at=now,
            )
        )
        return result.rowcount == 1

    async def pending_for_run(self, run_id: RunId) -> builtins.list[Interrupt]:
        """The run's pending interrupts, oldest first."""
        return await self.for_run(run_id, pending_only=True)

    async def for_run(
        self, run_id: RunId, *, pending_only: bool = False
    ) -> builtins.list[Interrupt]:
        """The run's interrupts (decided ones too unless ``pending_only``), oldest first."""
        stmt = (
            select(interrupts)
            .where(interrupts.c.run_id == run_id)
            .order_by(interrupts.c.created_at, interrupts.c.id)
        )
        if pending_only:
            stmt = stmt.where(interrupts.c.status == _PENDING)

        async def read() -> builtins.list[Interrupt]:
            async with self._db.connect() as conn:
                rows = (await conn.execute(stmt)).mappings().all()
            return [_interrupt_from_row(row) for row in rows]

        return await self._db.with_retry(read)

    async def get(self, interrupt_id: str) -> Interrupt | None:
        """The interrupt with this id, or None."""

        async def read() -> Interrupt | None:
            async with self._db.connect() as conn:
                found = await conn.execute(self._get, {"interrupt_id": interrupt_id})
                row = found.mappings().first()
            return None if row is None else _interrupt_from_row(row)

        return await self._db.with_retry(read)


def _resolve_statement(backend: Backend, *, by_person: bool, with_data: bool) -> Update:
    """The UPDATE that records a decision of a pending interrupt (returning the row if it can).

    Parameters: ``interrupt_id``, ``interrupt_run_id``, ``decided_status``, ``decided_reason``
    and, ``with_data``, ``decided_data`` (else the decision is SQL NULL). A person's decision
    (``by_person``) must also arrive before the deadline.
    """
    now = backend.now()
    conditions = [
        interrupts.c.id == bindparam("interrupt_id", type_=interrupts.c.id.type),
        interrupts.c.run_id == bindparam("interrupt_run_id", type_=interrupts.c.run_id.type),
        interrupts.c.status == _PENDING,
    ]
    if by_person:
        conditions.append(interrupts.c.expires_at > now)
    decision = bindparam("decided_data", type_=interrupts.c.decision.type) if with_data else null()
    decide = (
        update(interrupts)
        .where(*conditions)
        .values(
            status=bindparam("decided_status", type_=interrupts.c.status.type),
            reason=bindparam("decided_reason", type_=interrupts.c.reason.type),
            decision=decision,
            resolved_at=now,
        )
    )
    return decide.returning(*interrupts.c) if backend.capabilities.update_returning else decide


def _check_replay(row: RowMapping, run_id: RunId, key: str, action: str) -> Interrupt:
    if (row["key"], row["action"]) != (key, action):
        raise InterruptMismatch(
            f"interrupt {key!r} of run {run_id} was opened as {row['key']!r} for action "
            f"{row['action']!r} and is now requested for action {action!r}"
        )
    return _interrupt_from_row(row)


# Built once, their values bound: building a statement costs more than running it.
_BY_ID = select(interrupts).where(interrupts.c.id == bindparam("interrupt_id"))
_IN_RUN = _BY_ID.where(interrupts.c.run_id == bindparam("run_id"))
_BY_KEY = select(interrupts).where(
    interrupts.c.run_id == bindparam("run_id"), interrupts.c.key == bindparam("key")
)


async def _select_txn(
    conn: AsyncConnection, statement: Select[Any], **values: str
) -> RowMapping | None:
    found: RowMapping | None = (await conn.execute(statement, values)).mappings().first()
    return found


async def _reread_txn(conn: AsyncConnection, interrupt_id: str) -> Interrupt:
    row = await _select_txn(conn, _BY_ID, interrupt_id=interrupt_id)
    if row is None:  # pragma: no cover - written in this transaction a moment ago
        raise AssertionError(f"interrupt {interrupt_id} vanished")
    return _interrupt_from_row(row)


def _reason_text(interrupt: Interrupt) -> str:
    return "no reason" if interrupt.reason is None else interrupt.reason.value


def _resolved_text(interrupt: Interrupt) -> str:
    return "an unknown time" if interrupt.resolved_at is None else interrupt.resolved_at.isoformat()


def _interrupt_from_row(row: RowMapping) -> Interrupt:
    reason = row["reason"]
    return Interrupt(
        interrupt_id=row["id"],
        run_id=RunId(row["run_id"]),
        key=row["key"],
        action=row["action"],
        data=row["data"],
        status=InterruptStatus(row["status"]),
        reason=None if reason is None else DecisionReason(reason),
        decision=row["decision"],
        attempt=Attempt(row["attempt"]),
        created_at=row["created_at"],
        expires_at=row["expires_at"],
        resolved_at=row["resolved_at"],
    )
