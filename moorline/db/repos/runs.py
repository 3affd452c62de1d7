"""The run-writing side of dispatch: inserting and enqueuing runs, and finishing attempts.

Every method opens its own transaction, and every transition is one conditional statement
whose rowcount (or returned ids) is checked:

* **insert** — :meth:`RunsRepo.insert_pending` stores runs ``pending`` (admission still has to
  decide); :meth:`RunsRepo.submit_many` stores them ``queued`` with their ``queued`` events in
  the same transaction, the fast path when admission has nothing to say. A batch is all or
  nothing: on any error nothing of it is written.
* **enqueue** — ``pending → queued`` (:meth:`RunsRepo.enqueue`) or ``pending → rate_limited``
  (:meth:`RunsRepo.mark_rate_limited`), each conditional on the run still being ``pending``, so
  two API processes deciding about one run move it once.
* **finish** — :meth:`RunsRepo.finish_many` ends attempts under their fences (``Fence.clause()``),
  several in one transaction. A worker whose lease was taken over matches no row and writes
  nothing, not even an event.

Times come from the database clock only. Inserts and finishes read it once per transaction and
bind the value (rather than calling the SQL function per row), which keeps one clock reading per
batch and lets aiomysql send a batch as one multi-row INSERT.
"""

import hashlib
import json
import logging
import math
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeAlias

from sqlalchemy import ColumnElement, Update, and_, bindparam, insert, null, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db import dialects
from moorline.db.dialects import DialectName, db_now
from moorline.db.manager import DatabaseManager
from moorline.db.repos.events import (
    EVENT_FAILED,
    EVENT_QUEUED,
    EVENT_RETRYING,
    EVENT_SUCCEEDED,
    append_events_txn,
)
from moorline.db.repos.records import Fence, Run, run_from_row
from moorline.db.schema import runs, tenants
from moorline.errors import Conflict, IdempotencyConflict, InvalidInput, NotFound
from moorline.types import Attempt, JSONObject, JSONValue, RunId, RunStatus, TenantId

logger = logging.getLogger(__name__)

DEFAULT_MAX_ATTEMPTS = 3

_PENDING = RunStatus.PENDING.value
_QUEUED = RunStatus.QUEUED.value

# Ids per IN list; far below every backend's bound-parameter limit (asyncpg: 32,767).
_IN_CHUNK = 1000


@dataclass(frozen=True, slots=True, kw_only=True)
class NewRun:
    """A run to store: what the trigger asked for, routed to a lane by the tenant's plan.

    Attributes:
        tenant_id: The owner.
        workflow: The registered workflow's name.
        input: The workflow's JSON arguments (already validated against its parameters).
        lane: The queue the run goes to (the plan's lane).
        priority: Higher is claimed first within a lane (the plan's priority).
        max_attempts: Claims the run may have before it ends ``failed``.
        idempotency_key: Unique per tenant when set: a second run with it is refused.
        conversation_id: The conversation the run belongs to, if any.
        timeout_s: Hard time limit of the run in seconds; None for the workflow's default.
        delay_s: Seconds after the database's current time before the run may be claimed.
        run_id: The id to store it under; a new uuid4 when None.
    """

    tenant_id: TenantId
    workflow: str
    input: JSONObject
    lane: str
    priority: int = 0
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    idempotency_key: str | None = None
    conversation_id: str | None = None
    timeout_s: float | None = None
    delay_s: float = 0.0
    run_id: RunId | None = None

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if not (math.isfinite(self.delay_s) and self.delay_s >= 0):
            raise ValueError(f"delay_s must be a finite number >= 0, got {self.delay_s}")
        if self.timeout_s is not None and not (
            math.isfinite(self.timeout_s) and self.timeout_s > 0
        ):
            raise ValueError(f"timeout_s must be a finite number > 0, got {self.timeout_s}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Succeeded:
    """The attempt under ``fence`` returned ``output``: the run ends ``succeeded``."""

    fence: Fence
    output: JSONValue


@dataclass(frozen=True, slots=True, kw_only=True)
class Failed:
    """The attempt under ``fence`` raised.

    Attributes:
        fence: The attempt's fence.
        error: What went wrong, e.g. ``{"type": "ValueError", "message": "…", "reason": "retry"}``
            (``reason`` is the retry policy's: ``retry``, ``max attempts``, ``non-retryable``).
        retry_delay_s: None to fail the run for good (``failed``); a number of seconds to put
            it back to ``queued``, claimable from database time + that delay.
    """

    fence: Fence
    error: JSONObject
    retry_delay_s: float | None


Outcome: TypeAlias = Succeeded | Failed

_EventItem: TypeAlias = tuple[RunId, Attempt, str, JSONObject]


def hash_input(value: JSONValue) -> str:
    """SHA-256 hex of the canonical JSON of ``value`` (sorted keys, no spaces, UTF-8).

    Two inputs that differ only in key order or whitespace hash alike, so an idempotent
    resubmission is recognised however its client serialised it.

    Raises:
        InvalidInput: ``value`` is not JSON (NaN or infinity, a non-string key, an object).
    """
    try:
        text = json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"run input is not JSON: {exc}") from None
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class RunsRepo:
    """Stores runs, moves them out of ``pending``, and records how their attempts ended."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db
        self._dialect: DialectName = db.dialect

    # --- insert -----------------------------------------------------------------------------

    async def insert_pending(self, new: Sequence[NewRun]) -> list[Run]:
        """Store ``new`` as ``pending`` runs, in one transaction; not claimable yet.

        ``not_before`` is fixed now (database time + each run's ``delay_s``), so a run's delay
        counts from when it was accepted, however long admission takes to enqueue it.

        Returns:
            The runs as stored, in the order given.

        Raises:
            IdempotencyConflict: a run's ``(tenant_id, idempotency_key)`` is already taken, or
                appears twice in ``new``; nothing of the batch was written.
            NotFound: a run names a tenant that does not exist; nothing was written.
            Conflict: a ``run_id`` given is already taken; nothing was written.
            InvalidInput: an input is not JSON; nothing was written.
        """
        return await self._insert(new, RunStatus.PENDING)

    async def submit_many(self, new: Sequence[NewRun]) -> list[Run]:
        """Store ``new`` as ``queued`` runs with one ``queued`` event each, in one transaction.

        The same as :meth:`insert_pending` followed by :meth:`enqueue`, in one transaction; the
        rows are inserted ``queued`` directly, since nothing can see them ``pending`` anyway.

        Returns:
            The runs as stored (status ``queued``), in the order given.

        Raises:
            IdempotencyConflict: as for :meth:`insert_pending`; nothing was written.
            NotFound: as for :meth:`insert_pending`; nothing was written.
            Conflict: as for :meth:`insert_pending`; nothing was written.
            InvalidInput: as for :meth:`insert_pending`; nothing was written.
        """
        return await self._insert(new, RunStatus.QUEUED)

    async def _insert(self, new: Sequence[NewRun], status: RunStatus) -> list[Run]:
        if not new:
            return []
        rows = [_row_of(item) for item in new]
        _check_unique_within(new, rows)
        ids = [RunId(row["id"]) for row in rows]
        tries = 0

        async def write() -> list[Run]:
            nonlocal tries
            tries += 1
            try:
                async with self._db.write_transaction() as conn:
                    return await self._insert_txn(conn, rows, status)
            except IntegrityError as exc:
                # The transaction is rolled back; find out which rule the batch broke.
                return await self._explain(exc, new, ids, is_retry=tries > 1)

        # Retried on a lost connection: the run ids are fixed above, so a retry after a commit
        # whose acknowledgement was lost finds them stored (see _explain) and stores nothing twice.
        return await self._db.with_retry(write)

    async def _insert_txn(
        self, conn: AsyncConnection, rows: Sequence[dict[str, Any]], status: RunStatus
    ) -> list[Run]:
        now = await _db_now_txn(conn, self._dialect)
        params = [
            {
                **{key: value for key, value in row.items() if key != "delay_s"},
                "status": status.value,
                "not_before": now + timedelta(seconds=row["delay_s"]),
                "created_at": now,
                "updated_at": now,
            }
            # In tenant order: each row's foreign-key check locks its tenant's row (shared), and
            # claims lock tenant rows in id order too, so the two never wait on each other in a
            # cycle on MariaDB.
            for row in sorted(rows, key=lambda row: (row["tenant_id"], row["id"]))
        ]
        await conn.execute(insert(runs), params)
        ids = [RunId(row["id"]) for row in rows]
        if status is RunStatus.QUEUED:
            queued: list[_EventItem] = [(run_id, Attempt(0), EVENT_QUEUED, {}) for run_id in ids]
            await append_events_txn(conn, self._dialect, queued, now=now, new_runs=True)
        # Every column is known here (the times are the database time read above), so the runs
        # are built rather than read back: one round trip less per batch. The contract tests
        # check they equal what a read returns on every backend.
        by_id = {param["id"]: param for param in params}
        return [_run_of(by_id[run_id]) for run_id in ids]

    async def _explain(
        self, exc: IntegrityError, new: Sequence[NewRun], ids: Sequence[RunId], *, is_retry: bool
    ) -> list[Run]:
        """Turn the integrity error of a rolled-back batch into the error it means.

        Reads the rows the batch collided with instead of parsing driver messages, which
        differ between drivers and versions. A retried batch (the first try's commit was
        acknowledged by nobody) whose every run is already stored as given was committed by
        that first try: its runs are returned.
        """
        async with self._db.connect() as conn:
            stored = await _select_runs_txn(conn, ids)
            if is_retry and len(stored) == len(ids) and all(_is_stored_as(stored, new, ids)):
                return [stored[run_id] for run_id in ids]
            keys = [(item.tenant_id, item.idempotency_key) for item in new if item.idempotency_key]
            taken = await _taken_keys_txn(conn, keys)
            if taken:
                shown = ", ".join(repr(key) for _, key in sorted(taken))
                raise IdempotencyConflict(
                    f"idempotency key already used by another run of this tenant: {shown}"
                ) from exc
            if stored:
                shown = ", ".join(sorted(stored))
                raise Conflict(f"run id already exists: {shown}") from exc
            tenant_ids = sorted({item.tenant_id for item in new})
            known = set(
                (await conn.execute(select(tenants.c.id).where(tenants.c.id.in_(tenant_ids))))
                .scalars()
                .all()
            )
            unknown = [tenant_id for tenant_id in tenant_ids if tenant_id not in known]
            if unknown:
                raise NotFound(f"no such tenant: {', '.join(unknown)}") from exc
        # A row collided with something it no longer collides with (a run deleted meanwhile,
        # say): report it as a conflict rather than leak the driver's error.
        raise Conflict("the runs could not be stored: a concurrent change conflicted") from exc

    # --- enqueue ----------------------------------------------------------------------------

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
                now = await _db_now_txn(conn, self._dialect)
                moved = await self._move_pending_txn(
                    conn, sorted(wanted), {"status": _QUEUED, "updated_at": now}
                )
                queued: list[_EventItem] = [
                    (RunId(run_id), Attempt(0), EVENT_QUEUED, {}) for run_id in moved
                ]
                await append_events_txn(conn, self._dialect, queued, now=now)
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
                now = await _db_now_txn(conn, self._dialect)
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
        for offset in range(0, len(run_ids), _IN_CHUNK):
            chunk = list(run_ids[offset : offset + _IN_CHUNK])
            moved += await self._move_pending_chunk_txn(conn, chunk, values)
        return moved

    async def _move_pending_chunk_txn(
        self, conn: AsyncConnection, run_ids: list[str], values: dict[str, Any]
    ) -> list[str]:
        def still_pending(ids: Iterable[str]) -> ColumnElement[bool]:
            # On the UPDATE itself too: a predicate checked only by the earlier SELECT would
            # not be re-checked after a lock wait.
            return and_(runs.c.id.in_(list(ids)), runs.c.status == _PENDING)

        if dialects.supports_update_returning(self._dialect):
            stmt = update(runs).where(still_pending(run_ids)).values(**values)
            return list((await conn.execute(stmt.returning(runs.c.id))).scalars())
        lock = dialects.lock_rows(select(runs.c.id).where(still_pending(run_ids)), self._dialect)
        locked = list((await conn.execute(lock)).scalars())
        if not locked:
            return []
        result = await conn.execute(update(runs).where(still_pending(locked)).values(**values))
        # Every locked row is still pending (we hold its lock), so each must have matched.
        if result.rowcount != len(locked):  # pragma: no cover - would be a locking bug
            raise AssertionError(f"moved {result.rowcount} of {len(locked)} locked pending runs")
        return locked

    # --- finish -----------------------------------------------------------------------------

    async def finish_many(self, outcomes: Sequence[Outcome]) -> list[bool]:
        """Record how attempts ended, each under its fence, all in one transaction.

        Each outcome is one UPDATE conditional on its fence, its rowcount checked; its event is
        written only when it applied:

        * :class:`Succeeded` → ``succeeded`` with ``output`` (``error`` cleared), event
          ``succeeded``;
        * :class:`Failed` with ``retry_delay_s`` → ``queued``, claimable from database time +
          the delay, ``error`` kept, ``attempt`` unchanged (the next claim increments it),
          event ``retrying`` ``{"delay_s", "error"}``;
        * :class:`Failed` without → ``failed`` with ``error``, event ``failed`` (data: the
          error).

        Every applied outcome clears the lease; the terminal ones set ``finished_at`` and
        ``elapsed_time`` (seconds from the first ``started_at``), from database time.

        A batch retried after a lost connection reports False for outcomes its first try had
        already committed (their fences no longer match); the runs are finished all the same.

        Returns:
            Per outcome, in the order given, whether it applied; False when the fence no
            longer holds (the run was reclaimed, cancelled, finished, or never ours).
        """
        if not outcomes:
            return []

        async def write() -> list[bool]:
            applied = [False] * len(outcomes)
            async with self._db.write_transaction() as conn:
                holding = await self._lock_holding_txn(conn, outcomes)
                if not holding:
                    return applied
                now = await _db_now_txn(conn, self._dialect)
                by_kind: dict[str, list[dict[str, Any]]] = {}
                appended: list[_EventItem] = []
                for index, outcome in enumerate(outcomes):
                    fence = outcome.fence
                    started_at = holding.pop(fence.run_id, None)
                    if started_at is None:
                        continue  # the fence does not hold (or this run came twice)
                    kind, row_params, event = _finish_params(outcome, now, started_at)
                    by_kind.setdefault(kind, []).append(row_params)
                    appended.append((fence.run_id, fence.attempt, *event))
                    applied[index] = True
                for kind, params in by_kind.items():
                    # One executemany per kind. The rows are locked (or, on SQLite, the whole
                    # database is), so every fence read as holding above still holds here.
                    result = await conn.execute(_FINISH_STATEMENTS[kind](now), params)
                    if result.rowcount not in (-1, len(params)):
                        raise AssertionError(
                            f"finish {kind}: {result.rowcount} of {len(params)} locked runs changed"
                        )
                await append_events_txn(conn, self._dialect, appended, now=now)
            return applied

        return await self._db.with_retry(write)

    async def _lock_holding_txn(
        self, conn: AsyncConnection, outcomes: Sequence[Outcome]
    ) -> dict[str, datetime]:
        """Lock the outcomes' runs; ``started_at`` of those whose fence still holds.

        Server databases lock the rows (``FOR UPDATE``, in id order so two batches never
        deadlock) and re-check the predicate on the latest committed version after any wait;
        SQLite's ``BEGIN IMMEDIATE`` already holds the only write lock. Either way the fences
        found holding here cannot be broken before this transaction commits.
        """
        fences = {outcome.fence.run_id: outcome.fence for outcome in outcomes}
        run_ids = sorted(fences)
        holding: dict[str, datetime] = {}
        for offset in range(0, len(run_ids), _IN_CHUNK):
            chunk = run_ids[offset : offset + _IN_CHUNK]
            stmt = (
                select(runs.c.id, runs.c.attempt, runs.c.lease_owner, runs.c.started_at)
                .where(runs.c.id.in_(chunk), runs.c.status == RunStatus.RUNNING.value)
                .order_by(runs.c.id)
            )
            if dialects.uses_row_locks(self._dialect):
                stmt = stmt.with_for_update()
            for row in await conn.execute(stmt):
                fence = fences[row.id]
                if (row.attempt, row.lease_owner) == (fence.attempt, fence.owner):
                    holding[row.id] = row.started_at
        return holding

    # --- reads ------------------------------------------------------------------------------

    async def get(self, run_id: RunId) -> Run | None:
        """The run, or None when there is none with that id."""
        return (await self.get_many([run_id])).get(run_id)

    async def get_many(self, run_ids: Sequence[RunId]) -> dict[RunId, Run]:
        """The runs among ``run_ids`` that exist, by id."""
        wanted = sorted(set(run_ids))
        if not wanted:
            return {}

        async def read() -> dict[RunId, Run]:
            async with self._db.connect() as conn:
                return await _select_runs_txn(conn, wanted)

        return await self._db.with_retry(read)

    async def find_by_idempotency_key(self, tenant_id: TenantId, key: str) -> Run | None:
        """The tenant's run stored under idempotency ``key``, or None."""
        stmt = select(runs).where(runs.c.tenant_id == tenant_id, runs.c.idempotency_key == key)

        async def read() -> Run | None:
            async with self._db.connect() as conn:
                row = (await conn.execute(stmt)).mappings().first()
            return None if row is None else run_from_row(row)

        return await self._db.with_retry(read)


def _row_of(new: NewRun) -> dict[str, Any]:
    """The ``runs`` columns of ``new`` that do not depend on the transaction, plus its delay."""
    return {
        "id": new.run_id if new.run_id is not None else str(uuid.uuid4()),
        "tenant_id": new.tenant_id,
        "workflow": new.workflow,
        "lane": new.lane,
        "priority": new.priority,
        "attempt": 0,
        "max_attempts": new.max_attempts,
        "idempotency_key": new.idempotency_key,
        "input_hash": hash_input(new.input),
        "conversation_id": new.conversation_id,
        "input": new.input,
        "timeout_s": new.timeout_s,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "delay_s": new.delay_s,
    }


def _run_of(values: dict[str, Any]) -> Run:
    """The :class:`Run` a freshly inserted row holds, from the values it was inserted with."""
    return Run(
        run_id=RunId(values["id"]),
        tenant_id=TenantId(values["tenant_id"]),
        workflow=values["workflow"],
        status=RunStatus(values["status"]),
        lane=values["lane"],
        priority=values["priority"],
        attempt=Attempt(values["attempt"]),
        max_attempts=values["max_attempts"],
        lease_owner=None,
        lease_expires_at=None,
        not_before=values["not_before"],
        idempotency_key=values["idempotency_key"],
        input_hash=values["input_hash"],
        conversation_id=values["conversation_id"],
        input=values["input"],
        output=None,
        error=None,
        timeout_s=values["timeout_s"],
        cancel_requested_at=None,
        created_at=values["created_at"],
        updated_at=values["updated_at"],
        started_at=None,
        finished_at=None,
        elapsed_time=None,
        prompt_tokens=values["prompt_tokens"],
        completion_tokens=values["completion_tokens"],
    )


def _check_unique_within(new: Sequence[NewRun], rows: Sequence[dict[str, Any]]) -> None:
    """Refuse a batch that collides with itself, before anything is written."""
    keys = [(item.tenant_id, item.idempotency_key) for item in new if item.idempotency_key]
    if len(set(keys)) != len(keys):
        twice = sorted({key for key in keys if keys.count(key) > 1})
        shown = ", ".join(repr(key) for _, key in twice)
        raise IdempotencyConflict(f"idempotency key given twice in one batch: {shown}")
    ids = [row["id"] for row in rows]
    if len(set(ids)) != len(ids):
        raise Conflict("run id given twice in one batch")


def _is_stored_as(
    stored: dict[RunId, Run], new: Sequence[NewRun], ids: Sequence[RunId]
) -> list[bool]:
    return [
        stored[run_id].tenant_id == item.tenant_id
        and stored[run_id].workflow == item.workflow
        and stored[run_id].input_hash == hash_input(item.input)
        for run_id, item in zip(ids, new, strict=True)
    ]


_FENCED = and_(
    runs.c.id == bindparam("b_id"),
    runs.c.attempt == bindparam("b_attempt"),
    runs.c.lease_owner == bindparam("b_owner"),
    runs.c.status == RunStatus.RUNNING.value,
)
_CLEARED = {"lease_owner": None, "lease_expires_at": None}


def _succeeded_statement(now: datetime) -> Update:
    return (
        update(runs)
        .where(_FENCED)
        .values(
            **_CLEARED,
            updated_at=now,
            status=RunStatus.SUCCEEDED.value,
            output=bindparam("b_output", type_=runs.c.output.type),
            error=null(),
            finished_at=now,
            elapsed_time=bindparam("b_elapsed"),
        )
    )


def _retrying_statement(now: datetime) -> Update:
    return (
        update(runs)
        .where(_FENCED)
        .values(
            **_CLEARED,
            updated_at=now,
            status=_QUEUED,
            not_before=bindparam("b_not_before", type_=runs.c.not_before.type),
            error=bindparam("b_error", type_=runs.c.error.type),
        )
    )


def _failed_statement(now: datetime) -> Update:
    return (
        update(runs)
        .where(_FENCED)
        .values(
            **_CLEARED,
            updated_at=now,
            status=RunStatus.FAILED.value,
            error=bindparam("b_error", type_=runs.c.error.type),
            finished_at=now,
            elapsed_time=bindparam("b_elapsed"),
        )
    )


_FINISH_STATEMENTS: dict[str, Callable[[datetime], Update]] = {
    EVENT_SUCCEEDED: _succeeded_statement,
    EVENT_RETRYING: _retrying_statement,
    EVENT_FAILED: _failed_statement,
}


def _finish_params(
    outcome: Outcome, now: datetime, started_at: datetime
) -> tuple[str, dict[str, Any], tuple[str, JSONObject]]:
    """Which statement an applied ``outcome`` uses, its parameters, and its event."""
    fence = outcome.fence
    params: dict[str, Any] = {
        "b_id": fence.run_id,
        "b_attempt": fence.attempt,
        "b_owner": fence.owner,
    }
    elapsed_s = max(0.0, (now - started_at).total_seconds())
    if isinstance(outcome, Succeeded):
        params.update(b_output=outcome.output, b_elapsed=elapsed_s)
        return EVENT_SUCCEEDED, params, (EVENT_SUCCEEDED, {})
    if outcome.retry_delay_s is not None:
        delay_s = max(0.0, outcome.retry_delay_s)
        params.update(b_not_before=now + timedelta(seconds=delay_s), b_error=outcome.error)
        return (
            EVENT_RETRYING,
            params,
            (EVENT_RETRYING, {"delay_s": delay_s, "error": outcome.error}),
        )
    params.update(b_error=outcome.error, b_elapsed=elapsed_s)
    return EVENT_FAILED, params, (EVENT_FAILED, outcome.error)


async def _db_now_txn(conn: AsyncConnection, dialect: DialectName) -> datetime:
    """The database's current time, read once for a transaction's writes."""
    now: datetime = (await conn.execute(select(db_now(dialect)))).scalar_one()
    return now


async def _select_runs_txn(conn: AsyncConnection, run_ids: Sequence[str]) -> dict[RunId, Run]:
    found: dict[RunId, Run] = {}
    for offset in range(0, len(run_ids), _IN_CHUNK):
        chunk = list(run_ids[offset : offset + _IN_CHUNK])
        rows = await conn.execute(select(runs).where(runs.c.id.in_(chunk)))
        for row in rows.mappings():
            run = run_from_row(row)
            found[run.run_id] = run
    return found


async def _taken_keys_txn(
    conn: AsyncConnection, keys: Sequence[tuple[TenantId, str | None]]
) -> set[tuple[str, str]]:
    """Those of ``keys`` (tenant, idempotency key) some stored run already holds."""
    taken: set[tuple[str, str]] = set()
    for tenant_id in sorted({tenant_id for tenant_id, _ in keys}):
        mine = sorted({key for owner, key in keys if owner == tenant_id and key is not None})
        for offset in range(0, len(mine), _IN_CHUNK):
            stmt = select(runs.c.tenant_id, runs.c.idempotency_key).where(
                runs.c.tenant_id == tenant_id,
                runs.c.idempotency_key.in_(mine[offset : offset + _IN_CHUNK]),
            )
            taken.update((row.tenant_id, row.idempotency_key) for row in await conn.execute(stmt))
    return taken
