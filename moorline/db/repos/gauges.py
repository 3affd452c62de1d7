"""The database reads of a ``/metrics`` scrape: runs by lane and status, pending interrupts.

Both must stay cheap with a large history, since Prometheus asks every few seconds:

- runs per (lane, status) is an index-only scan of ``ix_runs_lane_tenant``, which leads with
  ``(status, lane)``;
- pending interrupts are those of ``running`` and ``waiting`` runs (a run waiting for a
  decision parks after ``park_after``): the runs come from an index leading with ``status``,
  and their interrupts from the ``(run_id, status)`` index, so the interrupts of runs that
  ended long ago are never read. (An interrupt left pending by a run that then ended waits for
  no one.)

Queue depth and the oldest queued age per lane are
:meth:`~moorline.db.repos.listing.RunListing.lane_loads`, the read behind
``GET /v1/admin/queues``, so the two always agree.
"""

from sqlalchemy import func, select

from moorline.db.manager import DatabaseManager
from moorline.db.repos.records import InterruptStatus
from moorline.db.schema import interrupts, runs
from moorline.types import RunStatus


class Gauges:
    """Aggregate reads for the metrics endpoint."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db

    async def runs_by_lane_and_status(self) -> dict[tuple[str, str], int]:
        """(lane, status) → number of runs, for every pair that has runs."""
        stmt = select(runs.c.status, runs.c.lane, func.count().label("n")).group_by(
            runs.c.status, runs.c.lane
        )

        async def read() -> dict[tuple[str, str], int]:
            async with self._db.connect() as conn:
                return {(row.lane, row.status): row.n for row in await conn.execute(stmt)}

        return await self._db.with_retry(read)

    async def pending_interrupts(self) -> int:
        """Interrupts of live runs that wait for a decision."""
        stmt = (
            select(func.count())
            .select_from(interrupts.join(runs, runs.c.id == interrupts.c.run_id))
            .where(
                runs.c.status.in_([RunStatus.RUNNING.value, RunStatus.WAITING.value]),
                interrupts.c.status == InterruptStatus.PENDING.value,
            )
        )

        async def read() -> int:
            async with self._db.connect() as conn:
                return int((await conn.execute(stmt)).scalar_one())

        return await self._db.with_retry(read)
