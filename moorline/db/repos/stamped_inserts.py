"""Run inserts the database stamps with its own time, with no reading of the time first.

Two backends let a submission skip the ``SELECT`` of the database's time (a round trip):

* :func:`submit_in_one_statement` — a submission that is one statement, committed alone,
  which stores the runs and their ``queued`` events and returns the time it stamped them with
  (the backend's :meth:`~moorline.db.backends.base.Backend.submitted_runs`; PostgreSQL).
* :func:`insert_stamped_txn` — an INSERT that stamps its rows and returns their time, in the
  caller's transaction (the backend's
  :meth:`~moorline.db.backends.base.Backend.stamped_runs_insert`; MariaDB).

Either way ``not_before`` is that time plus the delay in whole microseconds, added the same
way here, so the runs built from the values inserted equal what a read returns.
"""

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Insert
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.backends import DialectName, backend_for
from moorline.db.manager import DatabaseManager
from moorline.db.repos.announcements import Announcement
from moorline.db.repos.events import EVENT_QUEUED, events_from_runs_statement, first_event_statement
from moorline.db.repos.quotas import take_all_parameters, units_gate
from moorline.db.repos.records import NULL_ON_INSERT, Run, run_from_row
from moorline.types import RunStatus, TenantId

_QUEUED = RunStatus.QUEUED.value

_MICROSECOND = timedelta(microseconds=1)

_SUBMITTED = (
    "id",
    "tenant_id",
    "workflow",
    "lane",
    "priority",
    "attempt",
    "max_attempts",
    "idempotency_key",
    "input_hash",
    "conversation_id",
    "input",
    "timeout_s",
    "prompt_tokens",
    "completion_tokens",
    "rerun_of",
    "trace_context",
)
"""The columns :func:`submit_in_one_statement` binds per run (``row_of``'s)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitsWanted:
    """The daily-quota units a one-statement submit takes: one per run, of one counter."""

    tenant_id: TenantId
    day: str
    limit: int


@functools.cache
def _submit_statement(name: DialectName, gated: bool, announced: bool) -> Insert:
    """Runs (the ``runs`` parameter) and their first events, in one statement, built once.

    ``WITH submitted AS (INSERT INTO runs … RETURNING …) INSERT INTO events … SELECT … FROM
    submitted RETURNING run_id, created_at``; ``status``, ``type`` and ``data`` are one
    parameter each for the batch. ``gated``: ``WITH taken AS (UPDATE quota_usage …)`` first,
    and the runs go in only if it took their units (:func:`~moorline.db.repos.quotas.units_gate`).
    ``announced``: the events' ``SELECT`` sends the runs' wake-ups too
    (:mod:`~moorline.db.repos.announcements`).
    """
    backend = backend_for(name)
    gate = units_gate(name) if gated else None
    submitted = backend.submitted_runs(_SUBMITTED, gate)
    if submitted is None:  # pragma: no cover - the caller checks the capability
        raise ValueError(f"{name} has no one-statement submit")
    return first_event_statement(submitted, backend.notify_condition() if announced else None)


async def submit_in_one_statement(
    db: DatabaseManager,
    rows: Sequence[dict[str, Any]],
    units: UnitsWanted | None = None,
    announcement: Announcement | None = None,
) -> list[Run] | None:
    """Store ``queued`` runs and their ``queued`` events with one statement, in autocommit.

    The runs' INSERT returns what their events need, and the events' INSERT returns the time
    the runs were stored at (the statement's start), so no ``SELECT`` of the time goes
    first. As atomic as a transaction, one statement being one. This is how the Submitter's
    batches arrive, one run when it is idle, a few under load.

    Args:
        db: The database; its backend has the capability ``one_statement_submit``.
        rows: The runs' columns (``row_of``'s), with ``delay_s``.
        units: The quota units the runs need, one each, taken in the same statement.
        announcement: The runs' wake-ups, sent by the same statement.

    Returns:
        The runs as stored; None when ``units`` were not all there as one statement takes
        them (the day's first use, or a quota nearly used up): then nothing was written.
    """
    delays = [timedelta(seconds=row["delay_s"]) for row in rows]
    bound = [
        {**{name: row[name] for name in _SUBMITTED}, "delay_us": delay // _MICROSECOND}
        for row, delay in zip(rows, delays, strict=True)
    ]
    params: dict[str, Any] = {"runs": bound, "status": _QUEUED, "type": EVENT_QUEUED, "data": {}}
    if units is not None:
        params |= take_all_parameters(
            units.tenant_id, units.day, limit=units.limit, wanted=len(rows)
        )
    if announcement is not None:
        params |= announcement.parameters(row["lane"] for row in rows)
    statement = _submit_statement(db.backend.name, units is not None, announcement is not None)
    stored = await db.write_statement_rows(statement, params)
    if not stored:
        return None
    stamped: dict[str, datetime] = {row.run_id: row.created_at for row in stored}
    made: list[Run] = []
    for row, delay in zip(rows, delays, strict=True):
        at = stamped[row["id"]]
        values = {
            **NULL_ON_INSERT,
            **row,
            "status": _QUEUED,
            "not_before": at + delay,
            "created_at": at,
            "updated_at": at,
        }
        made.append(run_from_row(values))
    return made


async def insert_stamped_txn(
    db: DatabaseManager,
    conn: AsyncConnection,
    rows: Sequence[dict[str, Any]],
    status: RunStatus,
    stmt: Insert,
) -> list[Run]:
    """Insert ``rows`` with ``stmt``, which stamps them with the database's time.

    ``stmt`` returns each row's time, and the ``queued`` events copy theirs from the rows
    (``INSERT … SELECT``): the time is never read in a statement of its own, a round trip
    less on the way to a worker. The events' statement carries the commit where the
    backend can (``DatabaseManager.commit_with_next_statement``).

    Args:
        db: The database.
        conn: The caller's write transaction.
        rows: The runs' columns (``row_of``'s), with ``delay_s``.
        status: ``pending`` or ``queued`` (which gets its ``queued`` event).
        stmt: The backend's ``stamped_runs_insert``.
    """
    params = [
        {
            **{key: value for key, value in row.items() if key != "delay_s"},
            "status": status.value,
            "delay_us": timedelta(seconds=row["delay_s"]) // _MICROSECOND,
        }
        # In tenant order, as RunInserts inserts them (see there).
        for row in sorted(rows, key=lambda row: (row["tenant_id"], row["id"]))
    ]
    stored = await conn.execute(stmt, params)
    stamped: dict[str, datetime] = {row.id: row.created_at for row in stored}
    if status is RunStatus.QUEUED:
        ids = [row["id"] for row in rows]
        event = {"ids": ids, "type": EVENT_QUEUED, "data": {}}
        await db.commit_with_next_statement(conn)
        await conn.execute(events_from_runs_statement(), event)
    by_id: dict[str, Run] = {}
    for param in params:
        at = stamped[param["id"]]
        delay = timedelta(microseconds=param.pop("delay_us"))
        values = {
            **NULL_ON_INSERT,
            **param,
            "not_before": at + delay,
            "created_at": at,
            "updated_at": at,
        }
        by_id[param["id"]] = run_from_row(values)
    return [by_id[row["id"]] for row in rows]
