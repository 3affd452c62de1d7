"""Retry: a ``failed`` or ``timed_out`` run back to ``queued``, its checkpoints kept.

A retried run is claimed like any queued run and replays from its checkpoints: the steps that
succeeded return their stored outputs without their functions being called, and the step that
failed runs again. Its attempt budget is fresh: the budget counts ``attempt - resumes`` (claims
after a resume are no failures, :mod:`~moorline.db.repos.parking`), so a retry sets
``resumes`` to the attempts already made, and the run gets ``max_attempts`` more. ``attempt``
itself keeps growing: it is the fencing token, and a worker of an earlier attempt must stay
fenced out.

One transaction retries a batch (one run for ``POST …/retry``, a bulk job's batch for
``POST /v1/runs/bulk/retry``): the runs' rows are locked, each is checked under its lock, and
those still retryable move in one conditional UPDATE with one ``retried`` event each, so two
requests racing retry a run once. A run with a conversation is checked against it first (one
active run per conversation, as at a trigger): its tenant's row is locked before the runs',
the order submissions and claims take them in.
"""

from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.backends import Backend
from moorline.db.repos.events import EVENT_RETRIED, append_events_txn
from moorline.db.repos.records import Run, run_from_row
from moorline.db.repos.run_conflicts import check_conversations_txn
from moorline.db.repos.run_reads import IN_CHUNK, RunRepoBase, db_now_txn
from moorline.db.schema import events, runs, tenants
from moorline.errors import Conflict, MoorlineError, RunNotFound, RunNotRetryable
from moorline.types import Attempt, JSONObject, RunId, RunStatus, TenantId

RETRYABLE = (RunStatus.FAILED, RunStatus.TIMED_OUT)
"""The statuses a retry takes a run out of."""

_RETRYABLE = [status.value for status in RETRYABLE]

RetryResult = Run | MoorlineError
"""A run as retried, or why it was not (``RunNotFound``, ``RunNotRetryable``, a conflict)."""


class RunRetries(RunRepoBase):
    """Puts failed and timed-out runs back to ``queued`` (see the module docstring)."""

    async def retry(self, run_id: RunId, *, tenant_id: TenantId | None = None) -> Run:
        """Retry one run, in a transaction of its own.

        Args:
            run_id: The run.
            tenant_id: The tenant asking (another tenant's run is not found); None for the
                admin.

        Returns:
            The run, ``queued`` again.

        Raises:
            RunNotFound: No such run (for this tenant).
            RunNotRetryable: The run is not ``failed`` or ``timed_out``; nothing changed.
            ConversationBusy: Its conversation has an active run now; nothing changed.
        """
        tries = 0

        async def write() -> RetryResult:
            nonlocal tries
            tries += 1
            async with self._db.write_transaction() as conn:
                [result] = (
                    await retry_runs_txn(conn, self._backend, [run_id], tenant_id=tenant_id)
                ).values()
                if isinstance(result, RunNotRetryable) and tries > 1:
                    # Our first try may have committed without an answer: then it is queued
                    # with our event last.
                    mine = await _retried_by_us_txn(conn, run_id)
                    if mine is not None:
                        return mine
                return result

        result = await self._db.with_retry(write)
        if isinstance(result, MoorlineError):
            raise result
        return result


async def retry_runs_txn(
    conn: AsyncConnection,
    backend: Backend,
    run_ids: Sequence[RunId],
    *,
    tenant_id: TenantId | None = None,
    job_id: str | None = None,
) -> dict[RunId, RetryResult]:
    """Retry ``run_ids`` in the caller's write transaction; each one's result, by id.

    Args:
        conn: The caller's write transaction.
        backend: The database's backend.
        run_ids: The runs (at most a batch: their rows stay locked until the commit).
        tenant_id: Only this tenant's runs (others are not found); None for any.
        job_id: The bulk job retrying them, recorded in their ``retried`` events.
    """
    wanted = sorted(set(run_ids))
    heads = await _heads_txn(conn, wanted, tenant_id)
    results: dict[RunId, RetryResult] = {
        run_id: RunNotFound(f"no run {run_id!r}") for run_id in wanted if run_id not in heads
    }
    talking = sorted({tenant for tenant, conversation in heads.values() if conversation})
    if talking and backend.capabilities.row_locks:
        lock = select(tenants.c.id).where(tenants.c.id.in_(talking)).order_by(tenants.c.id)
        await conn.execute(backend.lock_rows(lock))
    locked = await _lock_runs_txn(conn, backend, sorted(heads))
    now = await db_now_txn(conn, backend)
    plain: list[Run] = []
    for run in locked:
        if run.status not in RETRYABLE:
            results[run.run_id] = RunNotRetryable(
                f"run {run.run_id} is {run.status.value}: only a failed or timed_out run can "
                "be retried"
            )
        elif run.conversation_id is None:
            plain.append(run)
        else:
            # One by one: a run retried here is active when the next of its conversation is
            # checked, so two failed runs of one conversation are not both queued.
            row = {"tenant_id": run.tenant_id, "conversation_id": run.conversation_id}
            try:
                await check_conversations_txn(conn, backend, [{**row, "id": run.run_id}])
            except Conflict as exc:
                results[run.run_id] = exc
                continue
            results.update(await _requeue_txn(conn, backend, [run], now, job_id))
    results.update(await _requeue_txn(conn, backend, plain, now, job_id))
    for run_id in wanted:  # deleted since its head was read (a retention pass)
        results.setdefault(run_id, RunNotFound(f"no run {run_id!r}"))
    return results


async def _heads_txn(
    conn: AsyncConnection, run_ids: Sequence[str], tenant_id: TenantId | None
) -> dict[RunId, tuple[str, str | None]]:
    """Each existing run's tenant and conversation (which never change), read unlocked."""
    heads: dict[RunId, tuple[str, str | None]] = {}
    for offset in range(0, len(run_ids), IN_CHUNK):
        stmt = select(runs.c.id, runs.c.tenant_id, runs.c.conversation_id).where(
            runs.c.id.in_(list(run_ids[offset : offset + IN_CHUNK]))
        )
        if tenant_id is not None:
            stmt = stmt.where(runs.c.tenant_id == tenant_id)
        for row in await conn.execute(stmt):
            heads[RunId(row.id)] = (row.tenant_id, row.conversation_id)
    return heads


async def _lock_runs_txn(
    conn: AsyncConnection, backend: Backend, run_ids: Sequence[str]
) -> list[Run]:
    """The runs, their rows locked in id order (as claims lock theirs)."""
    locked: list[Run] = []
    for offset in range(0, len(run_ids), IN_CHUNK):
        stmt = (
            select(runs)
            .where(runs.c.id.in_(list(run_ids[offset : offset + IN_CHUNK])))
            .order_by(runs.c.id)
        )
        locked += [
            run_from_row(row) for row in (await conn.execute(backend.lock_rows(stmt))).mappings()
        ]
    return locked


_CLEARED: Mapping[str, Any] = {
    "status": RunStatus.QUEUED.value,
    "lease_owner": None,
    "lease_expires_at": None,
    "output": None,
    "error": None,
    "cancel_requested_at": None,
    "finished_at": None,
    "elapsed_time": None,
    "waiting_for": None,
    "wake_at": None,
}
"""What a retry resets: a queued run has no outcome, lease, wait or cancel request."""


async def _requeue_txn(
    conn: AsyncConnection,
    backend: Backend,
    locked: Sequence[Run],
    now: datetime,
    job_id: str | None,
) -> dict[RunId, RetryResult]:
    """Move the locked, retryable ``locked`` runs to ``queued``, with a ``retried`` event each."""
    if not locked:
        return {}
    ids = [run.run_id for run in locked]
    for offset in range(0, len(ids), IN_CHUNK):
        chunk = ids[offset : offset + IN_CHUNK]
        result = await conn.execute(
            update(runs)
            .where(runs.c.id.in_(chunk), runs.c.status.in_(_RETRYABLE))
            # A fresh budget: every attempt so far counts as a resume. Claimable now, at the
            # back of its lane (``not_before``), like a new run.
            .values(**_CLEARED, resumes=runs.c.attempt, not_before=now, updated_at=now)
        )
        # Every row is locked and was read retryable: each must have matched.
        if result.rowcount != len(chunk):  # pragma: no cover - would be a locking bug
            raise AssertionError(f"retried {result.rowcount} of {len(chunk)} locked runs")
    items: list[tuple[RunId, Attempt, str, JSONObject]] = []
    for run in locked:
        data: JSONObject = {"previous_status": run.status.value, "error": run.error}
        if job_id is not None:
            data["job_id"] = job_id
        items.append((run.run_id, run.attempt, EVENT_RETRIED, data))
    await append_events_txn(conn, backend.name, items, now=now)
    return {
        run.run_id: replace(
            run,
            status=RunStatus.QUEUED,
            lease_owner=None,
            lease_expires_at=None,
            output=None,
            error=None,
            cancel_requested_at=None,
            finished_at=None,
            elapsed_time=None,
            waiting_for=None,
            wake_at=None,
            resumes=run.attempt,
            not_before=now,
            updated_at=now,
        )
        for run in locked
    }


async def _retried_by_us_txn(conn: AsyncConnection, run_id: RunId) -> Run | None:
    """The run, if it is queued with a ``retried`` event as its last one (a lost commit)."""
    last = (
        select(events.c.type)
        .where(events.c.run_id == run_id)
        .order_by(events.c.seq.desc())
        .limit(1)
    )
    if (await conn.execute(last)).scalar_one_or_none() != EVENT_RETRIED:
        return None
    row = (await conn.execute(select(runs).where(runs.c.id == run_id))).mappings().first()
    if row is None or row["status"] != RunStatus.QUEUED.value:
        return None
    return run_from_row(row)
