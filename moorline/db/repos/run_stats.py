"""Per-workflow statistics over a time range: throughput, failure rate, duration percentiles.

What the dashboard's Statistics page shows (``GET /v1/stats/workflows`` and its admin twin).
Runs are counted by when they *ended* (``finished_at`` in ``[since, until)``), so both reads
walk ``ix_runs_finished`` over the range only: the counts per (workflow, status) are one
grouped scan of it, and the durations one ordered read of at most :data:`MAX_DURATIONS` rows,
the newest first, from which p50 and p95 are taken here (SQLite has no percentile function,
and one way on every backend keeps the figures alike). A range with more ended runs than that
gives the percentiles of the newest :data:`MAX_DURATIONS` and says so (``sampled``).
"""

import math
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.sql.elements import ColumnElement

from moorline.db.manager import DatabaseManager
from moorline.db.schema import runs
from moorline.types import RunStatus, TenantId

MAX_DURATIONS = 20_000
"""Most durations read for one range's percentiles (the newest ended runs)."""

FAILED = frozenset({RunStatus.FAILED.value, RunStatus.TIMED_OUT.value})
"""The statuses counted as failures: the run's code or its time limit failed it."""

_TIMED = (RunStatus.SUCCEEDED.value, *sorted(FAILED))
"""Ended runs whose duration says how long the work took (not a cancel or a refusal)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkflowStats:
    """One workflow's runs that ended in the range.

    Attributes:
        workflow: Its name.
        ended: Runs that ended in the range, whatever their status.
        by_status: Those runs per final status.
        failure_rate: ``failed`` and ``timed_out`` over ``ended`` (None: none ended).
        runs_per_minute: ``ended`` over the range's minutes.
        p50_s: Median seconds from first start to end of its succeeded and failed runs.
        p95_s: Their 95th percentile (nearest rank).
        sampled: The percentiles come from the newest :data:`MAX_DURATIONS` of every
            workflow's runs, not all.
    """

    workflow: str
    ended: int
    by_status: dict[str, int]
    failure_rate: float | None
    runs_per_minute: float
    p50_s: float | None
    p95_s: float | None
    sampled: bool


def percentile(ordered: list[float], share: float) -> float | None:
    """The nearest-rank percentile of sorted ``ordered`` (``share`` in (0, 1]); None if empty."""
    if not ordered:
        return None
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


class RunStats:
    """Statistics of ended runs, a tenant's or every tenant's."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db

    async def by_workflow(
        self, *, since: datetime, until: datetime, tenant_id: TenantId | None = None
    ) -> list[WorkflowStats]:
        """Each workflow with a run that ended in ``[since, until)``, by name.

        Args:
            since: Start of the range (inclusive); before ``until``.
            until: End of the range (exclusive).
            tenant_id: Only this tenant's runs; None for every tenant's.
        """
        if since >= until:
            raise ValueError("since must be before until")
        where: list[ColumnElement[bool]] = [
            runs.c.finished_at >= since,
            runs.c.finished_at < until,
        ]
        if tenant_id is not None:
            where.append(runs.c.tenant_id == tenant_id)
        counts = (
            select(runs.c.workflow, runs.c.status, func.count().label("n"))
            .where(*where)
            .group_by(runs.c.workflow, runs.c.status)
        )
        durations = (
            select(runs.c.workflow, runs.c.elapsed_time)
            .where(*where, runs.c.status.in_(_TIMED), runs.c.elapsed_time.is_not(None))
            .order_by(runs.c.finished_at.desc(), runs.c.id.desc())
            .limit(MAX_DURATIONS + 1)
        )

        async def read() -> tuple[list[tuple[str, str, int]], list[tuple[str, float]]]:
            async with self._db.connect() as conn:
                counted = [(r.workflow, r.status, int(r.n)) for r in await conn.execute(counts)]
                timed = [(r.workflow, float(r.elapsed_time)) for r in await conn.execute(durations)]
            return counted, timed

        counted, timed = await self._db.with_retry(read)
        sampled = len(timed) > MAX_DURATIONS
        by_workflow: dict[str, list[float]] = {}
        for workflow, seconds in timed[:MAX_DURATIONS]:
            by_workflow.setdefault(workflow, []).append(seconds)
        statuses: dict[str, dict[str, int]] = {}
        for workflow, status, n in counted:
            statuses.setdefault(workflow, {})[status] = n
        minutes = (until - since).total_seconds() / 60
        found = []
        for workflow in sorted(statuses):
            ended = sum(statuses[workflow].values())
            failed = sum(n for status, n in statuses[workflow].items() if status in FAILED)
            ordered = sorted(by_workflow.get(workflow, []))
            found.append(
                WorkflowStats(
                    workflow=workflow,
                    ended=ended,
                    by_status=dict(sorted(statuses[workflow].items())),
                    failure_rate=failed / ended if ended else None,
                    runs_per_minute=ended / minutes,
                    p50_s=percentile(ordered, 0.5),
                    p95_s=percentile(ordered, 0.95),
                    sampled=sampled,
                )
            )
        return found
