"""Workers, live and dead, what they serve and hold; the queued runs that no live worker serves.

Each worker process keeps one row of ``workers`` (host, pid, version, its lanes with their
slots and the workflows of its app), renewed by its heartbeat with an expiry of one lease TTL
by database time, and deleted when it stops cleanly. A row whose expiry passed is a worker that
died (``kill -9``, a lost host, a pause past the TTL): the operators' view shows it *dead* for
:data:`PRUNE_AFTER_S`, after which the next beat of any worker deletes it. The database, not
the RuntimeStore, holds it: ``moorline worker`` processes without Redis share nothing else with
the API, and the figure must be right however many processes on however many hosts serve the
lanes.

A queued run is *unserved* when no live worker serves its (lane, workflow): a rolling deploy
whose new app lacks a workflow, a worker started with the wrong ``--app`` or ``--lanes``. The
claim leaves such a run ``queued`` (:mod:`.claims`); this module counts them for ``/metrics``
and ``GET /v1/admin/queues``. The count groups the queued range of ``ix_runs_lane_tenant``
(which ends with ``workflow``) by lane and workflow, an index-only read, and the live rows are
as few as the workers.

The runs a worker holds are the ``running`` runs whose ``lease_owner`` is its id (a claim
writes the worker's id there, and every way out of ``running`` clears it). A dead worker keeps
its runs until the reaper takes them back, one lease TTL and a reaper pass later, which the
view shows as it is.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import RowMapping, delete, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.manager import DatabaseManager
from moorline.db.schema import runs, workers
from moorline.types import RunStatus

PRUNE_AFTER_S = 24 * 3600.0
"""How long the row of a worker that died without deleting it is kept after it expired."""
HELD_IDS_LISTED = 50
"""Held run ids a listing names per worker (its count is exact): a page of many workers stays
small however many slots each has; :meth:`WorkersRepo.get` gives all of one worker's."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerEntry:
    """What a worker process announces about itself.

    Attributes:
        worker_id: Its lease owner id (unique per worker).
        host: Its host name.
        pid: Its process id.
        lanes: Lane → slots it serves.
        workflows: The workflow names it can run; None when it claims every workflow.
        version: The Moorline version it runs; None when unknown (a row of an older worker).
    """

    worker_id: str
    host: str
    pid: int
    lanes: Mapping[str, int]
    workflows: Sequence[str] | None
    version: str | None = None


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


@dataclass(frozen=True, slots=True, kw_only=True)
class ListedWorker:
    """A worker's row as operators see it, live or dead, with the runs it holds.

    Attributes:
        worker: The row.
        alive: Whether its row has not expired by database time.
        last_seen_age_s: Seconds since its last beat, by database time.
        held: How many runs it holds a lease on.
        held_ids: The ids of the first :data:`HELD_IDS_LISTED` of them, in id order.
    """

    worker: LiveWorker
    alive: bool
    last_seen_age_s: float
    held: int
    held_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldRun:
    """A run a worker holds the lease of."""

    run_id: str
    tenant_id: str
    workflow: str
    lane: str
    attempt: int
    started_at: datetime | None
    lease_expires_at: datetime | None


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
            "version": entry.version,
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

    async def listing(self) -> list[ListedWorker]:
        """Every worker with a row, live ones first (then by host and pid), with its held runs."""

        async def read() -> list[ListedWorker]:
            async with self._db.connect() as conn:
                now = await self._now(conn)
                rows = (await conn.execute(select(workers))).mappings().all()
                held = await self._held_by_owner(conn)
            listed = [
                _listed(_live_from_row(row), now, *held.get(row["id"], (0, ()))) for row in rows
            ]
            return sorted(
                listed,
                key=lambda w: (
                    not w.alive,
                    w.worker.entry.host,
                    w.worker.entry.pid,
                    w.worker.entry.worker_id,
                ),
            )

        return await self._db.with_retry(read)

    async def get(self, worker_id: str) -> tuple[ListedWorker, list[HeldRun]] | None:
        """One worker's row and every run it holds (in id order); None when it has no row."""
        held_stmt = (
            select(
                runs.c.id,
                runs.c.tenant_id,
                runs.c.workflow,
                runs.c.lane,
                runs.c.attempt,
                runs.c.started_at,
                runs.c.lease_expires_at,
            )
            .where(runs.c.status == RunStatus.RUNNING.value, runs.c.lease_owner == worker_id)
            .order_by(runs.c.id)
        )

        async def read() -> tuple[ListedWorker, list[HeldRun]] | None:
            async with self._db.connect() as conn:
                now = await self._now(conn)
                row = (
                    (await conn.execute(select(workers).where(workers.c.id == worker_id)))
                    .mappings()
                    .one_or_none()
                )
                if row is None:
                    return None
                held = [
                    HeldRun(
                        run_id=run.id,
                        tenant_id=run.tenant_id,
                        workflow=run.workflow,
                        lane=run.lane,
                        attempt=run.attempt,
                        started_at=run.started_at,
                        lease_expires_at=run.lease_expires_at,
                    )
                    for run in await conn.execute(held_stmt)
                ]
            ids = tuple(run.run_id for run in held[:HELD_IDS_LISTED])
            return _listed(_live_from_row(row), now, len(held), ids), held

        return await self._db.with_retry(read)

    async def _now(self, conn: AsyncConnection) -> datetime:
        now: datetime = (await conn.execute(self._db.backend.select_now())).scalar_one()
        return now

    async def _held_by_owner(self, conn: AsyncConnection) -> dict[str, tuple[int, tuple[str, ...]]]:
        """Owner → (runs held, the first ids): one pass over the running runs.

        Window functions rank and count each owner's runs in the database, so the answer is
        bounded by the listed ids while the running runs (the ``ix_runs_lease`` range of
        ``running``) are read once. No filter on the listed owners: a long IN list would cost
        more than the few running runs of owners without a row.
        """
        ranked = (
            select(
                runs.c.id,
                runs.c.lease_owner,
                func.row_number()
                .over(partition_by=runs.c.lease_owner, order_by=runs.c.id)
                .label("rank"),
                func.count().over(partition_by=runs.c.lease_owner).label("n"),
            )
            .where(runs.c.status == RunStatus.RUNNING.value, runs.c.lease_owner.is_not(None))
            .subquery()
        )
        stmt = (
            select(ranked.c.id, ranked.c.lease_owner, ranked.c.n)
            .where(ranked.c.rank <= HELD_IDS_LISTED)
            .order_by(ranked.c.lease_owner, ranked.c.rank)
        )
        held: dict[str, tuple[int, list[str]]] = {}
        for row in await conn.execute(stmt):
            held.setdefault(row.lease_owner, (int(row.n), []))[1].append(row.id)
        return {owner: (n, tuple(ids)) for owner, (n, ids) in held.items()}

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
        version=row["version"],
    )
    return LiveWorker(
        entry=entry,
        started_at=row["started_at"],
        last_seen_at=row["last_seen_at"],
        expires_at=row["expires_at"],
    )


def _listed(
    worker: LiveWorker, now: datetime, held: int, held_ids: tuple[str, ...]
) -> ListedWorker:
    return ListedWorker(
        worker=worker,
        alive=worker.expires_at > now,
        last_seen_age_s=max(0.0, (now - worker.last_seen_at).total_seconds()),
        held=held,
        held_ids=held_ids,
    )
