"""Enqueueing runs: group commit of concurrent submissions.

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

A submitter may have a :class:`Gate`: counters kept outside the database (admission's, in
Redis) that decide the batch before it is written. A submission then carries its claims (a
:class:`RateClaim` of the API rate limit and its quota unit), and the gate settles the claims of
the whole batch in one round trip, however many runs it holds, instead of each trigger paying
its own. Its verdict per run: refused (the caller gets the error; nothing is stored), stored
``rate_limited`` with the quota's refusal, or written. A run written by nobody after its unit
was taken (the batch failed, or its key was taken meanwhile) gives the unit back. With a gate
the submitter works in two stages, each a task: one gates a batch while the other writes the
batches gated before it, all those waiting in one transaction, so a batch's way to its callers
is not a Redis round trip and then a database one, one after the other.

The coalescing is hand-written rather than a library's because it must know the repository's
error semantics: a batch refused for one bad row (an idempotency conflict, say) is retried run
by run, so only that row's caller gets the error.
"""

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from moorline.concurrency import settle
from moorline.db.repos.announcements import Announcement
from moorline.db.repos.quotas import QuotaClaim
from moorline.db.repos.records import Run
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.errors import BackendUnavailable, MoorlineError
from moorline.types import JSONObject, RunStatus, TenantId

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 256
DEFAULT_MAX_PENDING = 4096

_CLOSED = "Submitter is closed"


@dataclass(slots=True, kw_only=True)
class RateClaim:
    """One hit on a credential's API rate limit, counted by the gate with its batch.

    Attributes:
        identity: The credential (an API key's digest, a webhook's id); never a secret.
        rate: The plan's rate, ``"<count>/<period>"``.
        state: Set by the gate when the hit is counted: the window after it (the
            ``RateLimit-*`` headers), None while not counted or when the storage did not answer.
    """

    identity: str
    rate: str
    state: object | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Claims:
    """What a gated submission asks of the gate: its rate-limit hit and its quota unit."""

    tenant_id: TenantId
    rate: RateClaim | None
    quota: QuotaClaim | None


ClaimedRun = tuple[NewRun, QuotaClaim | None, RateClaim | None]
"""A run for :meth:`Submitter.queue_all`, with its quota and rate claims (see :meth:`submit`)."""

Verdict = BaseException | JSONObject | None
"""The gate's answer for one submission: an error to hand its caller (nothing is stored), the
quota's refusal (the run is stored ``rate_limited`` with it), or None (the run is written; its
unit, if it claimed one, is taken)."""


class Gate(Protocol):
    """Counters outside the database that decide a batch before it is written."""

    async def enter(self, claims: Sequence[Claims]) -> list[Verdict]:
        """Count the batch's rate-limit hits and take its quota units.

        Returns:
            One verdict per claim, in order.

        Raises:
            Exception: the counters did not answer; every submission of the batch gets it.
        """
        ...

    async def give_back(self, claims: Sequence[Claims]) -> None:
        """Give back the units taken for ``claims`` (runs that were not written after all)."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _Request:
    new: NewRun
    quota: QuotaClaim | None
    rate: RateClaim | None
    future: asyncio.Future[Run]
    refusal: JSONObject | None = None
    """Set by the gate: the run is stored ``rate_limited`` with it."""


_Gated = tuple[list[_Request], dict[_Request, Claims]]
"""A gated batch: the requests to write, and the claims of those whose unit the gate took."""


class Submitter:
    """Enqueues runs for many concurrent callers with few transactions (group commit)."""

    def __init__(
        self,
        runs: RunsRepo,
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_pending: int = DEFAULT_MAX_PENDING,
        on_enqueued: Callable[[set[str]], bool | None] | None = None,
        gate: Gate | None = None,
        announcement: Announcement | None = None,
    ) -> None:
        """Prepare the submitter; its writer task starts with the first submission.

        Args:
            runs: The repository the batches are written through.
            max_batch: Most runs in one transaction.
            max_pending: Most submissions waiting for the writer. When that many wait,
                :meth:`submit` waits for room: callers slow down to the database's pace
                instead of piling up memory.
            on_enqueued: Called after each write with the lanes that got runs (the worker's
                wake-up hook); an exception it raises is logged and otherwise ignored. True
                from it: the wake-up is sent from a task that has yet to run, and the callers
                are answered a turn of the event loop later, once it went out.
            gate: Decides each batch's claims before it is written (see the module docstring);
                without one, quota units are taken in the batch's transaction.
            announcement: The batches' writes send their runs' wake-ups to the other
                processes themselves (PostgreSQL's NOTIFY, at their commit; see
                :mod:`~moorline.db.repos.announcements`); ``on_enqueued`` then need only
                wake this process's waiters.
        """
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        self._runs = runs
        self._max_batch = max_batch
        self._on_enqueued = on_enqueued
        self._gate = gate
        self._announcement = announcement
        # None is the stop marker close() puts behind the last submission.
        self._queue: asyncio.Queue[_Request | None] = asyncio.Queue(maxsize=max_pending)
        self._writer: asyncio.Task[None] | None = None
        self._in_flight: list[_Request] = []
        self._closed = False
        self._batches_written = 0
        self._runs_written = 0

    @property
    def max_batch(self) -> int:
        """Most runs the writer stores in one transaction."""
        return self._max_batch

    @property
    def is_gated(self) -> bool:
        """Whether a :class:`Gate` decides claims (rate-limit hits can be submitted)."""
        return self._gate is not None

    @property
    def batches_written(self) -> int:
        """Transactions that stored runs so far (a batch retried run by run counts each run)."""
        return self._batches_written

    @property
    def runs_written(self) -> int:
        """Runs stored so far."""
        return self._runs_written

    async def submit(
        self, new: NewRun, *, quota: QuotaClaim | None = None, rate: RateClaim | None = None
    ) -> Run:
        """Store ``new`` as a ``queued`` run, in a transaction shared with concurrent callers.

        Args:
            new: The run to store.
            quota: The daily-quota unit the run needs, taken by the gate or else in the same
                transaction; without one the run is stored ``rate_limited`` (see
                :meth:`~moorline.db.repos.runs.RunsRepo.submit_many`).
            rate: A hit on the API rate limit, counted by the gate first (only with a gate).

        Returns:
            The run as stored: ``queued``, or ``rate_limited`` when ``quota`` was refused.

        Raises:
            RuntimeError: the submitter is closed.
            ValueError: a rate claim without a gate.
            RateLimited: the gate refused the rate-limit hit; nothing was stored.
            IdempotencyConflict: the run's idempotency key is taken; nothing was stored.
            MoorlineError: any other refusal of
                :meth:`~moorline.db.repos.runs.RunsRepo.submit_many`, for this run only.
        """
        writer = self._started(rate_claims=rate is not None)
        future: asyncio.Future[Run] = asyncio.get_running_loop().create_future()
        await self._queue.put(_Request(new=new, quota=quota, rate=rate, future=future))
        if writer.done():
            # The writer stopped while this caller waited for room in the queue.
            self._fail_waiting(RuntimeError(_CLOSED))
        return await future

    async def queue_all(
        self, submissions: Sequence[ClaimedRun]
    ) -> "asyncio.Future[list[Run | BaseException]]":
        """Queue each of ``submissions`` as :meth:`submit` does, without waiting for the write.

        For a bulk submission: the runs are queued one after the other, so the writer takes
        them into its batches in this order, and the caller waits for all of them at once
        rather than with a task per run. Returns once they are queued (after waiting for room,
        as :meth:`submit` does): the future of each one's run or its error (:meth:`submit`'s
        errors, as values), in order. A caller that decides runs part by part queues each
        part this way, so that the writer stores one part while it decides the next.

        Raises:
            RuntimeError: the submitter is closed.
            ValueError: a rate claim without a gate.
        """
        writer = self._started(rate_claims=any(rate is not None for _, _, rate in submissions))
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Run]] = []
        for new, quota, rate in submissions:
            future: asyncio.Future[Run] = loop.create_future()
            futures.append(future)
            await self._queue.put(_Request(new=new, quota=quota, rate=rate, future=future))
        if writer.done():
            self._fail_waiting(RuntimeError(_CLOSED))
        return asyncio.gather(*futures, return_exceptions=True)

    def _started(self, *, rate_claims: bool) -> "asyncio.Task[None]":
        """The writer task, started on first use, once the submission is known to be valid."""
        if self._closed:
            raise RuntimeError(_CLOSED)
        if rate_claims and self._gate is None:
            raise ValueError("a rate claim needs a submitter with a gate")
        if self._writer is None:
            self._writer = asyncio.create_task(self._run(), name="moorline-submitter")
        return self._writer

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
            if self._gate is None:
                while await self._write_next():
                    pass
            else:
                await self._run_gated(self._gate)
        finally:
            self._closed = True
            error = RuntimeError(_CLOSED)
            for request in self._in_flight:
                settle(request.future, error)
            self._fail_waiting(error)

    async def _take_next(self) -> tuple[list[_Request], bool]:
        """The next batch off the queue, and False once the stop marker came."""
        request = await self._queue.get()
        batch: list[_Request] = []
        while request is not None:
            # A caller cancelled while waiting has gone away; its run is not written.
            if not request.future.done():
                batch.append(request)
            if len(batch) == self._max_batch or self._queue.empty():
                break
            request = self._queue.get_nowait()
        self._in_flight = [pending for pending in self._in_flight if not pending.future.done()]
        self._in_flight.extend(batch)
        return batch, request is not None

    async def _write_next(self) -> bool:
        """Take the next batch off the queue and write it; False once the stop marker came."""
        batch, more = await self._take_next()
        if batch:
            await self._write_batch(batch, {})
        return more

    async def _run_gated(self, gate: Gate) -> None:
        """Gate batches here while a second task writes the batches gated before.

        The two stages overlap: a batch's Redis round trips happen while the batch before is
        being written, instead of one after the other on every batch's way to its callers.
        The writer takes every batch gated meanwhile into one transaction, so the write's batch
        size still follows the load.
        """
        gated: asyncio.Queue[_Gated | None] = asyncio.Queue()
        writer = asyncio.create_task(self._write_gated(gated), name="moorline-submitter-write")
        try:
            more = True
            while more:
                batch, more = await self._take_next()
                if batch:
                    passed, held = await self._enter_gate(gate, batch)
                    if passed:
                        gated.put_nowait((passed, held))
        except BaseException:
            writer.cancel()
            raise
        gated.put_nowait(None)
        await writer

    async def _write_gated(self, gated: "asyncio.Queue[_Gated | None]") -> None:
        """Write the gated batches, all those waiting in one transaction, until the marker."""
        while True:
            item = await gated.get()
            batch: list[_Request] = []
            held: dict[_Request, Claims] = {}
            while item is not None:
                batch.extend(item[0])
                held.update(item[1])
                if len(batch) >= self._max_batch or gated.empty():
                    break
                item = gated.get_nowait()
            if batch:
                await self._write_batch(batch, held)
            if item is None:
                return

    async def _write_batch(self, batch: list[_Request], held: dict[_Request, Claims]) -> None:
        """Write ``batch``; give back the units ``held`` for runs not stored; answer the callers."""
        outcomes = await self._write(batch)
        lanes = {
            outcome.lane
            for outcome in outcomes.values()
            if isinstance(outcome, Run) and outcome.status is RunStatus.QUEUED
        }
        if lanes and self._notify(lanes):
            # The wake-up's task writes it in the next turn of the loop, and uvloop puts a
            # turn's writes on the wire only when the turn ends: answered in that same turn,
            # the callers' continuations (an HTTP answer each) would delay it by their work.
            await asyncio.sleep(0)
        unwritten = [
            claims for request, claims in held.items() if not isinstance(outcomes[request], Run)
        ]
        if unwritten and self._gate is not None:
            # Before the callers hear of it: whoever learns that a run was not stored finds its
            # unit back already.
            await self._give_back(self._gate, unwritten)
        for request, outcome in outcomes.items():
            settle(request.future, outcome)

    async def _enter_gate(
        self, gate: Gate, batch: list[_Request]
    ) -> tuple[list[_Request], dict[_Request, Claims]]:
        """Settle the batch's claims with ``gate``.

        Returns:
            The requests left to write (with no quota claim left for the transaction: the gate
            took their units, or they carry the quota's refusal), and the claims of those
            whose unit the gate took.
        """
        gated = {request: _claims(request) for request in batch if request.rate or request.quota}
        if not gated:
            return batch, {}
        try:
            verdicts = await gate.enter(list(gated.values()))
        except Exception as exc:
            for request in gated:
                settle(request.future, exc)
            return [request for request in batch if request not in gated], {}
        decided = dict(zip(gated, verdicts, strict=True))
        remaining: list[_Request] = []
        held: dict[_Request, Claims] = {}
        for request in batch:
            if request not in decided:
                remaining.append(request)
                continue
            verdict = decided[request]
            if isinstance(verdict, BaseException):
                settle(request.future, verdict)
            elif verdict is not None:
                remaining.append(replace(request, quota=None, refusal=verdict))
            else:
                admitted = replace(request, quota=None)
                remaining.append(admitted)
                if request.quota is not None:
                    held[admitted] = gated[request]
        return remaining, held

    async def _give_back(self, gate: Gate, claims: list[Claims]) -> None:
        """Return the units of runs the gate admitted but nobody wrote."""
        try:
            await gate.give_back(claims)
        except Exception:
            # The units stay taken: the tenant is refused early rather than let past its quota.
            logger.exception("giving back %d quota units failed", len(claims))

    async def _write(self, batch: list[_Request]) -> dict[_Request, Run | BaseException]:
        """Write ``batch``; each request's run, or its error."""
        queued = [request for request in batch if request.refusal is None]
        outcomes = await self._write_queued(queued) if queued else {}
        for request in batch:
            if request.refusal is not None:
                # Refused by the gate's quota (rare: the day's quota is used up): stored
                # ``rate_limited`` as without a gate, in a statement of its own.
                refused = replace(request.new, idempotency_key=None)
                try:
                    outcomes[request] = await self._runs.insert_rate_limited(
                        refused, request.refusal
                    )
                except Exception as exc:
                    outcomes[request] = exc
        return outcomes

    async def _write_queued(self, batch: list[_Request]) -> dict[_Request, Run | BaseException]:
        try:
            stored = await self._store(batch)
        except Exception as exc:
            if isinstance(exc, MoorlineError) and not isinstance(exc, BackendUnavailable):
                if len(batch) == 1:
                    return {batch[0]: exc}
                # One bad row refuses the whole batch; write run by run so that only its
                # caller gets the error and everyone else their run.
                return await self._write_one_by_one(batch)
            # Not about a row (the database stayed unreachable through the retries, or a
            # driver's error they did not translate): the whole batch fails, without a
            # run-by-run retry adding to the outage.
            logger.warning("enqueuing %d runs failed: %s", len(batch), type(exc).__name__)
            return dict.fromkeys(batch, exc)
        self._count(len(stored))
        return dict(zip(batch, stored, strict=True))

    async def _store(self, batch: list[_Request]) -> list[Run]:
        quotas = [request.quota for request in batch]
        return await self._runs.submit_many(
            [request.new for request in batch],
            quotas=quotas if any(quota is not None for quota in quotas) else None,
            announcement=self._announcement,
        )

    async def _write_one_by_one(self, batch: list[_Request]) -> dict[_Request, Run | BaseException]:
        outcomes: dict[_Request, Run | BaseException] = {}
        for request in batch:
            try:
                [run] = await self._store([request])
            except Exception as exc:
                outcomes[request] = exc
                continue
            self._count(1)
            outcomes[request] = run
        return outcomes

    def _count(self, runs: int) -> None:
        self._batches_written += 1
        self._runs_written += runs

    def _notify(self, lanes: set[str]) -> bool:
        """Tell the hook; whether the wake-up waits for a turn of the loop to be sent."""
        if self._on_enqueued is None:
            return False
        try:
            return bool(self._on_enqueued(lanes))
        except Exception:
            logger.exception("the on_enqueued hook failed for lanes %s", sorted(lanes))
            return False

    def _fail_waiting(self, error: BaseException) -> None:
        """Fail every submission still in the queue (the writer will not take them)."""
        while not self._queue.empty():
            request = self._queue.get_nowait()
            if request is not None:
                settle(request.future, error)


def _claims(request: _Request) -> Claims:
    return Claims(tenant_id=request.new.tenant_id, rate=request.rate, quota=request.quota)
