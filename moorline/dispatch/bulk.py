"""The bulk-job processor: works through unfinished bulk jobs, batch by batch (leader-elected).

A bulk job (``POST /v1/runs/bulk/cancel|retry``) is a row, not a task of the API process that
accepted it: every worker process (``moorline serve`` runs one too) runs this chore, and the one
that leads (its own leader lease, ``bulk``) takes the unfinished jobs oldest first and
processes their runs in batches of ``MOORLINE_BULK_BATCH_SIZE`` with a pause of
``MOORLINE_BULK_PAUSE`` between them. Each batch acts on its runs and records their outcomes
in one transaction (:meth:`~moorline.db.repos.bulk_jobs.BulkJobsRepo.process_batch`), so when
the leader dies mid-job (kill -9) the next leader carries on where the last commit left it:
no run is skipped, none is acted on twice.

After each batch's commit it does what needs no durability: it wakes the lanes of retried runs
(a worker claims them at once rather than at its next poll), and signals the workers of
running runs whose cancel it recorded and cancels their child runs (a lost signal is delivered
by the worker's next heartbeat; children a crash left behind are cancelled by the timer
sweep's orphan pass).
"""

import asyncio
import contextlib
import logging

from moorline.db.manager import DatabaseManager
from moorline.db.repos.bulk_jobs import Batch, BulkAction, BulkJobsRepo, BulkState
from moorline.db.repos.children import ChildrenRepo
from moorline.db.repos.queue import QueueRepo
from moorline.db.repos.runs import RunsRepo
from moorline.dispatch.cancel import after_cancel
from moorline.dispatch.chores import LeaderChore
from moorline.dispatch.leader import LeaderElector, new_holder_id
from moorline.dispatch.reaper import leader_ttl_s
from moorline.dispatch.wakeups import Notifier
from moorline.errors import BulkJobNotFound
from moorline.runtime.base import RuntimeStore
from moorline.settings import Settings

logger = logging.getLogger(__name__)

LEADER_LEASE = "bulk"
"""Name of the bulk processor's row in ``leader_leases``."""


class BulkProcessor(LeaderChore):
    """Every ``interval_s``: if this process leads, work through the unfinished bulk jobs."""

    name = "bulk processor"

    def __init__(
        self,
        jobs: BulkJobsRepo,
        elector: LeaderElector,
        *,
        interval_s: float,
        batch_size: int,
        pause_s: float = 0.0,
        notifier: Notifier | None = None,
        store: RuntimeStore | None = None,
        runs: RunsRepo | None = None,
        children: ChildrenRepo | None = None,
    ) -> None:
        super().__init__(elector, interval_s=interval_s)
        self._jobs = jobs
        self._batch_size = batch_size
        self._pause_s = pause_s
        self._notifier = notifier
        self._store = store
        self._runs = runs
        self._children = children

    async def tick(self) -> int:
        """One pass: nothing unless this process leads; the batches it committed."""
        return await self._pass(None)

    async def _pass(self, stop: asyncio.Event | None) -> int:
        batches = 0
        if not await self.elector.tick():
            return batches
        for job_id in await self._jobs.unfinished():
            while stop is None or not stop.is_set():
                # Checked before every batch: a leader that lost its lease stops (the next
                # leader's batches would be correct beside it, only slower).
                if not await self.elector.tick():
                    return batches
                try:
                    batch = await self._jobs.process_batch(job_id, size=self._batch_size)
                except BulkJobNotFound:
                    break  # deleted meanwhile (by an operator, a retention pass): nothing to do
                batches += 1
                await self._after(batch)
                if batch.job.state is BulkState.FINISHED:
                    logger.info(
                        "bulk %s job %s finished: %d done, %d failed of %d",
                        batch.job.action.value,
                        job_id,
                        batch.job.done,
                        batch.job.failed,
                        batch.job.total,
                    )
                    break
                if self._pause_s:
                    await self._rest(stop)  # leave the database to the hot path
        return batches

    async def _rest(self, stop: asyncio.Event | None) -> None:
        """The pause between two batches, cut short by ``stop``."""
        if stop is None:
            await asyncio.sleep(self._pause_s)
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._pause_s):
                await stop.wait()

    async def _after(self, batch: Batch) -> None:
        """What follows a committed batch and needs no durability (see the module docstring)."""
        if batch.job.action is BulkAction.RETRY:
            lanes = {run.lane for run in batch.acted}
            if lanes and self._notifier is not None:
                await self._notifier.notify(lanes)
            return
        if self._store is None or self._runs is None:
            return
        for run in batch.acted:
            try:
                await after_cancel(self._runs, self._store, run, self._children)
            except Exception as exc:
                # Recorded already: the heartbeat and the orphan sweep finish the job.
                logger.warning("bulk cancel of run %s not signalled: %r", run.run_id, exc)


def make_bulk_processor(
    settings: Settings,
    db: DatabaseManager,
    *,
    holder: str | None = None,
    notifier: Notifier | None = None,
    store: RuntimeStore | None = None,
) -> BulkProcessor:
    """A bulk processor for this process, with the settings' interval, batch size and pause."""
    interval_s = settings.bulk_interval
    elector = LeaderElector(
        QueueRepo(db),
        name=LEADER_LEASE,
        holder=holder if holder is not None else new_holder_id(),
        ttl_s=leader_ttl_s(interval_s, settings.lease_ttl),
    )
    return BulkProcessor(
        BulkJobsRepo(db),
        elector,
        interval_s=interval_s,
        batch_size=settings.bulk_batch_size,
        pause_s=settings.bulk_pause,
        notifier=notifier,
        store=store,
        runs=RunsRepo(db),
        children=ChildrenRepo(db),
    )
