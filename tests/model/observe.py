"""One lane's runs, steps, approvals and events as the database holds them, in one statement.

The state machine checks the database after every rule, so the read is most of a test's cost.
It is one ``UNION ALL`` of the four tables in a common shape (one round trip, one compiled
statement per dialect), with every comparison against database time made in SQL by the same
predicates the repositories use: a lease is valid while ``lease_expires_at > now``, a queued
run is due once ``not_before <= now``, a waiting run's timer once ``wake_at <= now``.
"""

import functools
import json
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import (
    CompoundSelect,
    Integer,
    String,
    Text,
    bindparam,
    case,
    cast,
    literal,
    null,
    select,
    union_all,
)

from moorline.db.backends import DialectName, backend_for
from moorline.db.manager import DatabaseManager
from moorline.db.repos.records import DecisionReason, InterruptStatus
from moorline.db.schema import events, interrupts, runs, steps
from moorline.types import JSONObject, RunId, RunStatus, StepStatus


@dataclass(frozen=True)
class RunRow:
    status: RunStatus
    attempt: int
    owner: str | None
    is_lease_valid: bool | None
    """None without a lease; else whether it is unexpired by database time."""
    is_due: bool
    """``not_before`` reached by database time."""
    is_cancel_requested: bool
    finished_at: str | None
    resumes: int
    waiting_for: JSONObject | None
    is_wake_due: bool | None
    """None without a timer (``wake_at``); else whether it is due by database time."""
    is_deadline_past: bool | None
    """None without a deadline (``deadline_at``); else whether it passed by database time."""


@dataclass(frozen=True)
class InterruptRow:
    interrupt_id: str
    key: str
    status: InterruptStatus
    reason: DecisionReason | None
    attempt: int
    decision: JSONObject | None


@dataclass
class Observation:
    runs: dict[RunId, RunRow] = field(default_factory=dict)
    steps: dict[RunId, dict[str, tuple[StepStatus, int]]] = field(default_factory=dict)
    interrupts: dict[RunId, list[InterruptRow]] = field(default_factory=dict)
    events: dict[RunId, list[tuple[str, int]]] = field(default_factory=dict)
    """``(type, attempt)`` per event, in ``seq`` order."""


_COLUMNS = (
    *("name", "status", "attempt", "seq"),
    *("lease", "due", "cancel", "finished"),
    *("interrupt_id", "reason", "decision"),
    *("resumes", "wake", "deadline"),
)
"""The common shape of every table's rows, after ``kind`` and ``run_id``."""


def _flag(condition: Any) -> Any:
    return case((condition, 1), else_=0)


def _passed(column: Any, now: Any) -> Any:
    """None for a NULL instant, else 1 once it is at or before ``now``, else 0."""
    return case((column.is_(None), null()), (column <= now, 1), else_=0)


@functools.cache
def _statement(dialect: DialectName) -> CompoundSelect[Any]:
    lane = bindparam("lane", type_=String())
    mine = select(runs.c.id).where(runs.c.lane == lane)
    now = backend_for(dialect).now()

    def shape(kind: str, run_id: Any, **columns: Any) -> Any:
        return select(
            literal(kind, String()).label("kind"),
            run_id.label("run_id"),
            *(columns.get(name, null()).label(name) for name in _COLUMNS),
        )

    lease = case(
        (runs.c.lease_expires_at.is_(None), null()),
        (runs.c.lease_expires_at > now, 1),
        else_=0,
    )
    return union_all(
        shape(
            "run",
            runs.c.id,
            name=runs.c.lease_owner,
            status=runs.c.status,
            attempt=cast(runs.c.attempt, Integer()),
            seq=literal(0, Integer()),
            lease=lease,
            due=_flag(runs.c.not_before <= now),
            cancel=_flag(runs.c.cancel_requested_at.is_not(None)),
            finished=cast(runs.c.finished_at, String(64)),
            # JSON travels as text, in the one JSON-shaped column of the common shape.
            decision=cast(runs.c.waiting_for, Text()),
            resumes=cast(runs.c.resumes, Integer()),
            wake=_passed(runs.c.wake_at, now),
            deadline=_passed(runs.c.deadline_at, now),
        ).where(runs.c.lane == lane),
        shape(
            "step",
            steps.c.run_id,
            name=steps.c.key,
            status=steps.c.status,
            attempt=steps.c.attempt,
        ).where(steps.c.run_id.in_(mine)),
        shape(
            "interrupt",
            interrupts.c.run_id,
            name=interrupts.c.key,
            status=interrupts.c.status,
            attempt=interrupts.c.attempt,
            interrupt_id=interrupts.c.id,
            reason=interrupts.c.reason,
            decision=cast(interrupts.c.decision, Text()),
        ).where(interrupts.c.run_id.in_(mine)),
        shape(
            "event",
            events.c.run_id,
            name=events.c.type,
            attempt=events.c.attempt,
            seq=events.c.seq,
        ).where(events.c.run_id.in_(mine)),
    )


async def observe(db: DatabaseManager, lane: str) -> Observation:
    """Everything of ``lane``'s runs the state machine compares with its model."""
    async with db.connect() as conn:
        rows = (await conn.execute(_statement(db.backend.name), {"lane": lane})).all()
    seen = Observation()
    numbered: dict[RunId, list[tuple[int, str, int]]] = {}
    for row in rows:
        run_id = RunId(row.run_id)
        if row.kind == "run":
            seen.runs[run_id] = RunRow(
                status=RunStatus(row.status),
                attempt=row.attempt,
                owner=row.name,
                is_lease_valid=None if row.lease is None else bool(row.lease),
                is_due=bool(row.due),
                is_cancel_requested=bool(row.cancel),
                finished_at=row.finished,
                resumes=row.resumes,
                waiting_for=None if row.decision is None else json.loads(row.decision),
                is_wake_due=None if row.wake is None else bool(row.wake),
                is_deadline_past=None if row.deadline is None else bool(row.deadline),
            )
        elif row.kind == "step":
            seen.steps.setdefault(run_id, {})[row.name] = (StepStatus(row.status), row.attempt)
        elif row.kind == "interrupt":
            seen.interrupts.setdefault(run_id, []).append(
                InterruptRow(
                    interrupt_id=row.interrupt_id,
                    key=row.name,
                    status=InterruptStatus(row.status),
                    reason=None if row.reason is None else DecisionReason(row.reason),
                    attempt=row.attempt,
                    decision=None if row.decision is None else json.loads(row.decision),
                )
            )
        else:
            numbered.setdefault(run_id, []).append((row.seq, row.name, row.attempt))
    for run_id, items in numbered.items():
        seen.events[run_id] = [(name, attempt) for _, name, attempt in sorted(items)]
    return seen
