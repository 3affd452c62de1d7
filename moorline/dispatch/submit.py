"""Enqueueing runs: group commit of concurrent submissions, and routing a run by its plan.

A single-run write transaction costs about a millisecond through aiosqlite (the commit, the
thread hop, the write lock), and every writer waits for SQLite's one write lock, so one process
enqueueing run by run tops out near a thousand runs a second. :class:`Submitter` instead lets
one background writer task take everything callers have queued (up to ``max_batch``) and write
it with one :meth:`~moorline.db.repos.runs.RunsRepo.submit_many` transaction: while one batch
commits, the next one gathers, so the batch size follows the load without any timer. Each
caller still awaits its own run or its own error.

A submission may carry a :class:`~moorline.db.repos.quotas.QuotaClaim` (admission does when
the quota counters are in the database): its unit of the daily quota is taken in the batch's
transaction, so one transaction decides the quota of many triggers and stores their runs, and a
run refused by the quota comes back stored ``rate_limited``.

The coalescing is hand-written rather than a library's because it must know the repository's
error semantics: a batch refused for one bad row (an idempotency conflict, say) is retried run
by run, so only that row's caller gets the error.
"""

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from moorline.db.repos.quotas import QuotaClaim
from moorline.db.repos.records import Run
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.errors import MoorlineError
from moorline.plans import Plan
from moorline.types import JSONObject, RunId, RunStatus, TenantId

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 256
DEFAULT_MAX_PENDING = 4096

_CLOSED = "Submitter is closed"


@dataclass(frozen=True, slots=True, kw_only=True)
class _Request:
    new: NewRun
    quota: QuotaClaim | None
    future: asyncio.Future[Run]


class Submitter:
    """Enqueues runs for many concurrent callers with few transactions (group commit)."""

    def __init__(
        self,
        runs: RunsRepo,
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_pending: int = DEFAULT_MAX_PENDING,
        on_enqueued: Callable[[set[str]], None] | None = None,
    ) -> None:
        """Prepare the submitter; its writer task starts with the first submission.

        Args:
            runs: The repository the batches are written through.
            max_batch: Most runs in one transaction.
            max_pending: Most submissions waiting for the writer. When that many wait,
                :meth:`submit` waits for room: callers slow down to the database's pace
                instead of piling up memory.
            on_enqueued: Called after each write with the lanes that got runs (the worker's
                wake-up hook); an exception it raises is logged and otherwise ignored.
        """
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        self._runs = runs
        self._max_batch = max_batch
        self._on_enqueued = on_enqueued
        # None is the stop marker close() puts behind the last submission.
        self._queue: asyncio.Queue[_Request | None] = asyncio.Queue(maxsize=max_pending)
        self._writer: asyncio.Task[None] | None = None
        self._in_flight: list[_Request] = []
        self._closed = False
        self._batches_written = 0
        self._runs_written = 0

    @property
    def batches_written(self) -> int:
        """Transactions that stored runs so far (a batch retried run by run counts each run)."""
        return self._batches_written

    @property
    def runs_written(self) -> int:
        """Runs stored so far."""
        return self._runs_written

    async def submit(self, new: NewRun, *, quota: QuotaClaim | None = None) -> Run:
        """Store ``new`` as a ``queued`` run, in a transaction shared with concurrent callers.

        Args:
            new: The run to store.
            quota: The daily-quota unit the run needs, taken in the same transaction; without
                one the run is stored ``rate_limited`` (see
                :meth:`~moorline.db.repos.runs.RunsRepo.submit_many`).

        Returns:
            The run as stored: ``queued``, or ``rate_limited`` when ``quota`` was refused.

        Raises:
            RuntimeError: the submitter is closed.
            IdempotencyConflict: the run's idempotency key is taken; nothing was stored.
            MoorlineError: any other refusal of
                :meth:`~moorline.db.repos.runs.RunsRepo.submit_many`, for this run only.
        """
        if self._closed:
            raise RuntimeError(_CLOSED)
        if self._writer is None:
            self._writer = asyncio.create_task(self._run(), name="moorline-submitter")
        future: asyncio.Future[Run] = asyncio.get_running_loop().create_future()
        await self._queue.put(_Request(new=new, quota=quota, future=future))
        if self._writer.done():
            # The writer stopped while this caller waited for room in the queue.
            self._fail_waiting(RuntimeError(_CLOSED))
        return await future

    async def close(self) -> None:
        """Write every submission made so far, then stop the writer.

        Submissions after ``close`` raise :class:`RuntimeError`.
        """
        first = not self._closed
        self._closed = True
        writer = self._writer
        if writer is None:
            return
        if first and not writer.done():
            await self._queue.put(None)
        await asyncio.shield(writer)

    async def _run(self) -> None:
        try:
            while await self._write_next():
                pass
        finally:
            self._closed = True
            error = RuntimeError(_CLOSED)
            for request in self._in_flight:
                if not request.future.done():
                    request.future.set_exception(error)
            self._fail_waiting(error)

    async def _write_next(self) -> bool:
        """Take the next batch off the queue and write it; False once the stop marker came."""
        request = await self._queue.get()
        batch: list[_Request] = []
        while request is not None:
            # A caller cancelled while waiting has gone away; its run is not written.
            if not request.future.done():
                batch.append(request)
            if len(batch) == self._max_batch or self._queue.empty():
                break
            request = self._queue.get_nowait()
        self._in_flight = batch
        try:
            if batch:
                await self._write_batch(batch)
        finally:
            self._in_flight = []
        return request is not None

    async def _write_batch(self, batch: list[_Request]) -> None:
        try:
            stored = await self._store(batch)
        except MoorlineError as exc:
            if len(batch) == 1:
                _settle(batch[0], exc)
                return
            # One bad row refuses the whole batch; write run by run so that only its caller
            # gets the error and everyone else their run.
            await self._write_one_by_one(batch)
            return
        except Exception as exc:
            # Not about a row (the database stayed unreachable through the retries): the
            # whole batch fails, without a run-by-run retry adding to the outage.
            logger.warning("enqueuing %d runs failed: %s", len(batch), type(exc).__name__)
            for request in batch:
                _settle(request, exc)
            return
        self._count(len(stored))
        for request, run in zip(batch, stored, strict=True):
            _settle(request, run)
        lanes = {run.lane for run in stored if run.status is RunStatus.QUEUED}
        if lanes:
            self._notify(lanes)

    async def _store(self, batch: list[_Request]) -> list[Run]:
        quotas = [request.quota for request in batch]
        return await self._runs.submit_many(
            [request.new for request in batch],
            quotas=quotas if any(quota is not None for quota in quotas) else None,
        )

    async def _write_one_by_one(self, batch: list[_Request]) -> None:
        lanes: set[str] = set()
        for request in batch:
            try:
                [run] = await self._store([request])
            except Exception as exc:
                _settle(request, exc)
                continue
            self._count(1)
            if run.status is RunStatus.QUEUED:
                lanes.add(run.lane)
            _settle(request, run)
        if lanes:
            self._notify(lanes)

    def _count(self, runs: int) -> None:
        self._batches_written += 1
        self._runs_written += runs

    def _notify(self, lanes: set[str]) -> None:
        if self._on_enqueued is None:
            return
        try:
            self._on_enqueued(lanes)
        except Exception:
            logger.exception("the on_enqueued hook failed for lanes %s", sorted(lanes))

    def _fail_waiting(self, error: BaseException) -> None:
        """Fail every submission still in the queue (the writer will not take them)."""
        while not self._queue.empty():
            request = self._queue.get_nowait()
            if request is not None and not request.future.done():
                request.future.set_exception(error)


def _settle(request: _Request, outcome: Run | BaseException) -> None:
    """Hand the caller its run or its error, unless it stopped waiting."""
    if request.future.done():
        return
    if isinstance(outcome, BaseException):
        request.future.set_exception(outcome)
    else:
        request.future.set_result(outcome)


def new_run_for_plan(
    plan: Plan,
    *,
    tenant_id: TenantId,
    workflow: str,
    input: JSONObject,
    max_attempts: int,
    idempotency_key: str | None = None,
    conversation_id: str | None = None,
    timeout_s: float | None = None,
    delay_s: float = 0.0,
    run_id: RunId | None = None,
) -> NewRun:
    """A :class:`NewRun` routed by the tenant's plan: the plan's lane and priority.

    The plan comes from :class:`moorline.plans.PlansProvider`, which has already routed it for
    the edition (community: every plan to the lane ``workflow``).

    Args:
        plan: The tenant's plan.
        tenant_id: The owner.
        workflow: The registered workflow's name.
        input: The workflow's validated JSON arguments.
        max_attempts: The workflow's attempt budget.
        idempotency_key: See :class:`NewRun`.
        conversation_id: See :class:`NewRun`.
        timeout_s: See :class:`NewRun`.
        delay_s: See :class:`NewRun`.
        run_id: See :class:`NewRun`.
    """
    return NewRun(
        tenant_id=tenant_id,
        workflow=workflow,
        input=input,
        lane=plan.lane,
        priority=plan.priority,
        max_attempts=max_attempts,
        idempotency_key=idempotency_key,
        conversation_id=conversation_id,
        timeout_s=timeout_s,
        delay_s=delay_s,
        run_id=run_id,
    )
