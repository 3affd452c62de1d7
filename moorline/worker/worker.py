"""The worker: lanes with their own slots, claims, heartbeats, self-fencing, graceful shutdown.

One :class:`Worker` per process (or per in-process loop of ``moorline serve``):

- **Served workflows.** A worker claims only runs of the workflows its app registers
  (``workflows``), and announces them with its lanes in a ``workers`` row renewed every
  ``LEASE_TTL/3`` (:mod:`moorline.worker.presence`): in a rolling deploy a run of a workflow
  the new app lacks stays ``queued`` and shows as unserved instead of failing.
- **Lanes and slots.** Each lane has its own slots and its own claim loop, so a flooded
  sandbox lane never takes a professional slot. A loop claims as many runs as it has free
  slots, in one transaction (:meth:`~moorline.db.repos.queue.QueueRepo.claim`, which also
  enforces tenant caps and round-robin between tenants), then sleeps until a wake-up, the slow
  poll, or a local reason to look again: a freed slot when the lane was full or a tenant's cap
  held runs back, or a retry of its own whose delay has passed.
- **Leases.** A heartbeat loop renews every held lease each ``LEASE_TTL/3`` with a statement
  fenced by (run, attempt, owner, running). A renewal that matches no row means the lease is
  gone (reaped, cancelled): the execution is cancelled at once and writes nothing more. The
  same beat then renews the runtime state of the attempts still held (conversation leases,
  interactive windows: :meth:`~moorline.engine.runner.Runner.renew`), which the runner
  releases once the attempt's outcome is written.
- **Self-fencing.** Each execution also has a deadline on the monotonic clock, pushed back by
  every successful renewal: ``last renewal + LEASE_TTL - margin`` (one timer per claimed batch
  and per renewal, shared by the executions it covers). When the database could not
  be reached in time (or the process was paused), the deadline cancels the execution before
  the lease can expire, so a worker never keeps working on a run another may have taken.
- **Cancels.** Each execution has a ``cancel_requested`` event the runner watches besides the
  RuntimeStore's signal; the heartbeat sets it for every renewed run whose cancel the database
  reports, so a lost signal costs at most one heartbeat interval.
- **Outcomes** go through the :class:`~moorline.worker.completions.Completer` (group commit):
  succeeded, failed (or retrying), and the stops ``cancelled`` and ``timed_out``, all fenced.
  While a lane's loop waits for a freed slot, its runs' outcomes are handed to the loop
  instead, which writes them with its next claim in one transaction
  (:mod:`moorline.worker.handoffs`).
- **Shutdown** (``stop`` set): claiming stops, in-flight runs get ``grace_s`` to finish, the
  rest are cancelled and released (back to ``queued`` at once, their attempt fenced out).
- **Supervision.** The long-lived loops run in one task group: if one dies, the others are
  stopped, running executions are abandoned to the reaper, and :class:`WorkerCrashed` is
  raised so the process exits non-zero instead of limping on without, say, heartbeats.
"""

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol

from sqlalchemy.exc import DBAPIError

import moorline
from moorline.db.manager import DatabaseManager
from moorline.db.repos.children import ChildrenRepo
from moorline.db.repos.handoffs import HandoffsRepo
from moorline.db.repos.queue import Claim, ClaimBatch, ClaimRequest, QueueRepo
from moorline.db.repos.records import Run
from moorline.db.repos.runs import Failed, Outcome, RunsRepo, Stopped, Succeeded
from moorline.db.repos.steps import LeaseLost
from moorline.db.repos.workers import WorkerEntry, WorkersRepo
from moorline.dispatch.retry import RetryPolicy
from moorline.dispatch.wakeups import Notifier
from moorline.engine.context import Cancelled
from moorline.engine.failures import FailureDescriber
from moorline.engine.runner import Runner
from moorline.errors import BackendUnavailable, MoorlineError, RunParked, TimeLimitExceeded
from moorline.observability.logs import bind_run
from moorline.observability.metrics import Metrics
from moorline.types import JSONObject, RunStatus
from moorline.worker.completions import Completer
from moorline.worker.handoffs import Handed, Handoffs
from moorline.worker.presence import Presence

logger = logging.getLogger(__name__)

DEFAULT_POLL_INTERVAL_S = 1.0
DEFAULT_GRACE_S = 30.0
SELF_FENCE_MARGIN_FRACTION = 1 / 6
"""Share of LEASE_TTL kept in hand: with heartbeats every TTL/3, a worker that missed two
renewals stops the run at 5/6 of the TTL, before the reaper can see the lease expire."""
CLAIM_BACKOFF_S = 0.1
"""First pause after a failed claim; doubled per further failure, up to CLAIM_BACKOFF_MAX_S."""
CLAIM_BACKOFF_MAX_S = 5.0
WAKE_BATCH_S = 0.01
"""How long children's ends are gathered before their parents are told, in seconds."""


class WorkerCrashed(MoorlineError):
    """A long-lived worker loop died; the process should exit non-zero."""

    code = "worker_crashed"


class Waiter(Protocol):
    """Wakes a lane's claim loop when new work may be there (see ``moorline.dispatch``)."""

    async def wait(self, lane: str, timeout_s: float, *, seen_before: float | None = None) -> bool:
        """Return True when woken for ``lane``, False after ``timeout_s``.

        Wake-ups from before ``seen_before`` (``time.monotonic()``) are already covered.
        """
        ...


def _ids(claim: Claim) -> tuple[str, int]:
    return claim.fence.run_id, claim.fence.attempt


def _answered(recheck: asyncio.Event, _: "asyncio.Future[bool]") -> None:
    """The waiter's task ended (woken or timed out): the claim loop looks again."""
    recheck.set()


def make_owner_id() -> str:
    """A lease owner id unique to this worker: host, process and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass(eq=False)
class _SelfFence:
    """One self-fence deadline, shared by the executions one claim or one renewal extended.

    A claim starts a whole batch and a heartbeat renews every lease in one statement, so
    their deadlines coincide: one timer serves them all, instead of a timer per execution
    armed, re-armed at each heartbeat and cancelled again at its end.
    """

    members: "set[_Execution]" = field(default_factory=set)
    timer: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class _Execution:
    claim: Claim
    lane: str
    task: asyncio.Task[None] | None = None
    self_fence: _SelfFence | None = None
    """The deadline this execution is stopped at unless a renewal moves it on."""
    lost: bool = False
    """The lease is gone (or self-fenced): write nothing more for this attempt."""
    releasing: bool = False
    """Cancelled by shutdown: give the run back instead of failing it."""
    cancel_requested: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a heartbeat finds the run's cancel recorded in the database."""
    started: float = field(default_factory=time.monotonic)
    finished: bool = False
    """Its outcome is written (or given up): no heartbeat or fence concerns it any more."""
    parked: bool = False
    """Its attempt parked the run and is winding down: it holds no lease to renew or lose."""
    slot_released: bool = False
    """Its outcome was committed with its lane's next claim, which took its slot."""


class Worker:
    """Claims and executes runs on its lanes until ``stop`` is set."""

    def __init__(
        self,
        db: DatabaseManager,
        runner: Runner,
        *,
        lanes: Mapping[str, int],
        lease_ttl_s: float,
        tenant_caps: Callable[[], Awaitable[Mapping[str, int]]],
        waiter: Waiter | None = None,
        retry_policy: RetryPolicy | None = None,
        owner: str | None = None,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        grace_s: float = DEFAULT_GRACE_S,
        rng: random.Random | None = None,
        metrics: Metrics | None = None,
        secrets: Iterable[str] = (),
        workflows: Collection[str] | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        """Create a worker; nothing runs before :meth:`run`.

        Args:
            db: The database.
            runner: Executes one attempt of a claimed run (the engine).
            lanes: Lane → slots served by this worker.
            lease_ttl_s: ``MOORLINE_LEASE_TTL``.
            tenant_caps: Plan → tenant concurrency cap, asked before every claim (plans
                files are re-read through a TTL cache).
            waiter: Wake-ups for new work; without one the loops poll.
            retry_policy: Backoff and retryability of failed attempts.
            owner: Lease owner id; unique per worker (default: host, pid, random).
            poll_interval_s: Slowest a lane notices work when no wake-up arrives.
            grace_s: How long in-flight runs may finish after ``stop`` before release.
            rng: Jitter source for retry backoff.
            metrics: Where attempts, retries and lease losses are counted; default a private
                set nobody scrapes.
            secrets: Values blanked in a failed run's stored error (its message and
                traceback): the settings' tokens and keys.
            workflows: The workflow names ``runner`` can run; only their runs are claimed.
                None claims every workflow (a runner that runs anything, in tests).
            notifier: Wakes other processes' workers when a child's end re-queues its parent.
        """
        if not lanes:
            raise ValueError("a worker needs at least one lane")
        self._db = db
        self._queue = QueueRepo(db)
        self._runs = RunsRepo(db)
        self._runner = runner
        self._lanes = dict(lanes)
        self._lease_ttl_s = lease_ttl_s
        self._tenant_caps = tenant_caps
        self._waiter = waiter
        self._policy = retry_policy or RetryPolicy()
        self.owner = owner or make_owner_id()
        self._workflows = None if workflows is None else sorted(set(workflows))
        self._presence = Presence(
            WorkersRepo(db),
            WorkerEntry(
                worker_id=self.owner,
                host=socket.gethostname(),
                pid=os.getpid(),
                lanes=self._lanes,
                workflows=self._workflows,
                version=moorline.__version__,
            ),
            ttl_s=lease_ttl_s,
        )
        self._poll_interval_s = poll_interval_s
        self._grace_s = grace_s
        self._rng = rng or random.Random()
        self._metrics = metrics or Metrics()
        self._completer = Completer(self._runs)
        self._handoffs: Handoffs[_Execution] = Handoffs(list(self._lanes), self._completer)
        self._handoffs_repo = HandoffsRepo(db)
        self._failures = FailureDescriber(secrets)
        self._children = ChildrenRepo(db)
        self._notifier = notifier
        self._ended_children: list[Run] = []
        """Children whose end their parents have not been told of yet."""
        self._waking: asyncio.Task[None] | None = None
        self._executions: set[_Execution] = set()
        self._in_lane = dict.fromkeys(self._lanes, 0)
        self._recheck = {lane: asyncio.Event() for lane in self._lanes}
        """Set when this process knows its lane may have claimable work (see ``_claim_loop``)."""
        self._wants_slot = dict.fromkeys(self._lanes, False)
        """Whether a slot freed in the lane should make its loop claim again."""
        self._waiting = dict.fromkeys(self._lanes, False)
        """Whether the lane's loop waits (for work or a slot) rather than claims right now."""
        self._freed_at = dict.fromkeys(self._lanes, 0.0)
        """``time.monotonic()`` when each lane's latest slot was freed."""
        self._retry_timers: set[asyncio.TimerHandle] = set()
        # prometheus-client's labels() takes a lock and builds a key per call: once per lane.
        self._latency_by_lane = {
            lane: self._metrics.dispatch_latency_s.labels(lane=lane) for lane in self._lanes
        }
        self._duration_by_outcome: dict[tuple[str, str, str], Any] = {}
        self._claiming = True
        self._closing = asyncio.Event()
        self._runtime_renewal: asyncio.Task[None] | None = None
        self.claim_transactions = 0
        """Claims made so far, empty ones included."""
        self.claimed = 0
        self.finished = 0
        self.handed_off = 0
        """Outcomes committed with their lane's next claim (:mod:`moorline.worker.handoffs`)."""

    @property
    def heartbeat_interval_s(self) -> float:
        """Seconds between two renewals of every held lease."""
        return self._lease_ttl_s / 3

    @property
    def in_flight(self) -> int:
        """Executions running now."""
        return len(self._executions)

    # --- the process -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve the lanes until ``stop`` is set, then shut down gracefully.

        Raises:
            WorkerCrashed: a long-lived loop died (the cause is chained and logged).
        """
        logger.info(
            "worker %s serving %s",
            self.owner,
            ", ".join(f"{lane}={slots}" for lane, slots in self._lanes.items()),
        )
        # Announced before the first claim, so a run it claims never shows as unserved.
        await self._presence.beat()
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._completer.run(), name="completer")
                group.create_task(self._heartbeat_loop(), name="heartbeat")
                group.create_task(self._presence.run(stop), name="presence")
                claimers = [
                    group.create_task(self._claim_loop(lane, stop), name=f"claim:{lane}")
                    for lane in self._lanes
                ]
                await stop.wait()
                self._claiming = False
                for lane in self._lanes:
                    self._recheck[lane].set()
                await asyncio.gather(*claimers)
                await self._drain()
                if self._waking is not None:
                    # Parents not told now are woken by the timer sweep: only wait a little.
                    await asyncio.wait([self._waking], timeout=WAKE_BATCH_S * 100)
                self._completer.close()
                self._closing.set()
                self._cancel_retry_timers()
        except BaseExceptionGroup as group_error:
            # A loop died: nobody renews leases or writes outcomes any more, so running
            # executions must stop now; their runs return through the reaper.
            self._abandon_all()
            self._cancel_retry_timers()
            cause = group_error.exceptions[0]
            logger.critical("worker %s: a loop died: %r", self.owner, cause, exc_info=cause)
            raise WorkerCrashed(f"worker loop died: {cause!r}") from cause
        logger.info("worker %s stopped", self.owner)

    async def _drain(self) -> None:
        """Give in-flight runs ``grace_s`` to finish, then cancel and release the rest."""
        tasks = [e.task for e in self._executions if e.task is not None]
        if tasks:
            logger.info("waiting up to %.1fs for %d running runs", self._grace_s, len(tasks))
            await asyncio.wait(tasks, timeout=self._grace_s)
        remaining = [e for e in self._executions if e.task is not None and not e.task.done()]
        for execution in remaining:
            execution.releasing = True
            assert execution.task is not None
            execution.task.cancel()
        await asyncio.gather(
            *(e.task for e in remaining if e.task is not None), return_exceptions=True
        )

    def _abandon_all(self) -> None:
        for execution in list(self._executions):
            execution.lost = True
            if execution.task is not None:
                execution.task.cancel()

    # --- claiming ----------------------------------------------------------------------------

    async def _claim_loop(self, lane: str, stop: asyncio.Event) -> None:
        """Claim whenever the lane may have work for a free slot, else wait.

        The loop claims again at once after a full batch; otherwise it waits for a wake-up
        (new work somewhere), the slow poll, or a local reason: a run of this worker went
        back to the queue with a retry delay that has now passed, or a slot was freed while
        the last claim had left runs behind for want of a tenant's free slot. A slot freed
        when the last claim found the lane empty wakes nobody: a claim then would find nothing
        the wake-ups would not announce, and on SQLite would still take the write lock.

        While it waits for a freed slot, ending runs hand it their outcomes, and its next claim
        writes them first, in the same transaction (:mod:`moorline.worker.handoffs`).
        """
        slots = self._lanes[lane]
        failures = 0
        try:
            while self._claiming:
                failures = await self._claim_once(lane, slots, failures, stop)
        except BaseException:
            for handed in self._handoffs.take(lane):
                # The worker is going down: their runs return through the reaper.
                handed.answer.cancel()
            raise
        # Handed as the loop stopped: the group commit writes them (it outlives the loops).
        await self._handoffs.to_completer(self._handoffs.take(lane))

    async def _claim_once(self, lane: str, slots: int, failures: int, stop: asyncio.Event) -> int:
        """One turn of :meth:`_claim_loop`: claim, or wait; the claim failures in a row."""
        handed = self._handoffs.take(lane)
        # The handed runs' slots are free once their outcomes commit, before the claim reads
        # (those of executions already finished, stopped by their self-fence, were freed then).
        free = slots - self._in_lane[lane] + sum(not h.execution.finished for h in handed)
        if free <= 0:
            self._wants_slot[lane] = True
            self._recheck[lane].clear()
            await self._wait_while(lane, self._recheck[lane].wait())
            return failures
        try:
            batch = await self._claim(lane, free, handed)
        except (DBAPIError, BackendUnavailable) as exc:
            # A dropped connection, a failover, a terminated backend: the worker outlives it. A
            # claim whose commit went through unseen only delays its runs until the reaper
            # hands them back (their lease names this worker, which never ran them).
            failures += 1
            delay_s = min(CLAIM_BACKOFF_MAX_S, CLAIM_BACKOFF_S * 2 ** (failures - 1))
            logger.warning(
                "claim in lane %s failed (%r); trying again in %.1fs", lane, exc, delay_s
            )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay_s):
                    await stop.wait()
            return failures
        self.claim_transactions += 1
        self._arm_self_fence([self._start(claim, lane) for claim in batch.claims])
        if len(batch.claims) < free and self._claiming:
            self._wants_slot[lane] = batch.is_capped
            if batch.is_capped and self._freed_at[lane] > batch.began_monotonic_s:
                # A slot freed during the claim woke nobody (``_wants_slot`` was the last
                # batch's answer), and the claim may have counted its run still running.
                return 0
            await self._wait_while(lane, self._wait_for_work(lane, batch.began_monotonic_s))
        return 0

    async def _claim(self, lane: str, free: int, handed: list[Handed[_Execution]]) -> ClaimBatch:
        """Claim up to ``free`` runs, after writing the ``handed`` outcomes in the same transaction.

        Handed outcomes that could not be written that way go through the group commit, which
        retries them; the claim's failure is raised as a lone claim's would be.
        """
        request = ClaimRequest(
            lane=lane,
            owner=self.owner,
            limit=free,
            lease_ttl_s=self._lease_ttl_s,
            tenant_caps=await self._tenant_caps(),
            workflows=self._workflows,
        )
        if not handed:
            return await self._queue.claim_as(request)
        try:
            outcomes = [item.outcome for item in handed]
            applied, batch = await self._handoffs_repo.finish_and_claim(outcomes, request)
        except (DBAPIError, BackendUnavailable):
            await self._handoffs.to_completer(handed)
            raise
        except BaseException:
            for item in handed:
                item.answer.cancel()
            raise
        for item in handed:
            # Committed: the slot is the claim's now (counted free above), not the ended run's,
            # unless the execution finished meanwhile and freed it itself (``_finish``).
            if not item.execution.finished:
                item.execution.slot_released = True
                self._in_lane[lane] -= 1
        self.handed_off += len(handed)
        self._handoffs.settle(handed, applied)
        return batch

    async def _complete(self, execution: _Execution, outcome: Outcome) -> bool:
        """Write ``outcome``: handed to the lane's loop if it waits for a slot, else grouped."""
        lane = execution.lane
        if self._claiming and self._waiting[lane] and self._wants_slot[lane]:
            answer = self._handoffs.hand(lane, execution, outcome)
            self._recheck[lane].set()
            return await answer
        return await self._completer.complete(outcome)

    async def _wait_while(self, lane: str, waiting: Awaitable[object]) -> None:
        """Await ``waiting`` with the lane's loop marked as waiting (it takes handoffs then)."""
        self._waiting[lane] = True
        try:
            await waiting
        finally:
            self._waiting[lane] = False

    async def _wait_for_work(self, lane: str, seen_before: float) -> None:
        """Until a wake-up for ``lane``, a local recheck (``stop`` sets one), or the slow poll.

        Wake-ups sent before ``seen_before``, when the last claim's transaction began,
        announced runs that claim saw already: they do not count.

        Everything that ends the wait sets the lane's ``recheck`` event, the waiter's answer
        included (from its task's done callback), so the loop awaits one event: a wake-up
        reaches the claim in three turns of the event loop, not the six that
        ``asyncio.wait`` over a task per reason, and then collecting the cancelled ones,
        took. Each turn is a wait behind every ready callback of a busy worker.
        """
        recheck = self._recheck[lane]
        if recheck.is_set():
            recheck.clear()
            return
        woken: asyncio.Future[bool] | None = None
        answered = partial(_answered, recheck)
        if self._waiter is not None:
            woken = asyncio.ensure_future(
                self._waiter.wait(lane, self._poll_interval_s, seen_before=seen_before)
            )
            woken.add_done_callback(answered)
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._poll_interval_s):
                    await recheck.wait()
        finally:
            if woken is not None:
                # Its answer no longer matters (one landing in this very turn still sets
                # ``recheck`` later: at most one spare claim).
                woken.remove_done_callback(answered)
                if not woken.done():
                    woken.cancel()
                elif not woken.cancelled() and woken.exception() is not None:
                    # A dead listener surfaces as from any other loop: the claim loop dies
                    # and the worker exits non-zero instead of spinning on a broken waiter.
                    woken.result()
            recheck.clear()

    def _wake_at(self, lane: str, delay_s: float) -> None:
        """Make ``lane``'s loop claim again in ``delay_s`` seconds (a retry becomes due)."""
        loop = asyncio.get_running_loop()

        def wake() -> None:
            self._retry_timers.discard(handle)
            self._recheck[lane].set()

        handle = loop.call_later(delay_s, wake)
        self._retry_timers.add(handle)

    def _cancel_retry_timers(self) -> None:
        for handle in self._retry_timers:
            handle.cancel()
        self._retry_timers.clear()

    def _start(self, claim: Claim, lane: str) -> _Execution:
        """Start executing ``claim``; the caller arms its self-fence with its batch's."""
        execution = _Execution(claim=claim, lane=lane)
        self._executions.add(execution)
        self._in_lane[lane] += 1
        self.claimed += 1
        run = claim.run
        # Both instants are database time: the claim set updated_at, the enqueue not_before.
        if not run.resumes:
            # A resumed run keeps its old not_before (its place in the lane): no queue wait.
            waited_s = (run.updated_at - run.not_before).total_seconds()
            self._latency_by_lane[lane].observe(max(0.0, waited_s))
        execution.task = asyncio.create_task(
            self._execute(execution), name=f"run:{claim.fence.run_id}:{claim.fence.attempt}"
        )
        return execution

    # --- one execution -----------------------------------------------------------------------

    async def _execute(self, execution: _Execution) -> None:
        claim = execution.claim
        # Every line logged by this attempt's task, and the tasks it starts, names the attempt.
        with bind_run(claim.fence.run_id, claim.fence.attempt, claim.run.tenant_id):
            await self._execute_bound(execution)

    async def _execute_bound(self, execution: _Execution) -> None:
        claim = execution.claim
        try:
            outcome = await self._attempt(execution)
            if outcome is not None and not execution.lost:
                applied = await self._complete(execution, outcome)
                if applied:
                    self._count_outcome(execution, outcome)
                    if claim.run.parent_run_id is not None:
                        await self._tell_parent(claim, outcome)
                    if isinstance(outcome, Failed) and outcome.retry_delay_s is not None:
                        # Claimable again once its delay has passed: look for it then
                        # rather than at the next poll.
                        self._wake_at(execution.lane, max(0.0, outcome.retry_delay_s))
                else:
                    self._count_lease_loss(execution)
                    logger.warning(
                        "run %s attempt %d: lease lost before its outcome was written",
                        claim.fence.run_id,
                        claim.fence.attempt,
                    )
            elif execution.releasing and not execution.lost:
                if await self._queue.release(claim.fence):
                    logger.info("run %s released at shutdown", claim.fence.run_id)
        except Exception:
            # The outcome could not be written: the run stays running under a lease nobody
            # renews once this execution is gone, and the reaper takes it back.
            logger.exception("run %s: could not record its outcome", claim.fence.run_id)
        finally:
            self._finish(execution)
            # After the outcome: the attempt's conversation lease and window go last.
            await self._release_runtime(claim)

    async def _tell_parent(self, claim: Claim, outcome: Outcome) -> None:
        """A child ended: have its parent told, in a batch with the others ending about now.

        The batch costs one transaction per parent, not one per child, and the child's slot
        is free before it is written; the timer sweep is the backstop if it never is.
        """
        if isinstance(outcome, Succeeded):
            status = RunStatus.SUCCEEDED
        elif isinstance(outcome, Failed):
            if outcome.retry_delay_s is not None:
                return  # queued again: not ended
            status = RunStatus.FAILED
        else:
            status = outcome.status
        self._ended_children.append(replace(claim.run, status=status))
        if self._waking is None or self._waking.done():
            self._waking = asyncio.create_task(self._wake_parents(), name="wake-parents")

    async def _wake_parents(self) -> None:
        while self._ended_children:
            await asyncio.sleep(WAKE_BATCH_S)  # the children ending about together
            ended, self._ended_children = self._ended_children, []
            # Parents joining in memory in this process read their children at once.
            self._runner.children_ended({r.parent_run_id for r in ended if r.parent_run_id})
            try:
                lanes = await self._children.wake_parents(ended)
            except Exception as exc:
                logger.warning("%d parents not told of their children: %r", len(ended), exc)
                continue
            for lane in lanes:
                if lane in self._recheck:
                    self._recheck[lane].set()
            if lanes and self._notifier is not None:
                await self._notifier.notify(lanes)

    def _count_outcome(self, execution: _Execution, outcome: Outcome) -> None:
        workflow = execution.claim.run.workflow
        name: str
        if isinstance(outcome, Succeeded):
            name = RunStatus.SUCCEEDED.value
        elif isinstance(outcome, Failed):
            name = RunStatus.FAILED.value if outcome.retry_delay_s is None else "retried"
            if outcome.retry_delay_s is not None:
                self._metrics.retries.labels(lane=execution.lane, workflow=workflow).inc()
        else:
            name = outcome.status.value
        elapsed_s = time.monotonic() - execution.started
        key = (execution.lane, workflow, name)
        duration = self._duration_by_outcome.get(key)
        if duration is None:
            labels = {"lane": execution.lane, "workflow": workflow, "outcome": name}
            duration = self._duration_by_outcome[key] = self._metrics.run_duration_s.labels(
                **labels
            )
        duration.observe(elapsed_s)

    def _count_lease_loss(self, execution: _Execution) -> None:
        self._metrics.lease_losses.labels(lane=execution.lane).inc()

    async def _release_runtime(self, claim: Claim) -> None:
        # Not shielded (a shield is a task per run): this runs after ``_finish``, and from then
        # on nothing cancels the execution's task, since heartbeats, self-fences, the drain
        # and the crash path all skip finished executions.
        try:
            await self._runner.release(claim)
        except Exception:
            logger.exception("run %s: could not release its runtime state", claim.fence.run_id)

    async def _attempt(self, execution: _Execution) -> Outcome | None:
        """Run the workflow once; its outcome, or None when it was cancelled by us."""
        claim = execution.claim
        # A returned workflow's last progress events, written with its outcome (a commit less).
        trailing: list[tuple[str, JSONObject]] = []
        try:
            output = await self._runner.run(
                claim, cancel_requested=execution.cancel_requested, trailing=trailing
            )
        except asyncio.CancelledError:
            if execution.lost or execution.releasing:
                return None
            raise
        except LeaseLost as lost:
            # A fenced write found the run taken over: this attempt writes nothing more.
            if not execution.lost:
                self._count_lease_loss(execution)
            execution.lost = True
            logger.info("run %s attempt %d stopped: %s", *_ids(claim), lost)
            return None
        except RunParked as parked:
            # The park is the outcome, written under the fence: the slot is free now.
            logger.debug("run %s attempt %d: %s", *_ids(claim), parked)
            self._metrics.parks.labels(lane=execution.lane, kind=parked.kind).inc()
            return None
        except Cancelled:
            logger.info("run %s attempt %d: cancelled", *_ids(claim))
            return Stopped(fence=claim.fence, status=RunStatus.CANCELLED, events=trailing)
        except TimeLimitExceeded as exc:
            logger.info("run %s attempt %d: %s", *_ids(claim), exc)
            error: JSONObject = {
                "type": type(exc).__name__,
                "message": str(exc),
                "reason": "timeout",
            }
            return Stopped(
                fence=claim.fence, status=RunStatus.TIMED_OUT, error=error, events=trailing
            )
        except Exception as exc:
            # Claims after a resume are no failures: they do not use up the budget.
            tries = claim.fence.attempt - claim.run.resumes
            decision = self._policy.decide(exc, tries, claim.run.max_attempts, self._rng)
            # WARNING with the stack: a failing workflow is the developer's to fix, and the
            # log has the whole traceback where the run's error keeps a bounded one.
            logger.warning(
                "run %s attempt %d failed (%s): %r",
                claim.fence.run_id,
                claim.fence.attempt,
                decision.reason,
                exc,
                exc_info=exc,
            )
            return Failed(
                fence=claim.fence,
                error=self._failures.describe(exc, reason=decision.reason),
                retry_delay_s=decision.delay_s if decision.retry else None,
                events=trailing,
            )
        return Succeeded(fence=claim.fence, output=output, events=trailing)

    def _finish(self, execution: _Execution) -> None:
        execution.finished = True
        self._leave_self_fence(execution)
        self._executions.discard(execution)
        if not execution.slot_released:
            self._in_lane[execution.lane] -= 1
            self._freed_at[execution.lane] = time.monotonic()
            if self._wants_slot[execution.lane]:
                self._recheck[execution.lane].set()
        self.finished += 1

    # --- leases ------------------------------------------------------------------------------

    def _arm_self_fence(
        self, executions: Iterable[_Execution], renewed_at: float | None = None
    ) -> None:
        """Stop ``executions`` at ``renewed_at + LEASE_TTL - margin`` (loop's monotonic clock).

        ``renewed_at`` is when the renewal was *sent*: the database extended the lease at some
        instant after it, so counting from the send errs on the safe side. Without it, now:
        the claim that took the leases has committed.
        """
        loop = asyncio.get_running_loop()
        since = loop.time() if renewed_at is None else renewed_at
        budget = self._lease_ttl_s * (1 - SELF_FENCE_MARGIN_FRACTION)
        fence = _SelfFence()
        for execution in executions:
            self._leave_self_fence(execution)
            execution.self_fence = fence
            fence.members.add(execution)
        if fence.members:
            fence.timer = loop.call_at(since + budget, self._self_fenced, fence)

    def _leave_self_fence(self, execution: _Execution) -> None:
        """Take ``execution`` off its deadline; the timer goes with the deadline's last one."""
        fence, execution.self_fence = execution.self_fence, None
        if fence is None:
            return
        fence.members.discard(execution)
        if not fence.members and fence.timer is not None:
            fence.timer.cancel()

    def _self_fenced(self, fence: _SelfFence) -> None:
        for execution in list(fence.members):
            self._lose(execution, "no renewal in time (self-fenced)")

    def _lose(self, execution: _Execution, why: str) -> None:
        if execution.lost or execution.finished:
            return
        execution.lost = True
        self._count_lease_loss(execution)
        fence = execution.claim.fence
        logger.warning(
            "run %s attempt %d: stopping, lease lost: %s",
            fence.run_id,
            fence.attempt,
            why,
            # Called from the heartbeat or a timer, outside the attempt's own task.
            extra={
                "run_id": fence.run_id,
                "attempt": fence.attempt,
                "tenant_id": execution.claim.run.tenant_id,
            },
        )
        if execution.task is not None and not execution.task.done():
            execution.task.cancel()

    async def _heartbeat_loop(self) -> None:
        try:
            while not self._closing.is_set():
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.heartbeat_interval_s):
                        await self._closing.wait()
                    return
                await self._renew_all()
        finally:
            if self._runtime_renewal is not None:
                self._runtime_renewal.cancel()

    async def _renew_all(self) -> None:
        held = [
            execution
            for execution in self._executions
            if not (execution.lost or execution.parked)
            and execution.task is not None
            and not execution.task.done()
        ]
        if not held:
            return
        sent = asyncio.get_running_loop().time()
        try:
            renewal = await self._queue.renew_leases(
                [execution.claim.fence for execution in held], self._lease_ttl_s
            )
        except Exception as exc:
            # The database is unreachable even after with_retry: try again at the next beat;
            # the self-fence deadlines stop the runs if this goes on.
            logger.warning("heartbeat for %d runs failed: %r", len(held), exc)
            return
        renewed: list[_Execution] = []
        for execution in held:
            if execution.finished:
                # It ended while the renewal ran: its lease went with its outcome, which is
                # neither a lease lost nor a reason to arm its self-fence again.
                continue
            fence = execution.claim.fence
            if (fence.run_id, fence.attempt) in renewal.renewed:
                if not execution.lost:
                    renewed.append(execution)
                if fence.run_id in renewal.cancel_requested:
                    execution.cancel_requested.set()
            elif (fence.run_id, fence.attempt) in renewal.parked:
                # The park took the lease, not another worker: let the workflow's clean-up
                # finish. Its fenced writes fail by themselves now; no self-fence is needed.
                execution.parked = True
                self._leave_self_fence(execution)
            else:
                self._lose(execution, "renewal matched no row (reclaimed, cancelled or finished)")
        self._arm_self_fence(renewed, sent)
        # In its own task: a slow RuntimeStore must never delay the next database heartbeat.
        if self._runtime_renewal is None or self._runtime_renewal.done():
            kept = [e.claim for e in held if not (e.lost or e.finished or e.parked)]
            self._runtime_renewal = asyncio.create_task(
                self._renew_runtime(kept), name="runtime-renewal"
            )

    async def _renew_runtime(self, claims: list[Claim]) -> None:
        try:
            await self._runner.renew(claims)
        except Exception as exc:
            logger.warning("runtime renewal for %d runs failed: %r", len(claims), exc)
