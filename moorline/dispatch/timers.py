"""The timer sweep: re-queues waiting runs whose timer is due (seed 000's durable timers).

A parked run's timer is a column (``wake_at``), not a process that has to stay alive: every
worker process runs this loop, and the one that leads (its own leader lease, ``timers``) moves,
every ``MOORLINE_TIMER_INTERVAL`` seconds, the waiting runs whose time has come
(:meth:`~moorline.db.repos.parking.ParkingRepo.resume_due`): back to ``queued`` (a sleep ended,
a permission or a message wait timed out) or ``timed_out`` (past the run's deadline). Then it
wakes the lanes that got runs back. Timer precision is therefore the interval, plus one claim.
"""

import asyncio
import logging
from collections import Counter

from moorline.db.manager import DatabaseManager
from moorline.db.repos.children import ChildrenRepo
from moorline.db.repos.parking import DEFAULT_SWEEP_LIMIT, ParkingRepo, Resumed
from moorline.db.repos.queue import QueueRepo
from moorline.db.repos.runs import RunsRepo
from moorline.dispatch.chores import LeaderChore
from moorline.dispatch.leader import LeaderElector, new_holder_id
from moorline.dispatch.reaper import leader_ttl_s
from moorline.dispatch.wakeups import Notifier
from moorline.errors import RunFinished
from moorline.observability.metrics import Metrics
from moorline.settings import Settings
from moorline.types import RunStatus

logger = logging.getLogger(__name__)

LEADER_LEASE = "timers"
"""Name of the timer sweep's row in ``leader_leases``."""


class TimerSweep(LeaderChore):
    """Every ``interval_s``: if this process leads, move the waiting runs whose timer is due."""

    name = "timer sweep"

    def __init__(
        self,
        parking: ParkingRepo,
        elector: LeaderElector,
        *,
        interval_s: float,
        batch_limit: int = DEFAULT_SWEEP_LIMIT,
        notifier: Notifier | None = None,
        metrics: Metrics | None = None,
        children: ChildrenRepo | None = None,
        runs: RunsRepo | None = None,
    ) -> None:
        super().__init__(elector, interval_s=interval_s)
        self._parking = parking
        self._children = children
        self._runs = runs
        self._batch_limit = batch_limit
        self._notifier = notifier
        self._resumes = (metrics or Metrics()).resumes

    async def tick(self) -> list[Resumed]:
        """One pass: nothing unless this process leads, else move every due waiting run."""
        return await self._pass(None)

    async def _pass(self, stop: asyncio.Event | None) -> list[Resumed]:
        if not await self.elector.tick():
            return []
        moved: list[Resumed] = []
        lanes: set[str] = set()
        try:
            while stop is None or not stop.is_set():
                batch = await self._parking.resume_due(limit=self._batch_limit)
                moved.extend(batch)
                if len(batch) < self._batch_limit:
                    break
            lanes = await self._settle_children()
        finally:
            lanes = {r.lane for r in moved if r.status is RunStatus.QUEUED} | lanes
            if lanes and self._notifier is not None:
                await self._notifier.notify(lanes)
        for run in moved:
            self._resumes.labels(lane=run.lane, status=run.status.value).inc()
        if moved:
            outcomes = Counter(r.status.value for r in moved)
            logger.info(
                "timer sweep moved %d waiting runs (%s)",
                len(moved),
                ", ".join(f"{n} {status}" for status, n in sorted(outcomes.items())),
            )
        return moved

    async def _settle_children(self) -> set[str]:
        """The backstop of child runs: wake parents whose children all ended, cancel orphans.

        A child's worker wakes its parent when it writes the child's end; children ended by
        the reaper, a cancel or a deadline, or a waker that died, are caught here. Attached
        children of a parent that ended (failed, timed out) are cancelled.
        """
        if self._children is None:
            return set()
        lanes = await self._children.wake_ready_parents()
        if self._runs is not None:
            for orphan in await self._children.orphans():
                try:
                    await self._runs.request_cancel(orphan.tenant_id, orphan.run_id)
                except RunFinished:
                    pass
        return lanes


def make_timer_sweep(
    settings: Settings,
    db: DatabaseManager,
    *,
    holder: str | None = None,
    notifier: Notifier | None = None,
    metrics: Metrics | None = None,
) -> TimerSweep:
    """A timer sweep for this process, with ``timer_interval`` and a leader lease to match."""
    interval_s = settings.timer_interval
    elector = LeaderElector(
        QueueRepo(db),
        name=LEADER_LEASE,
        holder=holder if holder is not None else new_holder_id(),
        ttl_s=leader_ttl_s(interval_s, settings.lease_ttl),
    )
    return TimerSweep(
        ParkingRepo(db),
        elector,
        interval_s=interval_s,
        notifier=notifier,
        metrics=metrics,
        children=ChildrenRepo(db),
        runs=RunsRepo(db),
    )
