"""Retention: finished runs past their plan's limit, deleted with every row that is theirs.

A run is deleted when it ended (a terminal status: it never changes again) longer ago than its
tenant's plan keeps runs (:class:`RetentionPolicy`), and nothing still refers to it
(:data:`REFERENCES`): not a child of a parent that has not ended (it may still read the
child's result on its next replay), not a parent of a child still stored (a parent goes after
its children, so a child is never left with a parent that is gone), not a run a bulk job or a
schedule refers to. Its rows in :data:`RUN_TABLES` go in the same transaction.

The cleaner walks ``ix_runs_finished`` in ``(finished_at, id)`` order, one chunk of ``limit``
entries per call: the chunk is read without a lock, the plan's limit applied to each run, and
the runs that pass are locked and checked again (status, age, references) inside the write
transaction that deletes them (their rows in :data:`RUN_TABLES` by the foreign keys'
cascade), so a run that changed in between (or that another cleaner is deleting: skipped, not
waited for) is left alone. Each call examines at most ``limit`` runs
whatever the mix of plans, and the caller resumes after the chunk's last entry
(:class:`Cursor`), so one pass reads each finished run once, deletable or not.

What was deleted is added to ``retention_tallies`` in the same transaction: ``/metrics`` serves
it (``moorline_retention_deleted_total``) and adds the runs back into ``moorline_runs_total``,
which would otherwise fall as runs are deleted.
"""

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Table, and_, delete, func, or_, select

from moorline.db.manager import DatabaseManager
from moorline.db.schema import (
    bulk_job_runs,
    events,
    interrupts,
    messages,
    retention_tallies,
    runs,
    schedules,
    steps,
    tenants,
)
from moorline.types import TERMINAL_STATUSES, RunId

RUN_TABLES: tuple[Table, ...] = (steps, events, interrupts, messages, bulk_job_runs)
"""Every table whose rows belong to one run (its ``run_id``), deleted with the run.

Their rows go with the run through the foreign key's ``ON DELETE CASCADE`` and are counted
per table. A new table keyed by run id belongs here, with such a key:
``tests/contract/test_retention.py`` fails on a table with a ``run_id`` that lacks either."""

DAY_S = 86400.0
_TERMINAL = sorted(status.value for status in TERMINAL_STATUSES)
_parent = runs.alias("parent")
_child = runs.alias("child")


# Each selects an indexed column, not ``*`` (what a bare ``exists()`` renders): SQLite's planner
# then reads the index alone, and after an ANALYZE that found parent_run_id mostly NULL it would
# otherwise price the index lookups above a scan of the whole table, and scan it per run.


def _has_live_parent() -> ColumnElement[bool]:
    return (
        select(_parent.c.id)
        .where(_parent.c.id == runs.c.parent_run_id, _parent.c.status.not_in(_TERMINAL))
        .exists()
    )


def _has_children() -> ColumnElement[bool]:
    return select(_child.c.parent_run_id).where(_child.c.parent_run_id == runs.c.id).exists()


def _awaits_a_bulk_job() -> ColumnElement[bool]:
    return (
        select(bulk_job_runs.c.run_id)
        .where(bulk_job_runs.c.run_id == runs.c.id, bulk_job_runs.c.outcome.is_(None))
        .exists()
    )


def _last_of_a_schedule() -> ColumnElement[bool]:
    return select(schedules.c.last_run_id).where(schedules.c.last_run_id == runs.c.id).exists()


REFERENCES: tuple[Callable[[], ColumnElement[bool]], ...] = (
    _has_live_parent,
    _has_children,
    _awaits_a_bulk_job,
    _last_of_a_schedule,
)
"""Conditions that keep a finished run, however old, as long as one holds (over ``runs``):
a parent that has not ended, children of its own, a bulk job that has yet to act on it (its
progress counts it), a schedule that shows it as its last run.

A condition must be cheap for one run (an index probe): it is checked for every run about to
be deleted, inside the deleting transaction."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RetentionPolicy:
    """How long finished runs are kept: days per plan, else ``default_days``; 0 is for ever."""

    default_days: float
    plan_days: Mapping[str, float] = field(default_factory=dict)

    def days_for(self, plan: str) -> float:
        """Days the runs of a tenant on ``plan`` are kept (0: for ever)."""
        return self.plan_days.get(plan, self.default_days)

    def shortest_days(self) -> float | None:
        """The shortest limit in force (no run younger is deleted); None: all kept for ever."""
        limits = [days for days in (self.default_days, *self.plan_days.values()) if days > 0]
        return min(limits) if limits else None


@dataclass(frozen=True, slots=True, kw_only=True)
class Cursor:
    """Where a pass resumes: after this entry of ``ix_runs_finished``."""

    finished_at: datetime
    run_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Cleaned:
    """What one batch did."""

    examined: int
    """Finished runs read from the index (at most the batch's ``limit``)."""
    deleted: Mapping[str, int] = field(default_factory=dict)
    """Table name → rows deleted (``runs`` among them)."""
    next: Cursor | None = None
    """Where the next batch starts; None when this one reached the end of the old runs."""
    held_s: float = 0.0
    """Seconds the deleting write transaction lasted (0 when nothing was due)."""

    @property
    def runs(self) -> int:
        """Runs deleted."""
        return self.deleted.get(runs.name, 0)


class RetentionRepo:
    """Deletes finished runs past their retention, a bounded batch per call."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db

    async def delete_batch(
        self, policy: RetentionPolicy, *, after: Cursor | None = None, limit: int = 500
    ) -> Cleaned:
        """Examine the next ``limit`` old finished runs after ``after``; delete those due.

        Args:
            policy: Days kept per plan.
            after: Where the previous batch of this pass stopped; None starts at the oldest.
            limit: Runs examined (and so at most deleted) in this batch.

        Returns:
            What was examined and deleted, and where the next batch starts.
        """
        shortest = policy.shortest_days()
        if shortest is None:
            return Cleaned(examined=0)
        # Background work: on SQLite its statements leave the event loop to the hot path.
        with self._db.backend.background():
            return await self._examine(policy, shortest, after, limit)

    async def _examine(
        self, policy: RetentionPolicy, shortest: float, after: Cursor | None, limit: int
    ) -> Cleaned:
        chunk = await self._db.with_retry(lambda: self._read_chunk(shortest, after, limit))
        if not chunk:
            return Cleaned(examined=0)
        due = [row.id for row in chunk if _is_due(row, policy)]
        deleted: Mapping[str, int] = {}
        held_s = 0.0
        if due:
            started = time.monotonic()
            # Not retried as a whole: a commit whose answer was lost would be counted twice.
            deleted = await self._delete(due, shortest)
            held_s = time.monotonic() - started
        last = chunk[-1]
        next_cursor = (
            Cursor(finished_at=last.finished_at, run_id=last.id) if len(chunk) == limit else None
        )
        return Cleaned(examined=len(chunk), deleted=deleted, next=next_cursor, held_s=held_s)

    async def _read_chunk(
        self, shortest_days: float, after: Cursor | None, limit: int
    ) -> Sequence[Any]:
        backend = self._db.backend
        stmt = (
            select(
                runs.c.id,
                runs.c.finished_at,
                runs.c.status,
                tenants.c.plan,
                backend.now().label("now"),
            )
            .select_from(runs.join(tenants, tenants.c.id == runs.c.tenant_id))
            .where(runs.c.finished_at < backend.now(plus_s=-shortest_days * DAY_S))
            .order_by(runs.c.finished_at, runs.c.id)
            .limit(limit)
        )
        if after is not None:
            # (finished_at, id) > after, written so that every backend starts an index range.
            stmt = stmt.where(
                runs.c.finished_at >= after.finished_at,
                or_(
                    runs.c.finished_at > after.finished_at,
                    and_(runs.c.finished_at == after.finished_at, runs.c.id > after.run_id),
                ),
            )
        async with self._db.connect() as conn:
            return (await conn.execute(stmt)).all()

    async def _delete(self, candidates: Sequence[RunId], shortest_days: float) -> dict[str, int]:
        """Lock the candidates still due, count their rows, delete them: three statements.

        Few statements, because the transaction holds SQLite's one write lock across every
        one of them, and under load each waits its turn on a busy event loop: the rows of
        :data:`RUN_TABLES` are counted by the locking read (index probes per run) and go with
        the run by their foreign keys' ``ON DELETE CASCADE``, and the tallies are one upsert.
        """
        backend = self._db.backend
        # Status and age are checked here, on the locked rows, not in the WHERE clause: given
        # ``status IN (…)`` SQLite's planner walks an index on status (every finished run)
        # instead of looking the candidates up by id.
        locked = backend.lock_rows_skip_locked(
            select(
                runs.c.id,
                runs.c.lane,
                runs.c.status,
                runs.c.finished_at,
                backend.now(plus_s=-shortest_days * DAY_S).label("bound"),
                *(_rows_of_run(table).label(table.name) for table in RUN_TABLES),
            ).where(runs.c.id.in_(candidates), *(~reference() for reference in REFERENCES))
        )
        counted: Counter[str] = Counter()
        async with self._db.write_transaction() as conn:
            confirmed = [
                row
                for row in (await conn.execute(locked)).all()
                if row.status in _TERMINAL
                and row.finished_at is not None
                and row.finished_at < row.bound
            ]
            if not confirmed:
                return {}
            result = await conn.execute(
                delete(runs).where(runs.c.id.in_([r.id for r in confirmed]))
            )
            counted[runs.name] = result.rowcount
            for table in RUN_TABLES:
                counted[table.name] = sum(getattr(row, table.name) for row in confirmed)
            per_run = Counter((row.lane, row.status) for row in confirmed)
            tallies = [
                {"table_name": runs.name, "lane": lane, "status": status, "deleted": n}
                for (lane, status), n in sorted(per_run.items())
            ]
            tallies += [
                {"table_name": name, "lane": "", "status": "", "deleted": n}
                for name, n in sorted(counted.items())
                if name != runs.name and n
            ]
            await conn.execute(
                backend.add_to_counters(
                    retention_tallies, keys=("table_name", "lane", "status"), columns=("deleted",)
                ).values(tallies)
            )
        return {name: n for name, n in counted.items() if n}


def _rows_of_run(table: Table) -> Any:
    """The rows of ``table`` that belong to the run of the outer query (an index probe)."""
    return select(func.count()).where(table.c.run_id == runs.c.id).scalar_subquery()


def _is_due(row: Any, policy: RetentionPolicy) -> bool:
    days = policy.days_for(row.plan)
    if days <= 0 or row.status not in _TERMINAL:
        return False
    return bool(row.finished_at < row.now - timedelta(days=days))
