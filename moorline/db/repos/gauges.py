"""The database reads of a ``/metrics`` scrape: runs by lane and status, pending interrupts.

Both must stay cheap with a large history, since Prometheus asks every few seconds:

- runs per (lane, status) is an index-only scan of ``ix_runs_lane_tenant``, which leads with
  ``(status, lane)``;
- pending interrupts are those of ``running`` and ``waiting`` runs (a run waiting for a
  decision parks after ``park_after``): the runs come from an index leading with ``status``,
  and their interrupts from the ``(run_id, status)`` index, so the interrupts of runs that
  ended long ago are never read. (An interrupt left pending by a run that then ended waits for
  no one.)

- the oldest finished run is the first entry of ``ix_runs_finished`` (only ended runs have a
  ``finished_at``), and the retention tallies are a few rows.

Queue depth and the oldest queued age per lane are
:meth:`~moorline.db.repos.listing.RunListing.lane_loads`, the read behind
``GET /v1/admin/queues``, so the two always agree.
"""

from dataclasses import dataclass, field
from datetime import timedelta

from sqlalchemy import func, select

from moorline.db.manager import DatabaseManager
from moorline.db.repos.records import InterruptStatus
from moorline.db.schema import interrupts, retention_tallies, runs
from moorline.types import RunStatus


@dataclass(frozen=True, slots=True, kw_only=True)
class Deleted:
    """What retention deleted, for ever (``retention_tallies``)."""

    rows: dict[str, int] = field(default_factory=dict)
    """Table name → rows deleted."""
    runs: dict[tuple[str, str], int] = field(default_factory=dict)
    """(lane, status) → runs deleted."""


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

    async def oldest_finished_age_s(self) -> float | None:
        """Seconds since the oldest run still stored ended (database time); None: none has."""
        finished = runs.c.finished_at
        oldest = (
            select(finished).where(finished.is_not(None)).order_by(finished).limit(1)
        ).scalar_subquery()
        stmt = select(oldest.label("oldest"), self._db.backend.now().label("now"))

        async def read() -> float | None:
            async with self._db.connect() as conn:
                row = (await conn.execute(stmt)).one()
            if row.oldest is None:
                return None
            age: timedelta = row.now - row.oldest
            return max(0.0, age.total_seconds())

        return await self._db.with_retry(read)

    async def deleted(self) -> Deleted:
        """What the retention cleaner deleted since the database was made."""
        tally = retention_tallies.c
        stmt = select(tally.table_name, tally.lane, tally.status, tally.deleted)

        async def read() -> Deleted:
            found = Deleted()
            async with self._db.connect() as conn:
                for row in await conn.execute(stmt):
                    found.rows[row.table_name] = found.rows.get(row.table_name, 0) + row.deleted
                    if row.table_name == runs.name:
                        found.runs[(row.lane, row.status)] = row.deleted
            return found

        return await self._db.with_retry(read)
