"""Run events: the ordered record of what happened in a run (``seq`` counts from 1 per run).

Events are written only inside the transaction that makes the transition they record (a claim,
a finish, a reap), by :func:`append_events_txn`; a transition that matched no row writes no
event. A workflow's own events (``ctx.emit``) go through :meth:`EventsRepo.append`, fenced by
the attempt like a step checkpoint. Their type names are persisted and streamed, so they are
contract (``tests/compat``).
"""

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import RowMapping, func, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.elements import ColumnElement

from moorline.db.dialects import DialectName, db_now
from moorline.db.manager import DatabaseManager
from moorline.db.repos.records import Event, Fence
from moorline.db.repos.steps import hold_fence_txn
from moorline.db.schema import events
from moorline.types import Attempt, JSONObject, RunId

EVENT_QUEUED = "queued"
EVENT_STARTED = "started"
EVENT_RETRYING = "retrying"
EVENT_RECLAIMED = "reclaimed"
EVENT_SUCCEEDED = "succeeded"
EVENT_FAILED = "failed"
EVENT_CANCELLED = "cancelled"
EVENT_RELEASED = "released"

DEFAULT_LIST_LIMIT = 1000

# Bound parameters per IN list: PostgreSQL (asyncpg) allows 32,767 per statement; a chunk of
# this size leaves room for the rest of the statement on every backend.
_IN_CHUNK = 1000


async def append_events_txn(
    conn: AsyncConnection,
    dialect: DialectName,
    items: Sequence[tuple[RunId, Attempt, str, JSONObject]],
    *,
    now: datetime | None = None,
    new_runs: bool = False,
) -> None:
    """Append one event per item, each at its run's next ``seq``, in the caller's transaction.

    The caller holds each run's row (it just changed or inserted it under a fence or
    predicate), which serialises this run's writers; that is what makes ``max(seq) + 1`` safe
    here. Several items for one run get consecutive numbers in item order.

    Args:
        conn: The caller's connection, inside its write transaction.
        dialect: The database's dialect.
        items: ``(run id, attempt, event type, data)`` per event.
        now: ``created_at`` of every event: a database time the caller already read in this
            transaction. None evaluates database time in the INSERT itself. Passing a value
            keeps the INSERT free of SQL functions, which lets aiomysql send a batch as one
            multi-row statement instead of one statement per row.
        new_runs: The runs were inserted in this transaction, so none has an event yet and
            the ``max(seq)`` read is skipped.
    """
    if not items:
        return
    run_ids = [] if new_runs else sorted({run_id for run_id, *_ in items})
    seqs: dict[str, int] = {}
    for offset in range(0, len(run_ids), _IN_CHUNK):
        chunk = run_ids[offset : offset + _IN_CHUNK]
        last = (
            select(events.c.run_id, func.max(events.c.seq).label("seq"))
            .where(events.c.run_id.in_(chunk))
            .group_by(events.c.run_id)
        )
        seqs.update({row.run_id: row.seq for row in await conn.execute(last)})
    params: list[dict[str, Any]] = []
    for run_id, attempt, event_type, data in items:
        seqs[run_id] = seqs.get(run_id, 0) + 1
        params.append(
            {
                "run_id": run_id,
                "seq": seqs[run_id],
                "type": event_type,
                "attempt": attempt,
                "data": data,
            }
        )
    created_at: datetime | ColumnElement[datetime] = now if now is not None else db_now(dialect)
    await conn.execute(insert(events).values(created_at=created_at), params)


def event_from_row(row: RowMapping) -> Event:
    """The :class:`Event` an ``events`` row holds."""
    return Event(
        run_id=RunId(row["run_id"]),
        seq=row["seq"],
        type=row["type"],
        attempt=Attempt(row["attempt"]),
        data=row["data"],
        created_at=row["created_at"],
    )


class EventsRepo:
    """Reads a run's events; appends a workflow's own events under the attempt's fence."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db
        self._dialect: DialectName = db.dialect

    async def append(self, fence: Fence, event_type: str, data: JSONObject) -> Event:
        """Append one event to the fence's run, at its next ``seq``, while the fence holds.

        One transaction: the fence's row lock serialises the run's writers, which makes the
        ``seq`` safe. Not wrapped in ``with_retry``: an append is not idempotent, and a retry
        after a lost commit acknowledgement would record the event twice.

        Raises:
            LeaseLost: The fence no longer holds; nothing was written.
        """
        async with self._db.write_transaction() as conn:
            await hold_fence_txn(conn, self._dialect, fence, f"event {event_type!r}")
            await append_events_txn(
                conn, self._dialect, [(fence.run_id, fence.attempt, event_type, data)]
            )
            last = (
                select(events)
                .where(events.c.run_id == fence.run_id)
                .order_by(events.c.seq.desc())
                .limit(1)
            )
            row = (await conn.execute(last)).mappings().one()
        return event_from_row(row)

    async def list(
        self, run_id: RunId, *, after_seq: int = 0, limit: int = DEFAULT_LIST_LIMIT
    ) -> list[Event]:
        """The run's events with ``seq`` above ``after_seq``, in ``seq`` order.

        Args:
            run_id: The run whose events to read; an unknown run has none.
            after_seq: Return only events after this one (an SSE ``Last-Event-ID``).
            limit: Most events to return; page on with the last ``seq`` returned.
        """
        if limit < 1:
            return []
        stmt = (
            select(events)
            .where(events.c.run_id == run_id, events.c.seq > after_seq)
            .order_by(events.c.seq)
            .limit(limit)
        )

        async def read() -> list[Event]:
            async with self._db.connect() as conn:
                return [event_from_row(row) for row in (await conn.execute(stmt)).mappings()]

        return await self._db.with_retry(read)
