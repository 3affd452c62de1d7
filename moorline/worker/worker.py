"""The worker: lanes with their own slots, claims, heartbeats, self-fencing, graceful shutdown.

One :class:`Worker` per process (or per in-process loop of ``moorline serve``):

- **Served workflows.** A worker claims only runs of the workflows its app registers
  (``workflows``), and announces them with its lanes in a ``workers`` row renewed every
  ``LEASE_TTL/3`` (:mod:`moorline.worker.presence`): in a rolling deploy a run of a workflow
  the new app lacks stays ``queued`` and shows as unserved instead of failing.
- **Lanes and slots** (:mod:`moorline.worker.lanes`). Each lane has its own slots and its
  own claim loop, which claims as many runs as it has free slots in one transaction, then
  waits for a wake-up, the slow poll, or a local reason to look again.
- **Leases** (:mod:`moorline.worker.leases`). A heartbeat renews every held lease each
  ``LEASE_TTL/3``; a lease it does not renew is gone, and its execution is cancelled at once.
  Each execution also has a self-fence deadline, pushed back by every renewal, that stops it
  before its lease can expire when the database could not be reached in time.
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
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import moorline
from moorline.db.manager import DatabaseManager
from moorline.db.repos.children import ChildrenRepo
from moorline.db.repos.handoffs import HandoffsRepo
from moorline.db.repos.queue import Claim, QueueRepo
from moorline.db.repos.records import Run
from moorline.db.repos.runs import Failed, Outcome, RunsRepo, Stopped, Succeeded
from moorline.db.repos.steps import LeaseLost
from moorline.db.repos.workers import WorkerEntry, WorkersRepo
from moorline.dispatch.retry import RetryPolicy
from moorline.dispatch.wakeups import Notifier
from moorline.engine.context import Cancelled
from moorline.engine.failures import FailureDescriber
from moorline.engine.runner import Runner
from moorline.errors import MoorlineError, RunParked, TimeLimitExceeded
from moorline.observability.logs import bind_run
from moorline.observability.metrics import Metrics
from moorline.types import JSONObject, RunStatus
from moorline.worker.completions import Completer
from moorline.worker.executions import Execution
from moorline.worker.handoffs import Handoffs
from moorline.worker.lanes import Claiming, Lane, Waiter
from moorline.worker.leases import LeaseKeeper
from moorline.worker.presence import Presence

logger = logging.getLogger(__name__)

DEFAULT_POLL_INTERVAL_S = 1.0
DEFAULT_GRACE_S = 30.0
WAKE_BATCH_S = 0.01
"""How long children's ends are gathered before their parents are told, in seconds."""


class WorkerCrashed(MoorlineError):
    """A long-lived worker loop died; the process should exit non-zero."""

    code = "worker_crashed"


def _ids(claim: Claim) -> tuple[str, int]:
    return claim.fence.run_id, claim.fence.attempt


def make_owner_id() -> str:
    """A lease owner id unique to this worker: host, process and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


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
        self._slots = dict(lanes)
        self._policy = retry_policy or RetryPolicy()
        self.owner = owner or make_owner_id()
        self._workflows = None if workflows is None else sorted(set(workflows))
        self._presence = Presence(
            WorkersRepo(db),
            WorkerEntry(
                worker_id=self.owner,
                host=socket.gethostname(),
                pid=os.getpid(),
                lanes=self._slots,
                workflows=self._workflows,
                version=moorline.__version__,
            ),
            ttl_s=lease_ttl_s,
        )
        self._grace_s = grace_s
        self._rng = rng or random.Random()
        self._metrics = metrics or Metrics()
        self._completer = Completer(self._runs)
        self._executions: set[Execution] = set()
        self._leases = LeaseKeeper(
            self._queue,
            runner,
            self._metrics,
            lease_ttl_s=lease_ttl_s,
            executions=self._executions,
        )
        handoffs: Handoffs[Execution] = Handoffs(list(self._slots), self._completer)
        claiming = Claiming(
            queue=self._queue,
            handoffs_repo=HandoffsRepo(db),
            owner=self.owner,
            lease_ttl_s=lease_ttl_s,
            tenant_caps=tenant_caps,
            workflows=self._workflows,
            waiter=waiter,
            poll_interval_s=poll_interval_s,
        )
        self._lanes = {
            lane: Lane(
                lane,
                slots,
                claiming,
                handoffs=handoffs,
                completer=self._completer,
                start=partial(self._start_batch, lane),
            )
            for lane, slots in self._slots.items()
        }
        self._failures = FailureDescriber(secrets)
        self._children = ChildrenRepo(db)
        self._notifier = notifier
        self._ended_children: list[Run] = []
        """Children whose end their parents have not been told of yet."""
        self._waking: asyncio.Task[None] | None = None
        self._retry_timers: set[asyncio.TimerHandle] = set()
        # prometheus-client's labels() takes a lock and builds a key per call: once per lane.
        self._latency_by_lane = {
            lane: self._metrics.dispatch_latency_s.labels(lane=lane) for lane in self._lanes
        }
        self._duration_by_outcome: dict[tuple[str, str, str], Any] = {}
        self._closing = asyncio.Event()
        self.claimed = 0
        self.finished = 0

    @property
    def heartbeat_interval_s(self) -> float:
        """Seconds between two renewals of every held lease."""
        return self._leases.interval_s

    @property
    def claim_transactions(self) -> int:
        """Claims made so far, empty ones included."""
        return sum(lane.claim_transactions for lane in self._lanes.values())

    @property
    def handed_off(self) -> int:
        """Outcomes committed with their lane's next claim (:mod:`moorline.worker.handoffs`)."""
        return sum(lane.handed_off for lane in self._lanes.values())

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
            ", ".join(f"{lane}={slots}" for lane, slots in self._slots.items()),
        )
        # Announced before the first claim, so a run it claims never shows as unserved.
        await self._presence.beat()
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._completer.run(), name="completer")
                group.create_task(self._leases.run(self._closing), name="heartbeat")
                group.create_task(self._presence.run(stop), name="presence")
                claimers = [
                    group.create_task(lane.run(stop), name=f"claim:{name}")
                    for name, lane in self._lanes.items()
                ]
                await stop.wait()
                for lane in self._lanes.values():
                    lane.stop_claiming()
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

    def _wake_at(self, lane: str, delay_s: float) -> None:
        """Make ``lane``'s loop claim again in ``delay_s`` seconds (a retry becomes due)."""
        loop = asyncio.get_running_loop()

        def wake() -> None:
            self._retry_timers.discard(handle)
            self._lanes[lane].wake()

        handle = loop.call_later(delay_s, wake)
        self._retry_timers.add(handle)

    def _cancel_retry_timers(self) -> None:
        for handle in self._retry_timers:
            handle.cancel()
        self._retry_timers.clear()

    def _start_batch(self, lane: str, claims: Sequence[Claim]) -> None:
        """Start executing a claimed batch, under one self-fence deadline."""
        self._leases.arm([self._start(claim, lane) for claim in claims])

    def _start(self, claim: Claim, lane: str) -> Execution:
        """Start executing ``claim`` (its lane counted its slot taken)."""
        execution = Execution(claim=claim, lane=lane)
        self._executions.add(execution)
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

    async def _execute(self, execution: Execution) -> None:
        claim = execution.claim
        # Every line logged by this attempt's task, and the tasks it starts, names the attempt.
        with bind_run(claim.fence.run_id, claim.fence.attempt, claim.run.tenant_id):
            await self._execute_bound(execution)

    async def _execute_bound(self, execution: Execution) -> None:
        claim = execution.claim
        try:
            outcome = await self._attempt(execution)
            if outcome is not None and not execution.lost:
                applied = await self._lanes[execution.lane].complete(execution, outcome)
                if applied:
                    self._count_outcome(execution, outcome)
                    if claim.run.parent_run_id is not None:
                        await self._tell_parent(claim, outcome)
                    if isinstance(outcome, Failed) and outcome.retry_delay_s is not None:
                        # Claimable again once its delay has passed: look for it then
                        # rather than at the next poll.
                        self._wake_at(execution.lane, max(0.0, outcome.retry_delay_s))
                else:
                    self._leases.count_loss(execution)
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
                if lane in self._lanes:
                    self._lanes[lane].wake()
            if lanes and self._notifier is not None:
                await self._notifier.notify(lanes)

    def _count_outcome(self, execution: Execution, outcome: Outcome) -> None:
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

    async def _release_runtime(self, claim: Claim) -> None:
        # Not shielded (a shield is a task per run): this runs after ``_finish``, and from then
        # on nothing cancels the execution's task, since heartbeats, self-fences, the drain
        # and the crash path all skip finished executions.
        try:
            await self._runner.release(claim)
        except Exception:
            logger.exception("run %s: could not release its runtime state", claim.fence.run_id)

    async def _attempt(self, execution: Execution) -> Outcome | None:
        """Run the workflow once; its outcome, or None when it was cancelled by us."""
        claim = execution.claim
        # A returned workflow's last progress events, written with its outcome (a commit less).
        trailing: list[tuple[str, JSONObject]] = []
        try:
            output = await self._runner.run(
                claim,
                cancel_requested=execution.cancel_requested,
                trailing=trailing,
                lease_held=lambda: self._leases.holds(execution),
            )
        except asyncio.CancelledError:
            if execution.lost or execution.releasing:
                return None
            raise
        except LeaseLost as lost:
            # A fenced write found the run taken over: this attempt writes nothing more.
            if not execution.lost:
                self._leases.count_loss(execution)
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

    def _finish(self, execution: Execution) -> None:
        execution.finished = True
        self._leases.leave(execution)
        self._executions.discard(execution)
        if not execution.slot_released:
            self._lanes[execution.lane].freed()
        self.finished += 1
