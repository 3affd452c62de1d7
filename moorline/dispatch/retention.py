"""The retention cleaner: deletes finished runs past their plan's retention (issue 20, item 2).

A leader-elected chore like the reaper and the timer sweep (its own leader lease,
``retention``). Every ``MOORLINE_RETENTION_INTERVAL`` seconds the leader walks the finished
runs oldest first, ``MOORLINE_RETENTION_BATCH`` of them per transaction
(:meth:`~moorline.db.repos.retention.RetentionRepo.delete_batch`), and pauses
``MOORLINE_RETENTION_PAUSE`` seconds between two batches, and at least four times as long as
the batch took (:data:`PAUSE_PER_BUSY_S`): each transaction is short, and the pause leaves the
database (on SQLite, its one write lock) to the runs being dispatched, so the hot path does not
notice a large backlog being deleted. A batch is cut while its transaction lasts over
:data:`MAX_HOLD_S`. Where the backend can tell that nothing else committed during a pause
(SQLite's ``data_version``), the database is the cleaner's alone: batches may then last up to
:data:`ALONE_MAX_HOLD_S` with a pause as long as the batch, so a backlog of a million runs goes
in minutes, not hours, until the next write from elsewhere brings the short batches back.
Leadership is checked again before every batch, so a pass over a large backlog stops soon
after another process takes over.

On SQLite each batch is followed by an incremental vacuum of the pages it freed (at most
:data:`VACUUM_PAGES_PER_BATCH`), so the file shrinks as it goes, never in one blocking VACUUM.
PostgreSQL and MariaDB make the space reusable themselves (autovacuum, InnoDB purge).
"""

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from moorline.db.manager import DatabaseManager
from moorline.db.repos.queue import QueueRepo
from moorline.db.repos.retention import Cursor, RetentionPolicy, RetentionRepo
from moorline.dispatch.chores import LeaderChore
from moorline.dispatch.leader import LeaderElector, new_holder_id
from moorline.dispatch.reaper import leader_ttl_s
from moorline.plans import PlansProvider
from moorline.settings import Settings

logger = logging.getLogger(__name__)

LEADER_LEASE = "retention"
"""Name of the retention cleaner's row in ``leader_leases``."""

VACUUM_PAGES_PER_BATCH = 4096
"""Most SQLite pages (16 MiB at 4 KiB) one incremental vacuum gives back after a batch.

A batch of 500 runs with their steps and events frees far fewer; the bound only keeps one
vacuum short when a file starts with a large free list."""

PAUSE_PER_BUSY_S = 4.0
"""Seconds of pause after each second a batch took, at least: the cleaner keeps the database
(and, in its process, the event loop) busy a fifth of the time at most, however slow a batch
is on this machine and with this load; ``MOORLINE_RETENTION_PAUSE`` is the least pause."""

MAX_HOLD_S = 0.005
"""Longest deleting transaction wanted: on SQLite a dispatch behind its write lock waits that
long; on the servers nothing waits for its locks, but the deletion's work (its cascades, its
WAL, its rows in this process's loop) slows the dispatch beside it for as long."""

MIN_BATCH = 20
"""Fewest runs a batch examines however slow deletions are."""

ALONE_MAX_HOLD_S = 0.1
"""Longest deleting transaction wanted while nothing else writes to the database: a write
that arrives unannounced waits this long once, and the next batch is cut to MAX_HOLD_S."""

ALONE_PAUSE_S = 0.01
"""Least pause between two batches while nothing else writes; the pause is at least as long
as the batch took, so the cleaner keeps the database at most half the time even then."""

PolicySource = Callable[[], Awaitable[RetentionPolicy]]
"""Reads the retention in force (the plans file may change between passes)."""


class RetentionCleaner(LeaderChore):
    """Every ``interval_s``: if this process leads, delete the runs past their retention."""

    name = "retention cleaner"

    def __init__(
        self,
        db: DatabaseManager,
        elector: LeaderElector,
        policy: PolicySource,
        *,
        interval_s: float,
        batch: int = 500,
        pause_s: float = 0.2,
    ) -> None:
        """Create a cleaner; see :func:`make_retention_cleaner` for one from the settings.

        Args:
            db: The database of the runs (and, on SQLite, the file to shrink).
            elector: Decides whether this process acts; asked again before every batch.
            policy: The retention in force, read at the start of each pass.
            interval_s: Seconds between passes.
            batch: Runs examined (at most deleted) per transaction.
            pause_s: Seconds between two batches of a pass.
        """
        if batch < 1 or pause_s < 0:
            raise ValueError("batch must be at least 1 and pause_s not negative")
        super().__init__(elector, interval_s=interval_s)
        self._db = db
        self._repo = RetentionRepo(db)
        self._policy = policy
        self._batch = batch
        self._pause_s = pause_s

    async def tick(self) -> Counter[str]:
        """One whole pass (no pause is cut short); what it deleted, rows by table."""
        return await self._pass(None)

    async def _pass(self, stop: asyncio.Event | None) -> Counter[str]:
        deleted: Counter[str] = Counter()
        if not await self.elector.tick():
            return deleted
        policy = await self._policy()
        after: Cursor | None = None
        freed = 0
        limit = self._batch
        alone = False
        while True:
            started = time.monotonic()
            batch = await self._repo.delete_batch(policy, after=after, limit=limit)
            deleted.update(batch.deleted)
            if batch.runs:
                freed += await self._db.reclaim_space(VACUUM_PAGES_PER_BATCH)
            if batch.next is None:
                break
            busy_s = time.monotonic() - started
            version = await self._db.data_version()
            if alone:
                pause_s = max(ALONE_PAUSE_S, busy_s)
            else:
                pause_s = max(self._pause_s, busy_s * PAUSE_PER_BUSY_S)
            if await self._pause(stop, pause_s):
                break
            # Alone: nothing else committed during the pause (the backend can tell: SQLite).
            alone = version is not None and await self._db.data_version() == version
            limit = self._next_limit(limit, batch.held_s, alone=alone)
            if not await self.elector.tick():
                break
            after = batch.next
        if deleted:
            logger.info(
                "retention cleaner deleted %d finished runs (%s); %d file pages given back",
                deleted["runs"],
                ", ".join(f"{n} {table}" for table, n in sorted(deleted.items())),
                freed,
            )
        return deleted

    def _next_limit(self, limit: int, held_s: float, *, alone: bool = False) -> int:
        """The next batch's size: cut while a deleting transaction lasts too long.

        On SQLite a claim or a submit waits for the whole deleting transaction (its one write
        lock), so its length is what dispatch latency sees; on a loaded machine 500 runs took
        50-150 ms. On the servers nothing waits for its row locks, yet a 500-run deletion
        beside a busy drain doubled the dispatch's p99 all the same, where 50-run ones did not
        (docs/performance.md). Too long, the size is cut in proportion (at once, as a busy
        database just started to write again); doubled back, up to ``batch``, while
        transactions are short. ``alone`` (nothing else wrote meanwhile) allows transactions up
        to :data:`ALONE_MAX_HOLD_S`.
        """
        if held_s == 0.0:
            return limit
        most_s = ALONE_MAX_HOLD_S if alone else MAX_HOLD_S
        if held_s > most_s:
            return max(MIN_BATCH, min(limit // 2, int(limit * most_s / held_s)))
        if held_s < most_s / 2:
            return min(self._batch, limit * 2)
        return limit

    async def _pause(self, stop: asyncio.Event | None, pause_s: float) -> bool:
        """Wait ``pause_s`` between batches; whether ``stop`` was set meanwhile."""
        if stop is None:
            await asyncio.sleep(pause_s)
            return False
        try:
            async with asyncio.timeout(pause_s):
                await stop.wait()
        except TimeoutError:
            return False
        return True


def policy_source(settings: Settings, plans: PlansProvider) -> PolicySource:
    """The retention of the current plans, ``MOORLINE_RETENTION_DAYS`` for the others."""

    async def read() -> RetentionPolicy:
        return RetentionPolicy(
            default_days=settings.retention_days, plan_days=await plans.retention_days()
        )

    return read


def make_retention_cleaner(
    settings: Settings,
    db: DatabaseManager,
    plans: PlansProvider,
    *,
    holder: str | None = None,
) -> RetentionCleaner:
    """A retention cleaner for this process, from ``settings``' retention fields."""
    interval_s = settings.retention_interval
    elector = LeaderElector(
        QueueRepo(db),
        name=LEADER_LEASE,
        holder=holder if holder is not None else new_holder_id(),
        ttl_s=leader_ttl_s(interval_s, settings.lease_ttl),
    )
    return RetentionCleaner(
        db,
        elector,
        policy_source(settings, plans),
        interval_s=interval_s,
        batch=settings.retention_batch,
        pause_s=settings.retention_pause,
    )
