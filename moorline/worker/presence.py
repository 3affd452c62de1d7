"""A worker's presence: its ``workers`` row, renewed while it claims, deleted when it stops.

The row says which lanes and workflows the worker serves, so the API can tell a queued run that
merely waits from one that no live worker will ever claim (:mod:`moorline.db.repos.workers`);
with its host, pid and version it is also what operators see of the worker
(``GET /v1/admin/workers``, ``moorline workers``, the dashboard's Workers page).
It is renewed every ``LEASE_TTL/3`` and expires one ``LEASE_TTL`` after the last renewal, as
the worker's leases do: a worker killed with ``kill -9`` stops counting as a server of its
workflows within one TTL, one that stops cleanly at once.

The beat is its own loop rather than a step of the lease heartbeat: when the database is slow
or down, its retries must never delay a lease renewal (the self-fence counts those). A failed
beat is logged and tried again at the next one; it never stops the worker, since the row only
informs operators.
"""

import asyncio
import logging

from moorline.concurrency import is_set_within
from moorline.db.repos.workers import WorkerEntry, WorkersRepo

logger = logging.getLogger(__name__)


class Presence:
    """Keeps one worker's ``workers`` row alive while it claims."""

    def __init__(self, repo: WorkersRepo, entry: WorkerEntry, *, ttl_s: float) -> None:
        """Announce ``entry`` with rows that expire ``ttl_s`` after each beat."""
        self._repo = repo
        self._entry = entry
        self._ttl_s = ttl_s

    @property
    def interval_s(self) -> float:
        """Seconds between two beats: a third of the TTL, as for leases."""
        return self._ttl_s / 3

    async def beat(self) -> bool:
        """Renew the row now; whether that worked (a failure is logged, not raised)."""
        try:
            await self._repo.beat(self._entry, self._ttl_s)
        except Exception as exc:
            logger.warning("worker %s: presence beat failed: %r", self._entry.worker_id, exc)
            return False
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Beat every :attr:`interval_s` until ``stop`` is set, then delete the row.

        The row goes when claiming stops, not when the last run ends: from then on this worker
        claims nothing, so its queued runs need another.
        """
        while not await is_set_within(stop, self.interval_s):
            await self.beat()
        try:
            await self._repo.leave(self._entry.worker_id)
        except Exception as exc:
            # The row expires by itself within one TTL.
            logger.warning("worker %s: could not delete its row: %r", self._entry.worker_id, exc)
