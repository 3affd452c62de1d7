"""Bulk jobs: a cancel or a retry of many runs, durable, processed in batches, each run once.

A job is created with the runs it acts on fixed (:meth:`BulkJobsRepo.create`): one ``INSERT
… SELECT`` copies the ids of the runs its filters match into ``bulk_job_runs``, in the
transaction that stores the job, so ``total`` is known at once and runs created later are never
touched. A request sent twice with the same idempotency key finds the first one's job.

A processor (:mod:`moorline.dispatch.bulk`) then works through the job
(:meth:`BulkJobsRepo.process_batch`): each batch is one transaction that locks the job's row,
takes the next runs without an outcome, acts on them (retry: :func:`retry_runs_txn`; cancel:
:func:`cancel_locked_txn`) and writes their outcomes and the job's counters. The action and its
record commit together or not at all, so a processor killed mid-batch leaves those runs to the
next one, and a run with an outcome is never acted on again: each run is acted on once, however
many processors believe they lead and however often they die.
"""

import builtins
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import ColumnElement, func, insert, literal, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.backends import Backend
from moorline.db.manager import DatabaseManager
from moorline.db.repos.listing import RunFilter, filter_conditions
from moorline.db.repos.records import Run, run_from_row
from moorline.db.repos.run_reads import IN_CHUNK, db_now_txn
from moorline.db.repos.run_retries import RETRYABLE, retry_runs_txn
from moorline.db.repos.run_transitions import cancel_locked_txn
from moorline.db.schema import bulk_job_runs, bulk_jobs, runs
from moorline.errors import (
    BulkJobNotFound,
    IdempotencyConflict,
    MoorlineError,
    RunFinished,
    RunNotFound,
    TooManyRuns,
)
from moorline.types import TERMINAL_STATUSES, JSONObject, RunId, TenantId

MAX_BULK_RUNS = 100_000
"""The most runs one bulk request may act on: its filters must match no more."""

ADMIN_SCOPE = "(admin)"
"""The scope of the admin token's jobs (a tenant's jobs are scoped by its id)."""


class BulkAction(StrEnum):
    """What a bulk job does to each of its runs (persisted, contract)."""

    CANCEL = "cancel"
    RETRY = "retry"


class BulkState(StrEnum):
    """Where a bulk job is (persisted, contract)."""

    RUNNING = "running"
    FINISHED = "finished"


DONE = "done"
FAILED = "failed"
"""A run's outcome in its job: acted on, or not (with the error code why)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BulkJob:
    """A bulk job and its progress: ``done + failed`` of ``total`` runs have an outcome."""

    job_id: str
    scope: str
    action: BulkAction
    filters: JSONObject
    state: BulkState
    total: int
    done: int
    failed: int
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Batch:
    """What one batch did, for the processor's work after the commit.

    Attributes:
        job: The job after the batch.
        acted: The runs acted on: retried (``queued``) or cancelled (``cancelled``, or
            ``running`` with the cancel requested).
    """

    job: BulkJob
    acted: builtins.list[Run] = field(default_factory=list)


def _job_from_row(row: Any) -> BulkJob:
    return BulkJob(
        job_id=row["id"],
        scope=row["scope"],
        action=BulkAction(row["action"]),
        filters=row["filters"],
        state=BulkState(row["state"]),
        total=row["total"],
        done=row["done"],
        failed=row["failed"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        finished_at=row["finished_at"],
    )


def eligible(action: BulkAction) -> ColumnElement[bool]:
    """The statuses ``action`` takes a run out of: a job's runs are those among its matches."""
    if action is BulkAction.RETRY:
        return runs.c.status.in_([status.value for status in RETRYABLE])
    return runs.c.status.not_in([status.value for status in TERMINAL_STATUSES])


class BulkJobsRepo:
    """Stores bulk jobs, reports their progress, and acts on their runs batch by batch."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db
        self._backend: Backend = db.backend

    async def create(
        self,
        *,
        scope: str,
        action: BulkAction,
        where: RunFilter,
        filters: JSONObject,
        tenant_id: TenantId | None,
        idempotency_key: str | None = None,
        max_runs: int = MAX_BULK_RUNS,
    ) -> tuple[BulkJob, bool]:
        """Store a job over the runs ``where`` matches now (those ``action`` applies to).

        Args:
            scope: The tenant's id, or :data:`ADMIN_SCOPE`.
            action: What to do to each run.
            where: Which runs.
            filters: ``where`` as asked, kept for display.
            tenant_id: Only this tenant's runs; None for every tenant's (the admin).
            idempotency_key: A request repeated with it finds the first one's job.
            max_runs: The most runs the job may act on.

        Returns:
            The job, and whether it is new (False: the earlier job of the same key).

        Raises:
            TooManyRuns: More than ``max_runs`` runs match; nothing was stored.
            IdempotencyConflict: The key was used for another action or other filters.
        """
        if idempotency_key is not None:
            earlier = await self._earlier(scope, idempotency_key, action, filters)
            if earlier is not None:
                return earlier, False
        conditions = [eligible(action), *filter_conditions(where)]
        if tenant_id is not None:
            conditions.append(runs.c.tenant_id == tenant_id)
        job_id = str(uuid.uuid4())
        too_many = TooManyRuns(
            f"the filters match more than {max_runs} runs; one request acts on at most that "
            "many: narrow the filters (created range, workflow, ids)"
        )

        async def write() -> BulkJob:
            async with self._db.write_transaction() as conn:
                stored = select(bulk_jobs.c.id).where(bulk_jobs.c.id == job_id)
                if (await conn.execute(stored)).first() is not None:
                    # Our first try committed unanswered (the id is fixed above).
                    return await self._read_txn(conn, job_id)
                # Counted first, so that a request over the bound copies nothing; checked
                # again on the copy, which a READ COMMITTED statement may see grown.
                matched = select(runs.c.id).where(*conditions).limit(max_runs + 1).subquery()
                count = (await conn.execute(select(func.count()).select_from(matched))).scalar()
                if int(count or 0) > max_runs:
                    raise too_many

                now = await db_now_txn(conn, self._backend)
                await conn.execute(
                    insert(bulk_jobs).values(
                        id=job_id,
                        scope=scope,
                        action=action.value,
                        filters=filters,
                        idempotency_key=idempotency_key,
                        state=BulkState.RUNNING.value,
                        total=0,
                        done=0,
                        failed=0,
                        created_at=now,
                        updated_at=now,
                    )
                )
                chosen = select(literal(job_id), runs.c.id).where(*conditions)
                copied = await conn.execute(
                    insert(bulk_job_runs).from_select(["job_id", "run_id"], chosen)
                )
                total = int(copied.rowcount)
                if total > max_runs:
                    raise too_many
                state = BulkState.RUNNING if total else BulkState.FINISHED
                await conn.execute(
                    update(bulk_jobs)
                    .where(bulk_jobs.c.id == job_id)
                    .values(
                        total=total,
                        state=state.value,
                        finished_at=None if total else now,
                    )
                )
                return await self._read_txn(conn, job_id)

        try:
            return await self._db.with_retry(write), True
        except IntegrityError:
            if idempotency_key is None:  # pragma: no cover - the id is a fresh uuid4
                raise
            # A concurrent request with the same key stored its job first.
            earlier = await self._earlier(scope, idempotency_key, action, filters)
            if earlier is None:  # pragma: no cover - a unique key's row is not deleted
                raise
            return earlier, False

    async def _earlier(
        self, scope: str, key: str, action: BulkAction, filters: JSONObject
    ) -> BulkJob | None:
        stmt = select(bulk_jobs).where(
            bulk_jobs.c.scope == scope, bulk_jobs.c.idempotency_key == key
        )

        async def read() -> BulkJob | None:
            async with self._db.connect() as conn:
                row = (await conn.execute(stmt)).mappings().first()
            return None if row is None else _job_from_row(row)

        earlier = await self._db.with_retry(read)
        if earlier is not None and (earlier.action, earlier.filters) != (action, filters):
            raise IdempotencyConflict(
                f"idempotency key {key!r} was used by bulk job {earlier.job_id} with another "
                "action or other filters"
            )
        return earlier

    async def get(self, job_id: str, *, scope: str | None = None) -> BulkJob:
        """The job and its progress.

        Args:
            job_id: The job.
            scope: The caller's scope (another tenant's job is not found); None for any.

        Raises:
            BulkJobNotFound: No such job (for this scope).
        """
        stmt = select(bulk_jobs).where(bulk_jobs.c.id == job_id)
        if scope is not None:
            stmt = stmt.where(bulk_jobs.c.scope == scope)

        async def read() -> BulkJob | None:
            async with self._db.connect() as conn:
                row = (await conn.execute(stmt)).mappings().first()
            return None if row is None else _job_from_row(row)

        job = await self._db.with_retry(read)
        if job is None:
            raise BulkJobNotFound(f"no bulk job {job_id!r}")
        return job

    async def unfinished(self, *, limit: int = 100) -> builtins.list[str]:
        """Ids of jobs still running, oldest first (``ix_bulk_jobs_state``)."""
        stmt = (
            select(bulk_jobs.c.id)
            .where(bulk_jobs.c.state == BulkState.RUNNING.value)
            .order_by(bulk_jobs.c.created_at, bulk_jobs.c.id)
            .limit(limit)
        )

        async def read() -> builtins.list[str]:
            async with self._db.connect() as conn:
                return [str(job_id) for job_id in (await conn.execute(stmt)).scalars()]

        return await self._db.with_retry(read)

    async def process_batch(self, job_id: str, *, size: int) -> Batch:
        """Act on the job's next ``size`` runs without an outcome, and record their outcomes.

        One transaction, holding the job's row: what is acted on is recorded in it, so a
        repeat (a retry after a lost connection, a second processor) finds those runs done.
        The job is ``finished`` once no run is left.

        Raises:
            BulkJobNotFound: No such job.
        """

        async def write() -> Batch:
            async with self._db.write_transaction() as conn:
                locked = self._backend.lock_rows(select(bulk_jobs).where(bulk_jobs.c.id == job_id))
                row = (await conn.execute(locked)).mappings().first()
                if row is None:
                    raise BulkJobNotFound(f"no bulk job {job_id!r}")
                job = _job_from_row(row)
                if job.state is not BulkState.RUNNING:
                    return Batch(job=job)
                todo = (
                    select(bulk_job_runs.c.run_id)
                    .where(bulk_job_runs.c.job_id == job_id, bulk_job_runs.c.outcome.is_(None))
                    .order_by(bulk_job_runs.c.run_id)
                    .limit(size)
                )
                ids = [RunId(run_id) for run_id in (await conn.execute(todo)).scalars()]
                if job.action is BulkAction.RETRY:
                    results = await retry_runs_txn(conn, self._backend, ids, job_id=job_id)
                else:
                    results = await _cancel_runs_txn(conn, self._backend, ids)
                await _record_txn(conn, job_id, ids, results)
                return Batch(
                    job=await self._count_txn(conn, job, results, finished=len(ids) < size),
                    acted=[result for result in results.values() if isinstance(result, Run)],
                )

        return await self._db.with_retry(write)

    async def _count_txn(
        self,
        conn: AsyncConnection,
        job: BulkJob,
        results: dict[RunId, Run | MoorlineError],
        *,
        finished: bool,
    ) -> BulkJob:
        done = sum(isinstance(result, Run) for result in results.values())
        failed = len(results) - done
        now = await db_now_txn(conn, self._backend)
        values: dict[str, Any] = {
            "done": bulk_jobs.c.done + done,
            "failed": bulk_jobs.c.failed + failed,
            "updated_at": now,
        }
        if finished:
            values.update(state=BulkState.FINISHED.value, finished_at=now)
        await conn.execute(update(bulk_jobs).where(bulk_jobs.c.id == job.job_id).values(values))
        return await self._read_txn(conn, job.job_id)

    async def _read_txn(self, conn: AsyncConnection, job_id: str) -> BulkJob:
        stmt = select(bulk_jobs).where(bulk_jobs.c.id == job_id)
        return _job_from_row((await conn.execute(stmt)).mappings().one())


async def _record_txn(
    conn: AsyncConnection,
    job_id: str,
    batch: Sequence[RunId],
    results: dict[RunId, Run | MoorlineError],
) -> None:
    """Write each run's outcome in its job: ``done``, or ``failed`` with the error code.

    ``batch`` is the batch's runs in the database's ``run_id`` order: the first of the job's
    runs without an outcome. Every statement is bounded to that range of
    ``ix_bulk_job_runs_todo``, so a batch reads its own rows only, never the job's others (an
    ``IN`` list alone let PostgreSQL, without statistics on a young table, read every row of
    the job in each batch: quadratic in the job's size).
    """
    if not batch:
        return
    in_batch = (
        bulk_job_runs.c.job_id == job_id,
        bulk_job_runs.c.outcome.is_(None),
        bulk_job_runs.c.run_id >= batch[0],
        bulk_job_runs.c.run_id <= batch[-1],
    )
    refused: dict[str, list[str]] = {}
    for run_id, result in results.items():
        if not isinstance(result, Run):
            refused.setdefault(result.code, []).append(run_id)
    for reason, ids in sorted(refused.items()):
        for offset in range(0, len(ids), IN_CHUNK):
            await conn.execute(
                update(bulk_job_runs)
                .where(*in_batch, bulk_job_runs.c.run_id.in_(ids[offset : offset + IN_CHUNK]))
                .values(outcome=FAILED, reason=reason)
            )
    # The rest of the range is what was acted on.
    await conn.execute(update(bulk_job_runs).where(*in_batch).values(outcome=DONE))


async def _cancel_runs_txn(
    conn: AsyncConnection, backend: Backend, run_ids: Sequence[RunId]
) -> dict[RunId, Run | MoorlineError]:
    """Cancel ``run_ids`` in the caller's transaction, as a tenant's cancel does each."""
    results: dict[RunId, Run | MoorlineError] = {}
    if not run_ids:
        return results
    stmt = select(runs).where(runs.c.id.in_(sorted(run_ids))).order_by(runs.c.id)
    found = [run_from_row(row) for row in (await conn.execute(backend.lock_rows(stmt))).mappings()]
    now = await db_now_txn(conn, backend)
    for run in found:
        if run.status.is_terminal:
            results[run.run_id] = RunFinished(f"run {run.run_id} already ended")
        elif run.cancel_requested_at is not None:
            results[run.run_id] = run  # requested already: it ends cancelled
        else:
            results[run.run_id] = await cancel_locked_txn(conn, backend, run, now)
    for run_id in run_ids:
        results.setdefault(run_id, RunNotFound(f"no run {run_id!r}"))
    return results
