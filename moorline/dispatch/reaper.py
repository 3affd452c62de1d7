"""The reaper: puts runs whose worker stopped renewing back to work (seed 001, made safe).

Every worker process runs the loop; only the leader acts (see :mod:`moorline.dispatch.leader`).
Leadership only saves work: each batch of reclaims is one transaction whose UPDATEs carry the
eligibility predicate on the rows they change (see
:meth:`moorline.db.repos.queue.QueueRepo.reap_expired`), fenced by the attempt and the lease
still being expired by *database* time, so two reapers acting at once (two processes that both
think they lead) still move each run once, and a worker whose clock is off cannot get a live
run reaped. A run whose attempts are used up ends ``failed`` with reason ``max attempts``
instead of being requeued, so a run that kills its worker every time cannot loop forever; one
whose cancellation was requested ends ``cancelled``.

The loop survives the database going away (a restart, a failover, killed connections): such a
pass is logged and the next one comes an interval later. Anything else is a bug and ends the
loop with the error, for the process's supervisor to report.
"""

import asyncio
import logging
from collections import Counter
from collections.abc import Callable

from moorline.db.manager import DatabaseManager
from moorline.db.repos.queue import DEFAULT_REAP_LIMIT, QueueRepo, Reaped
from moorline.dispatch.chores import LeaderChore
from moorline.dispatch.chores import is_transient_error as is_transient_error
from moorline.dispatch.leader import VERIFY_EVERY_TICKS, LeaderElector, new_holder_id
from moorline.dispatch.wakeups import Notifier
from moorline.observability.metrics import Metrics
from moorline.settings import Settings
from moorline.types import Attempt, RunStatus

logger = logging.getLogger(__name__)

LEADER_LEASE = "reaper"
"""Name of the reaper's row in ``leader_leases``."""


def leader_ttl_s(interval_s: float, lease_ttl_s: float) -> float:
    """The reaper's leader lease TTL for a reaper interval and a run lease TTL.

    Ten intervals when possible: the elector verifies a cached leadership after half its TTL
    at the latest, so this lets one verification answer for :data:`VERIFY_EVERY_TICKS`
    ticks. At most two thirds of the run lease: a leader killed without resigning (kill -9)
    stops renewing the leader lease and its runs' leases at about the same time, and its runs
    expire no sooner than two thirds of a run lease later (heartbeats come every third), so
    a successor leads by the time they can be reaped. Never under three intervals, so a live
    leader always renews in time. With the defaults (5 s, 90 s) it is 50 s.
    """
    cached_ticks = 2 * VERIFY_EVERY_TICKS * interval_s
    return max(3 * interval_s, min(cached_ticks, lease_ttl_s * 2 / 3))


class Reaper(LeaderChore):
    """Every ``interval_s``: if this process leads, take back every run with an expired lease."""

    name = "reaper"

    def __init__(
        self,
        queue: QueueRepo,
        elector: LeaderElector,
        *,
        interval_s: float,
        batch_limit: int = DEFAULT_REAP_LIMIT,
        backoff: Callable[[Attempt], float] | None = None,
        notifier: Notifier | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        """Create a reaper; see :func:`make_reaper` for one built from the settings.

        Args:
            queue: The dispatch repository.
            elector: Decides whether this process acts; the reaper resigns it on stop.
            interval_s: Seconds between passes (``MOORLINE_REAPER_INTERVAL``).
            batch_limit: Expired runs read per statement; a pass reads batches until one
                comes back short.
            backoff: Seconds before a reclaimed run is claimable again, by its attempt;
                None for at once.
            notifier: Told once per pass about the lanes that got runs back, so idle workers
                claim them at once instead of on their slow poll.
            metrics: Where reclaims are counted; default a private set nobody scrapes.
        """
        if batch_limit < 1:
            raise ValueError("batch_limit must be at least 1")
        super().__init__(elector, interval_s=interval_s)
        self._queue = queue
        self._batch_limit = batch_limit
        self._backoff = backoff
        self._notifier = notifier
        self._reclaims = (metrics or Metrics()).reclaims

    async def tick(self) -> list[Reaped]:
        """One pass: nothing unless this process leads, else take back the expired runs.

        Batch after batch of ``batch_limit``, until one comes back short (the expired runs are
        used up, or another reaper is taking them too).

        Returns:
            The runs this pass moved (runs another reaper moved first are not among them).

        Raises:
            Exception: A database error that ``with_retry`` did not cure, or a bug.
        """
        return await self._pass(None)

    async def _pass(self, stop: asyncio.Event | None) -> list[Reaped]:
        if not await self.elector.tick():
            return []
        reaped: list[Reaped] = []
        try:
            # A short batch ends the pass: either the expired runs are used up, or another
            # reaper (a second process that believes it leads) is moving the same runs. Then
            # stepping back until the next pass beats racing it for rows it has locked.
            while stop is None or not stop.is_set():
                batch = await self._queue.reap_expired(
                    limit=self._batch_limit, backoff=self._backoff
                )
                reaped.extend(batch)
                if len(batch) < self._batch_limit:
                    break
        finally:
            # Also after an error mid-pass: the runs moved so far are claimable now.
            await self._notify(reaped)
        for run in reaped:
            self._reclaims.labels(lane=run.lane, status=run.status.value).inc()
        if reaped:
            outcomes = Counter(r.status.value for r in reaped)
            logger.info(
                "reaper took back %d runs with expired leases (%s)",
                len(reaped),
                ", ".join(f"{n} {status}" for status, n in sorted(outcomes.items())),
            )
        return reaped

    async def _notify(self, reaped: list[Reaped]) -> None:
        lanes = {r.lane for r in reaped if r.status is RunStatus.QUEUED}
        if lanes and self._notifier is not None:
            await self._notifier.notify(lanes)


def make_reaper(
    settings: Settings,
    db: DatabaseManager,
    *,
    holder: str | None = None,
    notifier: Notifier | None = None,
    backoff: Callable[[Attempt], float] | None = None,
    metrics: Metrics | None = None,
) -> Reaper:
    """A reaper for this process, with the intervals and leader lease of ``settings``.

    Args:
        settings: ``reaper_interval`` and ``lease_ttl`` are read.
        db: The database of the runs and the leader lease.
        holder: This process's leader id; a new unique one when None.
        notifier: Told about lanes that got runs back.
        backoff: Seconds before a reclaimed run is claimable again; None for at once.
        metrics: Where reclaims are counted.
    """
    interval_s = settings.reaper_interval
    queue = QueueRepo(db)
    elector = LeaderElector(
        queue,
        name=LEADER_LEASE,
        holder=holder if holder is not None else new_holder_id(),
        ttl_s=leader_ttl_s(interval_s, settings.lease_ttl),
    )
    return Reaper(
        queue,
        elector,
        interval_s=interval_s,
        backoff=backoff,
        notifier=notifier,
        metrics=metrics,
    )
