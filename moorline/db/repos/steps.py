"""Step checkpoints: the durable side of ``ctx.step(key, fn, ...)``.

A step is keyed by ``(run id, step key)``. The engine calls :meth:`StepsRepo.start` before it
runs the function and :meth:`StepsRepo.succeed` or :meth:`StepsRepo.fail` after it:

* no row yet → one is inserted ``running`` under this attempt, and the function runs;
* a ``succeeded`` row recorded with the same function and call hash → a *replay*: the engine
  returns the stored output and does not call the function (invariant 3);
* a ``succeeded`` row recorded for another call → :class:`StepMismatch`: the workflow's code
  changed between attempts, and a recorded output is never handed to a different call;
* a ``running`` or ``failed`` row (in flight when a worker died, or failed earlier) → taken over
  by this attempt; the function runs again with the same idempotency key.

**Fencing.** Every write is one transaction that first runs ``UPDATE runs … WHERE <fence>``
and requires exactly one matched row. That statement both proves the lease is still this
attempt's (invariant 2) and takes the run's row lock, so every writer of a run's steps is
serialised behind it: on PostgreSQL and MariaDB a concurrent writer waits for the lock and then
re-evaluates the fence on the new row version, on SQLite ``BEGIN IMMEDIATE`` serialises all
writers. A stale fence (reclaimed, cancelled, finished run) matches nothing, writes nothing and
raises :class:`LeaseLost`. The step statements carry their own conditions as well (status, and
attempt for finishing) and their rowcounts are checked.

**Cancellation.** :meth:`StepsRepo.start` also requires, in the same statement, that the run
has no recorded cancel, and raises :class:`CancelRequested` otherwise: no step starts after a
cancel is recorded, whatever the RuntimeStore said. Finishing a step that was already running
stays allowed, so its result is kept.

**The engine's path: one statement a transition.** ``ctx.step`` knows the steps its attempt
saw recorded (loaded once per attempt), so a step it has not seen is started with
:meth:`StepsRepo.insert_new`: one ``INSERT … SELECT … FROM runs WHERE <fence> AND no cancel``
that locks the run's row like the ``UPDATE`` above (``FOR NO KEY UPDATE`` / ``FOR UPDATE``,
SQLite's write lock) and inserts nothing when the fence or the cancel check fails; a row that
exists after all (a key the database compares as equal to another) is left to :meth:`start`.
Finishing is one ``UPDATE steps … WHERE … AND EXISTS (<the fenced run row, locked>)``. Both
wait for a lock another writer of the run holds and then test the fence on what it committed
(PostgreSQL re-checks a locked row's predicate, and locking reads on InnoDB read the latest
version), so they are exactly as fenced as the two-statement form. Each is sent as a
transaction of its own (:meth:`~moorline.db.manager.DatabaseManager.write_statement`: autocommit
on the servers, one thread crossing on SQLite); only when it writes nothing does a second
transaction find out why, which is safe because what it looks for never changes back: a lost
fence stays lost, a recorded cancel stays recorded, a finished step stays finished. A step whose
function has returned before its start was written is recorded by one statement of both
(:meth:`StepsRepo.record`, the engine's ``DeferredStart``). On PostgreSQL, the starts and the
successes that a busy worker's attempts ask for together share one statement
(:mod:`.step_batches`); a step that statement does not write takes its own, as above.

Every public method is idempotent, so each is wrapped in ``with_retry``: a checkpoint whose
commit acknowledgement was lost is retried and finds its own write (docs/reliability.md E6).
"""

import builtins
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import RowMapping, bindparam, func, insert, literal, null, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.backends import Backend
from moorline.db.manager import DatabaseManager
from moorline.db.repos.fences import fence_parameters, hold_fence_txn
from moorline.db.repos.records import Fence, Step
from moorline.db.repos.step_batches import StepBatches
from moorline.db.repos.step_statements import (
    finish_statement,
    insert_new_statement,
    next_seq,
    record_statement,
)
from moorline.db.repos.usage import Charge, add_usage_txn
from moorline.db.schema import steps
from moorline.errors import CancelRequested as CancelRequested  # re-exported (old home)
from moorline.errors import LeaseLost as LeaseLost
from moorline.errors import StepMismatch as StepMismatch  # re-exported (old home)
from moorline.errors import StepNotRunning as StepNotRunning  # re-exported (old home)
from moorline.types import Attempt, JSONValue, RunId, StepStatus
from moorline.usage import usage_from_json, usage_to_json

_RUNNING = StepStatus.RUNNING.value
_SUCCEEDED = StepStatus.SUCCEEDED.value


@dataclass(frozen=True, slots=True, kw_only=True)
class StepStart:
    """What :meth:`StepsRepo.start` found and did.

    Attributes:
        step: The step's row after the call.
        replay: The step already succeeded: return ``step.output`` without calling the
            function.
        repeated: An earlier ``running`` or ``failed`` row was taken over: the function may
            have run (partly) before, under the same idempotency key.
    """

    step: Step
    replay: bool
    repeated: bool


class StepsRepo:
    """Step checkpoints of runs, every write fenced by the run's attempt."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db
        self._backend: Backend = db.backend
        self._insert_new = insert_new_statement(self._backend, numbered=False)
        self._insert_numbered = {
            refuse: insert_new_statement(self._backend, numbered=True, refuse_cancelled=refuse)
            for refuse in (True, False)
        }
        self._finishes = {
            status: finish_statement(self._backend, status)
            for status in (StepStatus.SUCCEEDED, StepStatus.FAILED)
        }
        self._counted_finishes = {
            status: finish_statement(self._backend, status, counted=True)
            for status in (StepStatus.SUCCEEDED, StepStatus.FAILED)
        }
        self._records = {
            (refuse_cancelled, counted): record_statement(
                self._backend, refuse_cancelled=refuse_cancelled, counted=counted
            )
            for refuse_cancelled in (True, False)
            for counted in (True, False)
        }
        # The engine's starts and successes of many attempts, one statement per batch.
        self._batches = StepBatches(db) if StepBatches.can_batch(self._backend) else None

    async def get(self, run_id: RunId, key: str) -> Step | None:
        """The step ``key`` of ``run_id``, or None when it never started."""

        async def read() -> Step | None:
            async with self._db.connect() as conn:
                row = await _select_step_txn(conn, run_id, key)
            return None if row is None or row["key"] != key else _step_from_row(row)

        return await self._db.with_retry(read)

    async def list(self, run_id: RunId) -> builtins.list[Step]:
        """Every step of ``run_id`` in the order they first started (``seq``).

        Steps stored before ``seq`` existed (NULL) come first, by start time then key.
        """
        stmt = (
            select(steps)
            .where(steps.c.run_id == run_id)
            .order_by(func.coalesce(steps.c.seq, 0), steps.c.started_at, steps.c.key)
        )

        async def read() -> builtins.list[Step]:
            async with self._db.connect() as conn:
                rows = (await conn.execute(stmt)).mappings().all()
            return [_step_from_row(row) for row in rows]

        return await self._db.with_retry(read)

    async def start(self, fence: Fence, key: str, function: str, call_hash: str) -> StepStart:
        """Begin step ``key`` under ``fence``, or find that it already succeeded.

        Args:
            fence: The attempt's fence.
            key: The step key, unique within the run.
            function: The step function's registered name (persisted; not ``__qualname__``).
            call_hash: SHA-256 hex of the function name and its arguments.

        Returns:
            The step as it is now, and whether this is a replay (return ``step.output``) or a
            repetition of a step that was in flight or failed before.

        Raises:
            LeaseLost: The fence no longer holds; nothing was written.
            CancelRequested: The run's cancel is recorded; nothing was written.
            StepMismatch: The step already succeeded for a different function or call hash.
        """

        async def attempt() -> StepStart:
            async with self._db.write_transaction() as conn:
                await hold_fence_txn(
                    conn, self._backend.name, fence, f"step {key!r}", refuse_cancelled=True
                )
                return await self._start_txn(conn, fence, key, function, call_hash)

        return await self._db.with_retry(attempt)

    async def insert_new(
        self,
        fence: Fence,
        key: str,
        function: str,
        call_hash: str,
        *,
        seq: int | None = None,
        elapsed_s: float = 0.0,
        refuse_cancelled: bool = True,
    ) -> bool:
        """Begin step ``key``, which the caller has not seen recorded, in one fenced statement.

        The engine's fast :meth:`start` for a step its attempt has not seen: an ``INSERT …
        SELECT`` from the run's locked row (see the module docstring), with no read before it
        and none after.

        Args:
            fence: The attempt's fence.
            key: The step key, unique within the run.
            function: The step function's registered name (persisted; not ``__qualname__``).
            call_hash: SHA-256 hex of the function name and its arguments.
            seq: The step's place among the run's steps, when the caller knows it (the engine
                numbers the steps of its attempt after those it loaded); None: the run's
                largest plus one, read in the statement.
            elapsed_s: With ``seq``: how long the function has run already (a deferred
                start), which dates the start back.
            refuse_cancelled: With ``seq``, False when the function was called already: a
                recorded cancel then does not stop the write (the caller learns of it
                otherwise). Without ``seq`` the write always refuses a recorded cancel.

        Returns:
            True: the step is now ``running`` under this attempt; call the function. False: a
            row with this key exists (the database compares ``key`` as equal to a recorded
            one, or this attempt's own insert committed unacknowledged); nothing was written,
            and :meth:`start` decides.

        Raises:
            LeaseLost: The fence no longer holds; nothing was written.
            CancelRequested: The run's cancel is recorded; nothing was written.
        """
        parameters = _call_parameters(fence, key, function, call_hash)
        statement = self._insert_new
        if seq is not None:
            statement = self._insert_numbered[refuse_cancelled]
            parameters.update(step_seq=seq, step_elapsed_s=elapsed_s)
            # A start dated back, or one a cancel may not refuse, is rare: it goes alone.
            batches = self._batches if refuse_cancelled and not elapsed_s else None
            if batches is not None and await batches.start(parameters):
                return True

        async def attempt() -> bool:
            try:
                if await self._db.write_statement(statement, parameters) == 1:
                    return True
            except IntegrityError:
                return False
            # Nothing inserted: the fence or the cancel check failed; say which. A fence that
            # failed never holds again (attempts only grow), nor does a cancel go away.
            async with self._db.write_transaction() as conn:
                await hold_fence_txn(
                    conn,
                    self._backend.name,
                    fence,
                    f"step {key!r}",
                    refuse_cancelled=refuse_cancelled,
                )
            return False  # pragma: no cover - a fence that failed cannot hold again

        return await self._db.with_retry(attempt)

    async def record(
        self,
        fence: Fence,
        key: str,
        function: str,
        call_hash: str,
        output: JSONValue,
        *,
        seq: int,
        elapsed_s: float,
        charge: Charge | None = None,
    ) -> bool:
        """Record step ``key``, whose start was never written, as succeeded with ``output``.

        The engine's write for a step that returned within ``step_start_after``: one fenced
        ``INSERT … SELECT`` where :meth:`insert_new` and :meth:`succeed` would be two, the
        step's start dated ``elapsed_s`` before its end. Like a start it refuses a run whose
        cancel is recorded; since the function has run, a second transaction then records the
        step anyway (finishing work already done is always allowed) and says so.

        Args:
            fence: The attempt's fence.
            key: The step key, which the attempt has not seen recorded.
            function: The step function's registered name.
            call_hash: SHA-256 hex of the function name and its arguments.
            output: What the function returned, as stored.
            seq: The step's place among the run's steps.
            elapsed_s: Seconds from the function's call to its return.
            charge: The model calls the step made, written in the same transaction.

        Returns:
            Whether the run's cancel was found recorded: the caller stops at its next boundary.

        Raises:
            LeaseLost: The fence no longer holds; nothing was written.
            StepMismatch: A recorded step has a key this database compares as equal to ``key``.
        """
        parameters = {
            **_call_parameters(fence, key, function, call_hash),
            "step_seq": seq,
            "step_output": output,
            "step_elapsed_s": elapsed_s,
        }
        usage = charge if charge is not None and not charge.empty else None
        if usage is not None:
            parameters["step_usage"] = usage_to_json(usage.spent)

        async def write_txn(conn: AsyncConnection, *, refuse_cancelled: bool) -> bool:
            statement = self._records[refuse_cancelled, usage is not None]
            if (await conn.execute(statement, parameters)).rowcount != 1:
                return False
            if usage is not None:
                await add_usage_txn(conn, self._backend, fence.run_id, usage)
            return True

        async def attempt() -> bool:
            try:
                if usage is None:
                    statement = self._records[True, False]
                    if await self._db.write_statement(statement, parameters) == 1:
                        return False
                else:
                    async with self._db.write_transaction() as conn:
                        if await write_txn(conn, refuse_cancelled=True):
                            return False
            except IntegrityError:
                pass
            return await self._record_refused(fence, key, function, call_hash, output, write_txn)

        return await self._db.with_retry(attempt)

    async def _record_refused(
        self,
        fence: Fence,
        key: str,
        function: str,
        call_hash: str,
        output: JSONValue,
        write_txn: Callable[..., Awaitable[bool]],
    ) -> bool:
        """:meth:`record` after its statement wrote nothing: find out why, then act on it.

        A lost fence, a recorded cancel, or a row with this key (one the database compares as
        equal, or this very insert, committed unacknowledged).
        """
        async with self._db.write_transaction() as conn:
            await hold_fence_txn(conn, self._backend.name, fence, f"step {key!r}")
            found = await _select_step_txn(conn, fence.run_id, key)
            if found is None:
                # The fence held all along, so the recorded cancel refused the first write.
                if not await write_txn(conn, refuse_cancelled=False):  # pragma: no cover
                    raise AssertionError(f"step {key!r} not recorded under the run's lock")
                return True
        if found["key"] != key or not _is_recorded(
            found, fence, StepStatus.SUCCEEDED, {"output": output}
        ):
            raise _mismatch(fence, key, found, function, call_hash)
        return False

    async def _start_txn(
        self, conn: AsyncConnection, fence: Fence, key: str, function: str, call_hash: str
    ) -> StepStart:
        now = self._backend.now()
        found = await _select_step_txn(conn, fence.run_id, key)
        if found is None:
            # Read first, not a subquery of the INSERT: MySQL refuses one that reads the table
            # it inserts into. The run's row is locked (the fence), so the number is ours.
            seq = await conn.scalar(select(next_seq(literal(fence.run_id))))
            await conn.execute(
                insert(steps).values(
                    run_id=fence.run_id,
                    key=key,
                    status=_RUNNING,
                    attempt=fence.attempt,
                    function=function,
                    call_hash=call_hash,
                    started_at=now,
                    seq=seq,
                )
            )
            return StepStart(
                step=await self._reread_txn(conn, fence, key), replay=False, repeated=False
            )
        if found["status"] == _SUCCEEDED or found["key"] != key:
            if (found["key"], found["function"], found["call_hash"]) != (key, function, call_hash):
                raise _mismatch(fence, key, found, function, call_hash)
            return StepStart(step=_step_from_row(found), replay=True, repeated=False)
        # In flight at a crash, or failed before: this attempt takes it over. Conditional on
        # the row as read; the run's row lock makes a miss impossible, so a miss is a bug.
        result = await conn.execute(
            update(steps)
            .where(
                steps.c.run_id == fence.run_id,
                steps.c.key == key,
                steps.c.status == found["status"],
                steps.c.attempt == found["attempt"],
            )
            .values(
                status=_RUNNING,
                attempt=fence.attempt,
                function=function,
                call_hash=call_hash,
                output=null(),
                error=None,
                started_at=now,
                finished_at=None,
            )
        )
        if result.rowcount != 1:
            raise StepNotRunning(
                f"step {key!r} of run {fence.run_id} changed while attempt {fence.attempt} "
                "held the run's lock"
            )
        step = await self._reread_txn(conn, fence, key)
        return StepStart(step=step, replay=False, repeated=True)

    async def succeed(
        self, fence: Fence, key: str, output: JSONValue, *, charge: Charge | None = None
    ) -> None:
        """Record that step ``key`` returned ``output``; a finished step is never overwritten.

        Idempotent: recording the same output again under the same attempt is a no-op (a
        retried checkpoint whose first commit went through). ``charge``, the model calls the
        step made, is written in the same transaction (:mod:`moorline.db.repos.usage`).

        Raises:
            LeaseLost: The fence no longer holds; nothing was written.
            StepNotRunning: The step is not running under this attempt (never started, taken
                over, or already finished with another outcome).
        """
        await self._finish(
            fence,
            key,
            StepStatus.SUCCEEDED,
            {"output": output, "error": None},
            {"step_output": output},
            charge,
        )

    async def fail(
        self, fence: Fence, key: str, error: str, *, charge: Charge | None = None
    ) -> None:
        """Record that step ``key`` raised ``error`` in this attempt.

        A failed step is taken over by the next :meth:`start` of the same key (a per-step
        retry in this attempt, or a later attempt). Idempotent like :meth:`succeed`.

        Raises:
            LeaseLost: The fence no longer holds; nothing was written.
            StepNotRunning: The step is not running under this attempt.
        """
        # The output stays SQL NULL: start() cleared it when this attempt took the step.
        await self._finish(
            fence, key, StepStatus.FAILED, {"error": error}, {"step_error": error}, charge
        )

    async def _finish(
        self,
        fence: Fence,
        key: str,
        status: StepStatus,
        values: dict[str, Any],
        outcome: dict[str, Any],
        charge: Charge | None = None,
    ) -> None:
        """Record ``status`` with ``values`` (``outcome``: the same, as statement parameters)."""
        action = f"{status.value} of step {key!r}"
        # One statement: the step's own conditions, and the fence on the run's locked row.
        stmt = self._finishes[status]
        parameters = {**fence_parameters(fence), "step_key": key, **outcome}
        uncounted = charge is None or charge.empty
        if self._batches is not None and status is StepStatus.SUCCEEDED and uncounted:
            if await self._batches.succeed(parameters):
                return

        async def finish_with_usage() -> bool:
            # The same statement, then the usage, in one transaction: the step's usage is
            # counted exactly when its outcome is recorded (a step that made no call skips it).
            assert charge is not None
            counted = {**parameters, "step_usage": usage_to_json(charge.spent)}
            async with self._db.write_transaction() as conn:
                if (await conn.execute(self._counted_finishes[status], counted)).rowcount != 1:
                    return False
                await add_usage_txn(conn, self._backend, fence.run_id, charge)
            return True

        async def attempt() -> None:
            if not uncounted:
                if await finish_with_usage():
                    return
            elif await self._db.write_statement(stmt, parameters) == 1:
                return
            # Nothing written: a stale fence, or a step not running under this attempt (both
            # final: only this attempt writes its steps while the fence holds).
            async with self._db.write_transaction() as conn:
                await hold_fence_txn(conn, self._backend.name, fence, action)
                found = await _select_step_txn(conn, fence.run_id, key)
                if found is not None and _is_recorded(found, fence, status, values):
                    return
                state = "never started" if found is None else _describe(found)
                raise StepNotRunning(
                    f"cannot record {action} of run {fence.run_id} under attempt "
                    f"{fence.attempt}: the step is {state}"
                )

        await self._db.with_retry(attempt)

    async def _reread_txn(self, conn: AsyncConnection, fence: Fence, key: str) -> Step:
        row = await _select_step_txn(conn, fence.run_id, key)
        if row is None:  # pragma: no cover - written in this transaction a moment ago
            raise AssertionError(f"step {key!r} of run {fence.run_id} vanished")
        return _step_from_row(row)


_STEP = select(steps).where(
    steps.c.run_id == bindparam("step_run_id"), steps.c.key == bindparam("step_key")
)


def _call_parameters(fence: Fence, key: str, function: str, call_hash: str) -> dict[str, Any]:
    """The parameters a new step's statements share: the fence's and the call's."""
    return {
        **fence_parameters(fence),
        "step_key": key,
        "step_function": function,
        "step_call_hash": call_hash,
    }


async def _select_step_txn(conn: AsyncConnection, run_id: str, key: str) -> RowMapping | None:
    found = await conn.execute(_STEP, {"step_run_id": run_id, "step_key": key})
    return found.mappings().first()


def _is_recorded(row: RowMapping, fence: Fence, status: StepStatus, values: dict[str, Any]) -> bool:
    """Whether ``row`` already holds exactly this outcome, written under this attempt."""
    return (
        row["status"] == status.value
        and row["attempt"] == fence.attempt
        and all(row[name] == value for name, value in values.items())
    )


def _mismatch(
    fence: Fence, key: str, found: RowMapping, function: str, call_hash: str
) -> StepMismatch:
    """The error of a call of step ``key`` that meets the recorded row ``found``."""
    return StepMismatch(
        fence.run_id,
        key,
        recorded_key=found["key"],
        recorded_function=found["function"],
        recorded_call_hash=found["call_hash"],
        function=function,
        call_hash=call_hash,
    )


def _describe(row: RowMapping) -> str:
    return f"{row['status']} under attempt {row['attempt']}"


def _step_from_row(row: RowMapping) -> Step:
    return Step(
        run_id=RunId(row["run_id"]),
        key=row["key"],
        status=StepStatus(row["status"]),
        attempt=Attempt(row["attempt"]),
        function=row["function"],
        call_hash=row["call_hash"],
        output=row["output"],
        error=row["error"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        seq=row["seq"],
        usage=usage_from_json(row["usage"]),
    )
