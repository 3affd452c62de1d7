"""The run-writing side of dispatch: inserting and enqueuing runs, and finishing attempts.

Every method opens its own transaction, and every transition is one conditional statement
whose rowcount (or returned ids) is checked:

* **insert** — :meth:`RunsRepo.insert_pending` stores runs ``pending`` (admission still has to
  decide); :meth:`RunsRepo.submit_many` stores them ``queued`` with their ``queued`` events in
  the same transaction, the fast path when admission has nothing to say. A batch is all or
  nothing: on any error nothing of it is written. A run with a ``conversation_id`` is refused
  (:class:`~moorline.errors.ConversationBusy`) while its conversation has an active run
  (``pending``, ``queued`` or ``running``): the check and the insert share the transaction, and
  on PostgreSQL and MariaDB the tenant's row is locked first, so two concurrent submissions to
  one conversation are serialised and the second sees the first.
* **enqueue** — ``pending → queued`` (:meth:`RunsRepo.enqueue`) or ``pending → rate_limited``
  (:meth:`RunsRepo.mark_rate_limited`), each conditional on the run still being ``pending``, so
  two API processes deciding about one run move it once.
* **finish** — :meth:`RunsRepo.finish_many` ends attempts under their fences (run, attempt,
  owner, ``running``), several in one transaction, one UPDATE per kind of ending. A worker whose
  lease was taken over matches no row and writes nothing, not even an event. A run whose cancel
  is recorded ends ``cancelled`` whatever its attempt's outcome: the request wins over a
  success, a failure or a retry not yet written.
* **cancel** — :meth:`RunsRepo.request_cancel` records a tenant's cancel under the run's row
  lock: a run nobody executes (``pending``, ``queued``) ends ``cancelled`` in that same
  transaction; a ``running`` one keeps its lease with ``cancel_requested_at`` set, which its
  worker learns from the RuntimeStore's signal or, should that be lost, from its next
  heartbeat. From then on no step starts (``StepsRepo.start`` refuses), no claim takes the
  run, and the reaper and a shutdown release end it ``cancelled`` instead of requeueing it.

Times come from the database clock only. Inserts and finishes read it once per transaction (a
finish in the statement that locks its rows) and bind the value (rather than calling the SQL
function per row), which keeps one clock reading per batch and lets aiomysql send a batch as one
multi-row INSERT. On MariaDB an insert needs no reading: its INSERT stamps the rows and returns
the time (``RETURNING``), one round trip less per submission. On PostgreSQL a submission with
nothing to check first (no quota claim, no conversation), one run or a batch, is one statement
committed alone, which stamps the runs and their events with its own time and returns it.
"""

import functools
import hashlib
import json
import logging
import math
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, NamedTuple, TypeAlias

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Insert,
    Select,
    String,
    Update,
    and_,
    bindparam,
    case,
    func,
    insert,
    null,
    select,
    tuple_,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db import dialects
from moorline.db.dialects import DialectName, db_now, select_db_now
from moorline.db.manager import DatabaseManager
from moorline.db.repos.events import (
    EVENT_CANCELLED,
    EVENT_FAILED,
    EVENT_QUEUED,
    EVENT_RETRYING,
    EVENT_SUCCEEDED,
    EVENT_TIMED_OUT,
    append_events_txn,
    events_from_runs_statement,
    first_event_statement,
)
from moorline.db.repos.quotas import QuotaClaim, take_units_txn
from moorline.db.repos.records import Fence, Run, run_from_row
from moorline.db.schema import runs, tenants
from moorline.errors import (
    Conflict,
    ConversationBusy,
    IdempotencyConflict,
    InvalidInput,
    NotFound,
    RunFinished,
    RunNotFound,
)
from moorline.types import Attempt, JSONObject, JSONValue, RunId, RunStatus, TenantId

logger = logging.getLogger(__name__)

DEFAULT_MAX_ATTEMPTS = 3

_PENDING = RunStatus.PENDING.value
_QUEUED = RunStatus.QUEUED.value
_ACTIVE = (_PENDING, _QUEUED, RunStatus.RUNNING.value)
"""Statuses of a run that holds its conversation."""

# Ids per IN list; far below every backend's bound-parameter limit (asyncpg: 32,767).
_IN_CHUNK = 1000

_INSERT_RUNS = insert(runs)
"""One statement object for every batch: SQLAlchemy derives its cache key once."""

_MICROSECOND = timedelta(microseconds=1)

_SUBMITTED = (
    "id",
    "tenant_id",
    "workflow",
    "lane",
    "priority",
    "attempt",
    "max_attempts",
    "idempotency_key",
    "input_hash",
    "conversation_id",
    "input",
    "timeout_s",
    "prompt_tokens",
    "completion_tokens",
)
"""The columns :meth:`RunsRepo._submit_in_one_statement` binds per run (``_row_of``'s)."""


@functools.cache
def _submit_statement(dialect: DialectName) -> Insert:
    """Runs (the ``runs`` parameter: one dict per run) and their first events, in one statement.

    ``WITH submitted AS (INSERT INTO runs … SELECT … FROM <the runs parameter> RETURNING …)
    INSERT INTO events … SELECT … FROM submitted RETURNING run_id, created_at``. Every run is
    stamped with the transaction's time and each ``not_before`` is that plus the run's
    ``delay_us``; ``status``, ``type`` and ``data`` are one parameter each for the batch.
    """
    start = dialects.transaction_time(dialect)
    columns = {**{name: runs.c[name].type for name in _SUBMITTED}, "delay_us": BigInteger()}
    source = dialects.rows_parameter(dialect, "runs", columns)
    if start is None or source is None:  # pragma: no cover - the caller checks
        raise ValueError(f"{dialect} has no transaction time")
    chosen = select(
        *(source.c[name] for name in _SUBMITTED),
        bindparam("status", type_=runs.c.status.type),
        start,
        start,
        dialects.microseconds_after(start, source.c.delay_us),
    )
    names = [*_SUBMITTED, "status", "created_at", "updated_at", "not_before"]
    submitted = (
        insert(runs)
        .from_select(names, chosen)
        .returning(runs.c.id, runs.c.attempt, runs.c.updated_at)
        .cte("submitted")
    )
    return first_event_statement(submitted)


@functools.cache
def _stamped_insert_statement(
    times: tuple[ColumnElement[datetime], ColumnElement[datetime]],
) -> Insert:
    """Runs stamped with the statement's database time (``times``), returning it per run."""
    start, later = times
    return (
        insert(runs)
        .values(created_at=start, updated_at=start, not_before=later)
        .returning(runs.c.id, runs.c.created_at)
    )


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


@dataclass(frozen=True, slots=True, kw_only=True)
class Stopped:
    """The attempt under ``fence`` was stopped from outside: the run ends ``status``, for good.

    Attributes:
        fence: The attempt's fence.
        status: ``cancelled`` (the run's cancel was seen) or ``timed_out`` (the attempt ran
            past its hard time limit).
        error: What stopped it, kept as the run's ``error`` and as the event's data, e.g.
            ``{"type": "TimeLimitExceeded", "message": "…", "reason": "timeout"}``; None for
            a cancel (its event is ``{"reason": "cancelled"}``, as the reaper writes it).
    """

    fence: Fence
    status: RunStatus
    error: JSONObject | None = None

    def __post_init__(self) -> None:
        if self.status not in _STOPPED_STATUSES:
            raise ValueError(f"a stopped attempt ends cancelled or timed_out, not {self.status}")


_STOPPED_STATUSES = frozenset({RunStatus.CANCELLED, RunStatus.TIMED_OUT})

Outcome: TypeAlias = Succeeded | Failed | Stopped


class _Held(NamedTuple):
    """A running run as ``finish_many`` found it under its row lock."""

    attempt: int
    owner: str | None
    started_at: datetime
    is_cancel_requested: bool

    def is_held_by(self, fence: Fence) -> bool:
        return (self.attempt, self.owner) == (fence.attempt, fence.owner)


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
            ConversationBusy: a run's conversation has an active run (or two runs of the
                batch share one); nothing was written.
            NotFound: a run names a tenant that does not exist; nothing was written.
            Conflict: a ``run_id`` given is already taken; nothing was written.
            InvalidInput: an input is not JSON; nothing was written.
        """
        return await self._insert(new, RunStatus.PENDING)

    async def submit_many(
        self, new: Sequence[NewRun], *, quotas: Sequence[QuotaClaim | None] | None = None
    ) -> list[Run]:
        """Store ``new`` as ``queued`` runs with one ``queued`` event each, in one transaction.

        The same as :meth:`insert_pending` followed by :meth:`enqueue`, in one transaction; the
        rows are inserted ``queued`` directly, since nothing can see them ``pending`` anyway.

        With ``quotas``, a run with a :class:`~moorline.db.repos.quotas.QuotaClaim` is queued
        only if it gets a unit of its tenant's daily quota, taken in the same transaction
        (:func:`~moorline.db.repos.quotas.take_units_txn`; the batch's runs in the order
        given); one that gets none is stored ``rate_limited`` with the claim's ``refusal`` as
        its error, without its idempotency key and without events, as
        :meth:`insert_rate_limited` stores it. Units and runs commit together: a batch that
        fails takes no unit.

        Args:
            new: The runs to store.
            quotas: One claim (or None: no quota to take) per run of ``new``, in its order.

        Returns:
            The runs as stored (``queued``, or ``rate_limited`` when refused by the quota), in
            the order given.

        Raises:
            IdempotencyConflict: as for :meth:`insert_pending`; nothing was written.
            ConversationBusy: as for :meth:`insert_pending`; nothing was written.
            NotFound: as for :meth:`insert_pending`; nothing was written.
            Conflict: as for :meth:`insert_pending`; nothing was written.
            InvalidInput: as for :meth:`insert_pending`; nothing was written.
        """
        if quotas is not None and len(quotas) != len(new):
            raise ValueError(f"{len(quotas)} quota claims for {len(new)} runs")
        return await self._insert(new, RunStatus.QUEUED, quotas)

    async def _insert(
        self,
        new: Sequence[NewRun],
        status: RunStatus,
        quotas: Sequence[QuotaClaim | None] | None = None,
    ) -> list[Run]:
        if not new:
            return []
        rows = [_row_of(item) for item in new]
        _check_unique_within(new, rows)
        ids = [RunId(row["id"]) for row in rows]
        claims = {} if quotas is None else _claims_by_run(ids, new, quotas)
        tries = 0
        # Runs with nothing to check first (no quota, no conversation) on a backend with a
        # transaction time: one statement, committed alone (see _submit_in_one_statement).
        is_one_statement = (
            not claims
            and status is RunStatus.QUEUED
            and all(row["conversation_id"] is None for row in rows)
            and dialects.transaction_time(self._dialect) is not None
        )

        async def write() -> list[Run]:
            nonlocal tries
            tries += 1
            try:
                if is_one_statement:
                    return await self._submit_in_one_statement(rows)
                async with self._db.write_transaction() as conn:
                    return await self._insert_txn(conn, rows, status, claims)
            except IntegrityError as exc:
                # The transaction is rolled back; find out which rule the batch broke.
                return await self._explain(exc, new, ids, is_retry=tries > 1)

        # Retried on a lost connection: the run ids are fixed above, so a retry after a commit
        # whose acknowledgement was lost finds them stored (see _explain) and stores nothing twice
        # (its units are rolled back with its failed insert).
        return await self._db.with_retry(write)

    async def _insert_txn(
        self,
        conn: AsyncConnection,
        rows: Sequence[dict[str, Any]],
        status: RunStatus,
        claims: dict[str, tuple[TenantId, QuotaClaim]],
    ) -> list[Run]:
        refusals, now = await self._take_units_txn(conn, claims)
        admitted = [row for row in rows if row["id"] not in refusals]
        await self._check_conversations_txn(conn, admitted)
        if now is None:
            times = dialects.statement_time(conn.dialect)
            if times is not None and not refusals:
                return await self._insert_stamped_txn(conn, rows, status, times)
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
            for row in sorted(admitted, key=lambda row: (row["tenant_id"], row["id"]))
        ]
        refused = [
            _refused_values(row, refusals[row["id"]], now)
            for row in sorted(rows, key=lambda row: (row["tenant_id"], row["id"]))
            if row["id"] in refusals
        ]
        # Two statements when both kinds are there: one executemany needs one set of columns.
        for values in (params, refused):
            if values:
                await conn.execute(_INSERT_RUNS, values)
        queued_ids = [RunId(row["id"]) for row in admitted]
        if status is RunStatus.QUEUED and queued_ids:
            queued: list[_EventItem] = [
                (run_id, Attempt(0), EVENT_QUEUED, {}) for run_id in queued_ids
            ]
            await append_events_txn(conn, self._dialect, queued, now=now, new_runs=True)
        # Every column is known here (the times are the database time read above), so the runs
        # are built rather than read back: one round trip less per batch. The contract tests
        # check they equal what a read returns on every backend.
        by_id = {param["id"]: _run_of(param) for param in params}
        by_id.update((values["id"], _refused_run(values)) for values in refused)
        return [by_id[row["id"]] for row in rows]

    async def _insert_stamped_txn(
        self,
        conn: AsyncConnection,
        rows: Sequence[dict[str, Any]],
        status: RunStatus,
        times: tuple[ColumnElement[datetime], ColumnElement[datetime]],
    ) -> list[Run]:
        """Insert ``rows`` stamped with the database's time by the INSERT itself (MariaDB).

        The INSERT returns each row's time (:func:`~moorline.db.dialects.statement_time`), and
        the ``queued`` events copy theirs from the rows (``INSERT … SELECT``): the time is
        never read in a statement of its own, a round trip less on the way to a worker.
        ``not_before`` is that time plus the delay in whole microseconds, added the same way
        here, so the runs built below equal what a read returns.
        """
        params = [
            {
                **{key: value for key, value in row.items() if key != "delay_s"},
                "status": status.value,
                "delay_us": timedelta(seconds=row["delay_s"]) // _MICROSECOND,
            }
            # In tenant order, as in _insert_txn.
            for row in sorted(rows, key=lambda row: (row["tenant_id"], row["id"]))
        ]
        stored = await conn.execute(_stamped_insert_statement(times), params)
        stamped: dict[str, datetime] = {row.id: row.created_at for row in stored}
        if status is RunStatus.QUEUED:
            ids = [row["id"] for row in rows]
            event = {"ids": ids, "type": EVENT_QUEUED, "data": {}}
            await self._db.commit_with_next_statement(conn)
            await conn.execute(events_from_runs_statement(), event)
        by_id: dict[str, Run] = {}
        for param in params:
            at = stamped[param["id"]]
            delay = timedelta(microseconds=param.pop("delay_us"))
            values = {**param, "not_before": at + delay, "created_at": at, "updated_at": at}
            by_id[param["id"]] = _run_of(values)
        return [by_id[row["id"]] for row in rows]

    async def _submit_in_one_statement(self, rows: Sequence[dict[str, Any]]) -> list[Run]:
        """Store ``queued`` runs and their ``queued`` events with one statement, in autocommit.

        A data-modifying CTE (PostgreSQL) over the runs bound as one parameter
        (:func:`~moorline.db.dialects.rows_parameter`): the runs' INSERT returns what their
        events need, and the events' INSERT returns the time the runs were stored at, the
        database's (the statement's start: :func:`~moorline.db.dialects.transaction_time`), so
        no ``SELECT`` of the time goes first. One round trip where a transaction takes five
        (BEGIN, the time, two INSERTs, COMMIT), whatever the number of runs; as atomic, one
        statement being one transaction. This is how the Submitter's batches arrive, one run
        when it is idle, a few under load. ``not_before`` is that time plus the delay in whole
        microseconds, added the same way here, so the runs built below equal what a read
        returns.
        """
        delays = [timedelta(seconds=row["delay_s"]) for row in rows]
        bound = [
            {**{name: row[name] for name in _SUBMITTED}, "delay_us": delay // _MICROSECOND}
            for row, delay in zip(rows, delays, strict=True)
        ]
        params = {"runs": bound, "status": _QUEUED, "type": EVENT_QUEUED, "data": {}}
        stored = await self._db.write_statement_rows(_submit_statement(self._dialect), params)
        stamped: dict[str, datetime] = {row.run_id: row.created_at for row in stored}
        made: list[Run] = []
        for row, delay in zip(rows, delays, strict=True):
            at = stamped[row["id"]]
            values = {**row, "status": _QUEUED, "not_before": at + delay}
            made.append(_run_of({**values, "created_at": at, "updated_at": at}))
        return made

    async def _take_units_txn(
        self, conn: AsyncConnection, claims: dict[str, tuple[TenantId, QuotaClaim]]
    ) -> tuple[dict[str, JSONObject], datetime | None]:
        """Take the claimed quota units.

        Returns:
            The refusal of each run that got no unit, by run id; and the database's time if a
            quota statement read it (one statement less for the batch).
        """
        groups: dict[tuple[TenantId, str, int], list[str]] = {}
        for run_id, (tenant_id, claim) in claims.items():
            groups.setdefault((tenant_id, claim.day, claim.limit), []).append(run_id)
        refusals: dict[str, JSONObject] = {}
        now: datetime | None = None
        # In (tenant, day) order, so two batches lock the counters they share in one order.
        for (tenant_id, day, limit), run_ids in sorted(groups.items()):
            taken = await take_units_txn(
                conn, self._dialect, tenant_id, day, limit=limit, wanted=len(run_ids)
            )
            now = now or taken.now
            for run_id in run_ids[taken.units :]:
                refusals[run_id] = claims[run_id][1].refusal
        return refusals, now

    async def _check_conversations_txn(
        self, conn: AsyncConnection, rows: Sequence[dict[str, Any]]
    ) -> None:
        """Refuse the batch when a run's conversation has an active run (see the module doc).

        The batch's own ids are left out of the search: a batch retried after a lost commit
        acknowledgement finds its own runs, and :meth:`_explain` recognises them.
        """
        wanted = [
            (row["tenant_id"], row["conversation_id"], row["id"])
            for row in rows
            if row["conversation_id"] is not None
        ]
        if not wanted:
            return
        claimed: dict[tuple[str, str], str] = {}
        for tenant_id, conversation_id, run_id in wanted:
            earlier = claimed.setdefault((tenant_id, conversation_id), run_id)
            if earlier != run_id:
                raise ConversationBusy(conversation_id, earlier)
        if dialects.uses_row_locks(self._dialect):
            # In id order, like claims, so the two never wait on each other in a cycle.
            tenant_ids = sorted({tenant_id for tenant_id, _, _ in wanted})
            lock = select(tenants.c.id).where(tenants.c.id.in_(tenant_ids)).order_by(tenants.c.id)
            await conn.execute(dialects.lock_rows(lock, self._dialect))
        pairs = sorted(claimed)
        own_ids = [row["id"] for row in rows]
        for offset in range(0, len(pairs), _IN_CHUNK):
            active = (
                select(runs.c.id, runs.c.conversation_id)
                .where(
                    tuple_(runs.c.tenant_id, runs.c.conversation_id).in_(
                        pairs[offset : offset + _IN_CHUNK]
                    ),
                    runs.c.status.in_(_ACTIVE),
                    runs.c.id.not_in(own_ids),
                )
                .order_by(runs.c.created_at, runs.c.id)
                .limit(1)
            )
            found = (await conn.execute(active)).first()
            if found is not None:
                raise ConversationBusy(found.conversation_id, found.id)

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

    async def insert_rate_limited(self, new: NewRun, error: JSONObject) -> Run:
        """Store ``new`` as refused by admission: ``rate_limited`` (terminal), with ``error``.

        The same outcome as :meth:`insert_pending` followed by :meth:`mark_rate_limited`, in
        one statement, so a crash in between cannot leave a ``pending`` run that nothing
        will ever move. No event is written: the run never started.

        Returns:
            The run as stored.

        Raises:
            IdempotencyConflict: the run's idempotency key is taken; nothing was written.
            NotFound: the tenant does not exist; nothing was written.
            Conflict: the run id is taken; nothing was written.
            InvalidInput: the input is not JSON; nothing was written.
        """
        row = _row_of(new)
        del row["delay_s"]  # a refused run is never claimed
        run_id = RunId(row["id"])
        tries = 0

        async def write() -> Run:
            nonlocal tries
            tries += 1
            try:
                async with self._db.write_transaction() as conn:
                    now = await _db_now_txn(conn, self._dialect)
                    values = {
                        **row,
                        "status": RunStatus.RATE_LIMITED.value,
                        "error": error,
                        "not_before": now,
                        "created_at": now,
                        "updated_at": now,
                        "finished_at": now,
                    }
                    await conn.execute(insert(runs).values(values))
            except IntegrityError as exc:
                [run] = await self._explain(exc, [new], [run_id], is_retry=tries > 1)
                return run
            return replace(_run_of(values), error=error, finished_at=now)

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

        The runs' rows are locked first (with the database time read beside them), and an
        outcome applies only when its fence holds on its row. The applied outcomes of one
        kind are written by one UPDATE carrying every one of their fences, its rowcount
        checked, and their events by one ``INSERT … SELECT`` (``retrying``: one multi-row
        INSERT); an outcome that did not apply writes nothing:

        * :class:`Succeeded` → ``succeeded`` with ``output`` (``error`` cleared), event
          ``succeeded``;
        * :class:`Failed` with ``retry_delay_s`` → ``queued``, claimable from database time +
          the delay, ``error`` kept, ``attempt`` unchanged (the next claim increments it),
          event ``retrying`` ``{"delay_s", "error"}``;
        * :class:`Failed` without → ``failed`` with ``error``, event ``failed`` (data: the
          error);
        * :class:`Stopped` → ``cancelled`` (event ``cancelled`` ``{"reason": "cancelled"}``,
          ``cancel_requested_at`` set if the cancel came through the RuntimeStore only) or
          ``timed_out`` with ``error`` (event ``timed_out``, data: the error).

        Any outcome of a run whose cancel is recorded (``cancel_requested_at``, read under the
        row lock) is written as a cancel: a requested cancel always ends the run
        ``cancelled``, never ``queued`` again, and never as a success or failure that raced it.

        Every applied outcome clears the lease; the terminal ones set ``finished_at`` and
        ``elapsed_time`` (seconds from the first ``started_at``), from database time.

        A batch retried after a lost connection reports False for outcomes its first try had
        already committed (their fences no longer match); the runs are finished all the same.

        Returns:
            Per outcome, in the order given, whether it applied; False when the fence no
            longer holds (the run was reclaimed, cancelled, finished, or never ours), also
            when an earlier outcome of the same batch ended the run.
        """
        if not outcomes:
            return []

        async def write() -> list[bool]:
            applied = [False] * len(outcomes)
            async with self._db.write_transaction() as conn:
                running, now = await self._lock_running_txn(conn, outcomes)
                if not running:
                    return applied
                groups: dict[str, list[_Finish]] = {}
                for index, outcome in enumerate(outcomes):
                    fence = outcome.fence
                    held = running.get(fence.run_id)
                    if held is None or not held.is_held_by(fence):
                        # The fence does not hold: the run was reclaimed, finished, or ended
                        # by an earlier outcome of this batch (a stale attempt and the current
                        # one of the same run may come together).
                        continue
                    del running[fence.run_id]
                    if held.is_cancel_requested:
                        outcome = Stopped(fence=fence, status=RunStatus.CANCELLED)
                    finish = _finish_of(outcome, now, held.started_at)
                    groups.setdefault(finish.kind, []).append(finish)
                    applied[index] = True
                chunks = [
                    (kind, group[offset : offset + _FINISH_CHUNK])
                    for kind, group in groups.items()
                    for offset in range(0, len(group), _FINISH_CHUNK)
                ]
                for index, (kind, chunk) in enumerate(chunks):
                    is_last = index == len(chunks) - 1
                    await self._finish_group_txn(conn, kind, chunk, now, is_last=is_last)
            return applied

        return await self._db.with_retry(write)

    async def _finish_group_txn(
        self,
        conn: AsyncConnection,
        kind: str,
        group: Sequence["_Finish"],
        now: datetime,
        *,
        is_last: bool,
    ) -> None:
        """End ``group`` (outcomes of one kind) with one UPDATE, then append their events.

        The UPDATE carries every fence and its rowcount is checked; the rows are locked (or,
        on SQLite, the whole database is), so every fence found holding still holds here.
        ``is_last``: the transaction ends after this group, so an events statement executed
        once may carry its commit (``DatabaseManager.commit_with_next_statement``).
        """
        stmt, params = _finish_statement(kind, group, now)
        result = await conn.execute(stmt, params)
        if result.rowcount != len(group):  # pragma: no cover - would be a locking bug
            raise AssertionError(f"finish {kind}: {result.rowcount} of {len(group)} locked runs")
        from_error = kind in _EVENT_DATA_IS_ERROR
        if from_error or kind in _EVENT_DATA:
            # The event's data is the same for every run of the group, or is the error the
            # UPDATE just stored: one INSERT … SELECT reads each run's next seq itself.
            ids = [finish.fence.run_id for finish in group]
            params = {"ids": ids, "type": kind, "data": _EVENT_DATA.get(kind)}
            if is_last:
                await self._db.commit_with_next_statement(conn)
            await conn.execute(events_from_runs_statement(data_from_error=from_error), params)
            return
        items = [(f.fence.run_id, f.fence.attempt, kind, f.event_data) for f in group]
        await append_events_txn(conn, self._dialect, items, now=now)

    async def _lock_running_txn(
        self, conn: AsyncConnection, outcomes: Sequence[Outcome]
    ) -> tuple[dict[str, _Held], datetime]:
        """Lock the outcomes' runs; the ones still running, and the time to finish them at.

        Server databases lock the rows (``FOR UPDATE``, in id order so two batches never
        deadlock) and read their latest committed version after any wait; SQLite's ``BEGIN
        IMMEDIATE`` already holds the only write lock. Either way a fence found holding on
        these rows cannot be broken before this transaction commits. Each outcome's fence is
        compared by the caller: two outcomes of one run may carry different fences.

        The database time comes with the rows, saving a round trip; on a server it may be
        read before a wait for a row lock, which only makes the finish look that much
        earlier.
        """
        run_ids = sorted({outcome.fence.run_id for outcome in outcomes})
        running: dict[str, _Held] = {}
        now: datetime | None = None
        for offset in range(0, len(run_ids), _IN_CHUNK):
            chunk = run_ids[offset : offset + _IN_CHUNK]
            for row in await conn.execute(_lock_running_statement(self._dialect), {"ids": chunk}):
                now = row.db_now if now is None else min(now, row.db_now)
                running[row.id] = _Held(
                    row.attempt,
                    row.lease_owner,
                    row.started_at,
                    row.cancel_requested_at is not None,
                )
        if now is None:
            now = await _db_now_txn(conn, self._dialect)
        return running, now

    # --- cancel -----------------------------------------------------------------------------

    async def request_cancel(self, tenant_id: TenantId, run_id: RunId) -> Run:
        """Record the tenant's request to cancel ``run_id``, in one transaction.

        The run's row is locked first and the database time read only then, so
        ``cancel_requested_at`` is later than every step start that committed before it, and
        every later step start sees the request (see ``StepsRepo.start``):

        * ``pending`` or ``queued`` → ``cancelled`` at once (``finished_at`` set, event
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
                locked = dialects.lock_rows(mine, self._dialect)
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
                now = await _db_now_txn(conn, self._dialect)
                return await self._cancel_txn(conn, run, now)

        return await self._db.with_retry(write)

    async def _cancel_txn(self, conn: AsyncConnection, run: Run, now: datetime) -> Run:
        """Cancel the locked, unfinished ``run`` at ``now``: at once unless it is running."""
        if run.status is RunStatus.RUNNING:
            values: dict[str, Any] = {"cancel_requested_at": now, "updated_at": now}
            changed = replace(run, cancel_requested_at=now, updated_at=now)
        else:
            elapsed_s = None if run.started_at is None else (now - run.started_at).total_seconds()
            values = {
                **_CLEARED,
                "status": RunStatus.CANCELLED.value,
                "cancel_requested_at": now,
                "finished_at": now,
                "updated_at": now,
                "elapsed_time": None if elapsed_s is None else max(0.0, elapsed_s),
            }
            changed = replace(
                run,
                status=RunStatus.CANCELLED,
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
        if changed.status is RunStatus.CANCELLED:
            cancelled: list[_EventItem] = [
                (run.run_id, run.attempt, EVENT_CANCELLED, {"reason": "cancelled"})
            ]
            await append_events_txn(conn, self._dialect, cancelled, now=now)
        return changed

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


def _claims_by_run(
    ids: Sequence[RunId], new: Sequence[NewRun], quotas: Sequence[QuotaClaim | None]
) -> dict[str, tuple[TenantId, QuotaClaim]]:
    """Each claimed run's tenant and claim, by run id, in the batch's order."""
    return {
        run_id: (item.tenant_id, claim)
        for run_id, item, claim in zip(ids, new, quotas, strict=True)
        if claim is not None
    }


def _refused_values(row: dict[str, Any], error: JSONObject, now: datetime) -> dict[str, Any]:
    """The ``runs`` values of a run the quota refused (see :meth:`RunsRepo.submit_many`)."""
    values = {key: value for key, value in row.items() if key != "delay_s"}
    return {
        **values,
        # The key names an accepted trigger: the client may retry with it once the quota resets.
        "idempotency_key": None,
        "status": RunStatus.RATE_LIMITED.value,
        "error": error,
        "not_before": now,
        "created_at": now,
        "updated_at": now,
        "finished_at": now,
    }


def _refused_run(values: dict[str, Any]) -> Run:
    return replace(_run_of(values), error=values["error"], finished_at=values["finished_at"])


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


_CLEARED = {"lease_owner": None, "lease_expires_at": None}

_FINISH_CHUNK = 256
"""Outcomes per finish UPDATE: a few bound parameters each, far below every backend's limit."""

_EVENT_DATA: dict[str, JSONObject] = {
    EVENT_SUCCEEDED: {},
    EVENT_CANCELLED: {"reason": "cancelled"},
}
"""The event data of the kinds whose event data is the same for every run."""

_EVENT_DATA_IS_ERROR = frozenset({EVENT_FAILED, EVENT_TIMED_OUT})
"""The kinds whose event data is the error their UPDATE stores in the run's row.

Only ``retrying`` (its data carries the delay) needs per-event parameters.
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Finish:
    """One applied outcome: its fence, the kind of finish, its per-run values and event data."""

    fence: Fence
    kind: str
    values: dict[str, Any]
    """Per-run column values: ``output``, ``error``, ``elapsed_time``, ``not_before``."""
    event_data: JSONObject


_FINISH_VALUES: dict[str, dict[str, Any]] = {
    EVENT_SUCCEEDED: {"status": RunStatus.SUCCEEDED.value, "error": null()},
    EVENT_RETRYING: {"status": _QUEUED},
    EVENT_FAILED: {"status": RunStatus.FAILED.value},
    EVENT_CANCELLED: {"status": RunStatus.CANCELLED.value},
    EVENT_TIMED_OUT: {"status": RunStatus.TIMED_OUT.value},
}
"""The columns a kind sets to the same value on every run (besides the lease and times)."""

_PER_RUN: dict[str, tuple[str, ...]] = {
    EVENT_SUCCEEDED: ("output", "elapsed_time"),
    EVENT_RETRYING: ("not_before", "error"),
    EVENT_FAILED: ("error", "elapsed_time"),
    EVENT_CANCELLED: ("elapsed_time",),
    EVENT_TIMED_OUT: ("error", "elapsed_time"),
}
"""The columns a kind sets per run, from :attr:`_Finish.values`."""


def _size_class(count: int) -> int:
    """The next power of two: finish statements are built (and cached) per size class."""
    return 1 << max(0, count - 1).bit_length()


@functools.lru_cache(maxsize=64)
def _finish_update(kind: str, size: int) -> Update:
    """The UPDATE ending up to ``size`` runs the same way, each under its fence.

    The fences are one row-value ``IN`` list (``id IN`` beside it lets every backend find the
    rows by primary key); the per-run values are ``CASE id WHEN …`` over ``size`` slots, of
    which the unused ones name no run. One statement for a whole batch: MariaDB's driver sends
    an ``executemany`` of UPDATEs as one round trip per row.
    """
    ids = [bindparam(f"id_{index}", type_=String()) for index in range(size)]
    values: dict[str, Any] = {**_CLEARED, **_FINISH_VALUES[kind]}
    for column in _PER_RUN[kind]:
        whens = {
            run_id: bindparam(f"{column}_{index}", type_=runs.c[column].type)
            for index, run_id in enumerate(ids)
        }
        values[column] = case(whens, value=runs.c.id)
    values["updated_at"] = bindparam("now", type_=runs.c.updated_at.type)
    if kind != EVENT_RETRYING:
        values["finished_at"] = values["updated_at"]
    if kind == EVENT_CANCELLED:
        # Set by request_cancel; a cancel signalled through the RuntimeStore alone is dated
        # here, so every cancelled run has the time its cancel was recorded.
        values["cancel_requested_at"] = func.coalesce(
            runs.c.cancel_requested_at, values["updated_at"]
        )
    fenced = and_(
        runs.c.id.in_(bindparam("fence_ids", expanding=True)),
        tuple_(runs.c.id, runs.c.attempt, runs.c.lease_owner).in_(
            bindparam("fences", expanding=True)
        ),
        runs.c.status == RunStatus.RUNNING.value,
    )
    return update(runs).where(fenced).values(**values)


def _finish_statement(
    kind: str, group: Sequence[_Finish], now: datetime
) -> tuple[Update, dict[str, Any]]:
    """The UPDATE ending ``group`` (one kind) at ``now``, and its parameters."""
    size = _size_class(len(group))
    params: dict[str, Any] = {
        "now": now,
        "fence_ids": [f.fence.run_id for f in group],
        "fences": [(f.fence.run_id, f.fence.attempt, f.fence.owner) for f in group],
    }
    columns = _PER_RUN[kind]
    for index in range(size):
        finish = group[index] if index < len(group) else None
        # An unused slot names no run (NULL never equals an id) and sets nothing.
        params[f"id_{index}"] = None if finish is None else finish.fence.run_id
        for column in columns:
            params[f"{column}_{index}"] = None if finish is None else finish.values[column]
    return _finish_update(kind, size), params


def _finish_of(outcome: Outcome, now: datetime, started_at: datetime) -> _Finish:
    """How an applied ``outcome`` ends its run at ``now``: kind, column values, event data."""
    fence = outcome.fence
    elapsed_s = max(0.0, (now - started_at).total_seconds())
    if isinstance(outcome, Succeeded):
        values: dict[str, Any] = {"output": outcome.output, "elapsed_time": elapsed_s}
        return _Finish(fence=fence, kind=EVENT_SUCCEEDED, values=values, event_data={})
    if isinstance(outcome, Stopped):
        if outcome.status is RunStatus.CANCELLED:
            values = {"elapsed_time": elapsed_s}
            data: JSONObject = {"reason": "cancelled"}
            return _Finish(fence=fence, kind=EVENT_CANCELLED, values=values, event_data=data)
        error: JSONObject = outcome.error if outcome.error is not None else {"reason": "timeout"}
        values = {"error": error, "elapsed_time": elapsed_s}
        return _Finish(fence=fence, kind=EVENT_TIMED_OUT, values=values, event_data=error)
    if outcome.retry_delay_s is not None:
        delay_s = max(0.0, outcome.retry_delay_s)
        values = {"not_before": now + timedelta(seconds=delay_s), "error": outcome.error}
        data = {"delay_s": delay_s, "error": outcome.error}
        return _Finish(fence=fence, kind=EVENT_RETRYING, values=values, event_data=data)
    values = {"error": outcome.error, "elapsed_time": elapsed_s}
    return _Finish(fence=fence, kind=EVENT_FAILED, values=values, event_data=outcome.error)


@functools.cache
def _lock_running_statement(dialect: DialectName) -> Select[Any]:
    """The running runs among ``ids`` (locked on the servers), with the database time."""
    stmt = (
        select(
            runs.c.id,
            runs.c.attempt,
            runs.c.lease_owner,
            runs.c.started_at,
            runs.c.cancel_requested_at,
            db_now(dialect).label("db_now"),
        )
        .where(
            runs.c.id.in_(bindparam("ids", expanding=True)),
            runs.c.status == RunStatus.RUNNING.value,
        )
        .order_by(runs.c.id)
    )
    return stmt.with_for_update() if dialects.uses_row_locks(dialect) else stmt


async def _db_now_txn(conn: AsyncConnection, dialect: DialectName) -> datetime:
    """The database's current time, read once for a transaction's writes."""
    now: datetime = (await conn.execute(select_db_now(dialect))).scalar_one()
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
