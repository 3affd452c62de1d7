"""Live workers and what they serve; the queued runs that no live worker serves.

Each worker process keeps one row of ``workers`` (its lanes with their slots and the workflows
of its app), renewed by its heartbeat with an expiry of one lease TTL by database time, and
deleted when it stops. The database, not the RuntimeStore, holds it: ``moorline worker``
processes without Redis share nothing else with the API, and the figure must be right however
many processes on however many hosts serve the lanes.

A queued run is *unserved* when no live worker serves its (lane, workflow): a rolling deploy
whose new app lacks a workflow, a worker started with the wrong ``--app`` or ``--lanes``. The
claim leaves such a run ``queued`` (:mod:`.claims`); this module counts them for ``/metrics``
and ``GET /v1/admin/queues``. The count groups the queued range of ``ix_runs_lane_tenant``
(which ends with ``workflow``) by lane and workflow, an index-only read, and the live rows are
as few as the workers.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import RowMapping, delete, func, insert, select, update

from moorline.db.manager import DatabaseManager
from moorline.db.schema import runs, workers
from moorline.types import RunStatus

PRUNE_AFTER_S = 24 * 3600.0
"""How long the row of a worker that died without deleting it is kept after it expired."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerEntry:
    """What a worker process announces about itself.

    Attributes:
        worker_id: Its lease owner id (unique per worker).
        host: Its host name.
        pid: Its process id.
        lanes: Lane → slots it serves.
        workflows: The workflow names it can run; None when it claims every workflow.
    """

    worker_id: str
    host: str
    pid: int
    lanes: Mapping[str, int]
    workflows: Sequence[str] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class LiveWorker:
    """A worker whose row has not expired, as stored."""

    entry: WorkerEntry
    started_at: datetime
    last_seen_at: datetime
    expires_at: datetime

    def serves(self, lane: str, workflow: str) -> bool:
        """Whether this worker claims runs of ``workflow`` in ``lane``."""
        return _is_served(lane, workflow, self.entry.lanes, self.entry.workflows)


class WorkersRepo:
    """The ``workers`` rows over one :class:`DatabaseManager`."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db

    async def beat(self, entry: WorkerEntry, ttl_s: float) -> None:
        """Record ``entry`` as alive for ``ttl_s`` more seconds of database time.

        Creates the row on the first beat (and again after a prune removed it, as after a
        long pause), and prunes the rows of workers that died long ago. Idempotent, so retried.
        """
        backend = self._db.backend
        now = backend.now()
        values = {
            "host": entry.host,
            "pid": entry.pid,
            "lanes": dict(entry.lanes),
            "workflows": None if entry.workflows is None else list(entry.workflows),
            "last_seen_at": now,
            "expires_at": backend.now(plus_s=ttl_s),
        }

        async def write() -> None:
            async with self._db.transaction() as conn:
                renewed = await conn.execute(
                    update(workers).where(workers.c.id == entry.worker_id).values(**values)
                )
                if renewed.rowcount == 0:
                    # Only this worker writes its row (its id is unique), so nothing races
                    # the insert but a prune, which only deletes rows expired long ago.
                    await conn.execute(
                        insert(workers).values(id=entry.worker_id, started_at=now, **values)
                    )
                await conn.execute(
                    delete(workers).where(workers.c.expires_at < backend.now(plus_s=-PRUNE_AFTER_S))
                )

        await self._db.with_retry(write)

    async def leave(self, worker_id: str) -> bool:
        """Delete the row of a worker that stops; whether it was there."""

        async def write() -> bool:
            async with self._db.transaction() as conn:
                result = await conn.execute(delete(workers).where(workers.c.id == worker_id))
            return result.rowcount == 1

        return await self._db.with_retry(write)

    async def live(self) -> list[LiveWorker]:
        """The workers whose rows have not expired by database time, by id."""
        stmt = (
            select(workers)
            .where(workers.c.expires_at > self._db.backend.now())
            .order_by(workers.c.id)
        )

        async def read() -> list[LiveWorker]:
            async with self._db.connect() as conn:
                rows = (await conn.execute(stmt)).mappings().all()
            return [_live_from_row(row) for row in rows]

        return await self._db.with_retry(read)

    async def unserved(self) -> dict[tuple[str, str], int]:
        """(lane, workflow) → queued runs that no live worker serves; only non-zero pairs."""
        queued = (
            select(runs.c.lane, runs.c.workflow, func.count().label("n"))
            .where(runs.c.status == RunStatus.QUEUED.value)
            .group_by(runs.c.lane, runs.c.workflow)
        )
        alive = select(workers.c.lanes, workers.c.workflows).where(
            workers.c.expires_at > self._db.backend.now()
        )

        async def read() -> dict[tuple[str, str], int]:
            async with self._db.connect() as conn:
                rows = await conn.execute(queued)
                counts = {(row.lane, row.workflow): int(row.n) for row in rows}
                if not counts:
                    return {}
                serving = [(row.lanes, row.workflows) for row in await conn.execute(alive)]
            return {
                (lane, workflow): n
                for (lane, workflow), n in counts.items()
                if not any(_is_served(lane, workflow, *worker) for worker in serving)
            }

        return await self._db.with_retry(read)


def _is_served(
    lane: str, workflow: str, lanes: Mapping[str, int], served: Sequence[str] | None
) -> bool:
    """Whether a worker of ``lanes`` serving ``served`` (None: every workflow) claims the run."""
    return lane in lanes and (served is None or workflow in served)


def _live_from_row(row: RowMapping) -> LiveWorker:
    entry = WorkerEntry(
        worker_id=row["id"],
        host=row["host"],
        pid=row["pid"],
        lanes=dict(row["lanes"]),
        workflows=row["workflows"],
    )
    return LiveWorker(
        entry=entry,
        started_at=row["started_at"],
        last_seen_at=row["last_seen_at"],
        expires_at=row["expires_at"],
    )
