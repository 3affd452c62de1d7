"""The worker's leases: the heartbeat that renews them, and the self-fence that stops runs.

- **Heartbeat.** Every ``LEASE_TTL/3``, one statement renews every held lease, fenced by (run,
  attempt, owner, running). A lease it does not renew is gone (reaped, cancelled): its
  execution is cancelled at once and writes nothing more. A renewed run whose cancel the
  database reports gets its ``cancel_requested`` set, so a lost cancel signal costs at most one
  interval. The same beat then renews the runtime state of the attempts still held
  (conversation leases, interactive windows), in a task of its own.
- **Self-fence.** Each execution has a deadline on the monotonic clock, pushed back by every
  successful renewal: ``last renewal + LEASE_TTL - margin``, one timer per claimed batch and
  per renewal, shared by the executions it covers. When the database could not be reached in
  time (or the process was paused), the deadline cancels the execution before the lease can
  expire, so a worker never keeps working on a run another may have taken.
"""

import asyncio
import logging
from collections.abc import Iterable, Set

from moorline.concurrency import is_set_within
from moorline.db.repos.queue import Claim, QueueRepo
from moorline.engine.runner import Runner
from moorline.observability.metrics import Metrics
from moorline.worker.executions import Execution, SelfFence

logger = logging.getLogger(__name__)

SELF_FENCE_MARGIN_FRACTION = 1 / 6
"""Share of LEASE_TTL kept in hand: with heartbeats every TTL/3, a worker that missed two
renewals stops the run at 5/6 of the TTL, before the reaper can see the lease expire."""


class LeaseKeeper:
    """Renews the leases of a worker's executions, and stops those it cannot keep."""

    def __init__(
        self,
        queue: QueueRepo,
        runner: Runner,
        metrics: Metrics,
        *,
        lease_ttl_s: float,
        executions: Set[Execution],
    ) -> None:
        """Keep the leases of ``executions``, the worker's running set (read, never changed)."""
        self._queue = queue
        self._runner = runner
        self._metrics = metrics
        self._lease_ttl_s = lease_ttl_s
        self._executions = executions
        self._runtime_renewal: asyncio.Task[None] | None = None

    @property
    def interval_s(self) -> float:
        """Seconds between two renewals of every held lease."""
        return self._lease_ttl_s / 3

    async def run(self, closing: asyncio.Event) -> None:
        """Renew every held lease each interval until ``closing`` is set."""
        try:
            while not await is_set_within(closing, self.interval_s):
                await self.renew_all()
        finally:
            if self._runtime_renewal is not None:
                self._runtime_renewal.cancel()

    def arm(self, executions: Iterable[Execution], renewed_at: float | None = None) -> None:
        """Stop ``executions`` at ``renewed_at + LEASE_TTL - margin`` (loop's monotonic clock).

        ``renewed_at`` is when the renewal was *sent*: the database extended the lease at some
        instant after it, so counting from the send errs on the safe side. Without it, now:
        the claim that took the leases has committed.
        """
        loop = asyncio.get_running_loop()
        since = loop.time() if renewed_at is None else renewed_at
        budget = self._lease_ttl_s * (1 - SELF_FENCE_MARGIN_FRACTION)
        fence = SelfFence()
        for execution in executions:
            self.leave(execution)
            execution.self_fence = fence
            fence.members.add(execution)
        if fence.members:
            fence.timer = loop.call_at(since + budget, self._self_fenced, fence)

    def holds(self, execution: Execution) -> bool:
        """Whether ``execution``'s lease is held by this worker's own clock.

        Not lost, and its self-fence deadline still ahead: a process resumed after a pause
        finds the deadline passed here even before the deadline's timer has fired.
        """
        fence = execution.self_fence
        if execution.lost or fence is None or fence.timer is None:
            return False
        return fence.timer.when() > asyncio.get_running_loop().time()

    def leave(self, execution: Execution) -> None:
        """Take ``execution`` off its deadline; the timer goes with the deadline's last one."""
        fence, execution.self_fence = execution.self_fence, None
        if fence is None:
            return
        fence.members.discard(execution)
        if not fence.members and fence.timer is not None:
            fence.timer.cancel()

    def count_loss(self, execution: Execution) -> None:
        """Count a lease lost in ``execution``'s lane (``moorline_lease_losses_total``)."""
        self._metrics.lease_losses.labels(lane=execution.lane).inc()

    def lose(self, execution: Execution, why: str) -> None:
        """The lease is gone: stop ``execution`` at once; it writes nothing more."""
        if execution.lost or execution.finished:
            return
        execution.lost = True
        self.count_loss(execution)
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

    def _self_fenced(self, fence: SelfFence) -> None:
        for execution in list(fence.members):
            self.lose(execution, "no renewal in time (self-fenced)")

    async def renew_all(self) -> None:
        """One heartbeat: renew every held lease, in one statement."""
        held = [execution for execution in self._executions if execution.is_held]
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
        renewed: list[Execution] = []
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
                self.leave(execution)
            else:
                self.lose(execution, "renewal matched no row (reclaimed, cancelled or finished)")
        self.arm(renewed, sent)
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
