"""Step checkpoints of a worker's attempts, written together: one statement for many runs.

A worker's attempts start and end together (a claim hands out several runs, and their
outcomes are committed together), so their steps start and finish together too. Each of
those writes is one fenced statement (:mod:`.step_statements`), but each is also a round trip
and a commit of its own: draining runs of one quick step on PostgreSQL, the step's two
statements cost the worker more CPU than everything else the run did.

:class:`StepBatches` sends the starts (and the finishes) asked for while one batch is in flight
as the next batch, in one statement whose rows are a single parameter
(:meth:`~moorline.db.backends.base.Backend.rows_parameter`, PostgreSQL only). The statement
locks the batch's runs in id order, as every multi-run lock is taken, skipping a run another
transaction holds, keeps those whose fence holds (and, for a start, whose cancel is not
recorded), writes their steps and returns which it wrote. A step it did not write is written
alone by the caller, the way it always was, and that write waits for a held run or finds out
why it may not write (a lost fence, a recorded cancel, a key already taken): a batch only
ever does what each of its steps' own statements would have done, so the rules of
:mod:`.steps` hold unchanged. An idle worker's lone write is sent alone, as before, one turn of
the event loop later (the turn in which other writes could have joined it).
"""

from collections.abc import Mapping
from typing import Any

from sqlalchemy import (
    CTE,
    Insert,
    Integer,
    String,
    Update,
    and_,
    any_,
    bindparam,
    insert,
    literal,
    select,
    type_coerce,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.types import TypeEngine

from moorline.coalescer import Coalescer
from moorline.db.backends import Backend
from moorline.db.manager import DatabaseManager
from moorline.db.repos.records import is_running
from moorline.db.schema import runs, steps
from moorline.types import StepStatus

Parameters = Mapping[str, Any]
"""One step's parameters, as :meth:`~.steps.StepsRepo` binds them for its own statement."""

_FENCE = {"fence_run_id": "run_id", "fence_attempt": "attempt", "fence_owner": "owner"}
"""The fence's parameters and the batch columns that carry them."""

_START = {
    **_FENCE,
    "step_key": "key",
    "step_function": "function",
    "step_call_hash": "call_hash",
    "step_seq": "seq",
}
_SUCCEED = {**_FENCE, "step_key": "key", "step_output": "boxed"}


class StepBatches:
    """Starts and finishes of many attempts' steps, a statement per batch (see the module)."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db
        backend = db.backend
        self._starts: Coalescer[Parameters, bool] = Coalescer(self._start_all, name="step starts")
        self._successes: Coalescer[Parameters, bool] = Coalescer(
            self._succeed_all, name="step successes"
        )
        self._start_statement = _start_statement(backend)
        self._succeed_statement = _succeed_statement(backend)

    @staticmethod
    def can_batch(backend: Backend) -> bool:
        """Whether ``backend`` can bind a batch's rows as one parameter."""
        return backend.rows_parameter("probe", {"run_id": String()}) is not None

    async def start(self, parameters: Parameters) -> bool:
        """Start a new step now (``insert_new``'s parameters with ``seq``; a cancel refuses).

        Returns:
            True: the step is ``running`` under the fence. False: nothing was written for it
            (a batch of one, or its fence, its cancel or its key kept it out): the caller
            writes it alone.
        """
        return await self._starts(parameters)

    async def succeed(self, parameters: Parameters) -> bool:
        """Record a step's success (``succeed``'s parameters, no usage); as :meth:`start`."""
        return await self._successes(parameters)

    async def _start_all(self, batch: list[Parameters]) -> list[bool]:
        return await self._write(self._start_statement, [_row(item, _START) for item in batch])

    async def _succeed_all(self, batch: list[Parameters]) -> list[bool]:
        rows = [_row(item, _SUCCEED) for item in batch]
        for row in rows:
            # A JSON null read out of a recordset is SQL NULL; out of an object it stays null.
            row["boxed"] = {"output": row["boxed"]}
        return await self._write(self._succeed_statement, rows)

    async def _write(self, statement: Insert | Update, rows: list[dict[str, Any]]) -> list[bool]:
        if len(rows) == 1:
            return [False]  # alone: the step's own statement, as an idle worker always sent it
        parameters = {"steps": rows, "run_ids": sorted({row["run_id"] for row in rows})}
        try:
            written = await self._db.write_statement_rows(statement, parameters)
        except Exception:
            # A key taken, a lost connection (the batch may have committed), a database that
            # does not answer: each step's own write decides, retried as it always was
            # (``with_retry``), and finds its row if the batch wrote it.
            return [False] * len(rows)
        done = {(row.run_id, row.key) for row in written}
        return [(row["run_id"], row["key"]) in done for row in rows]


def _row(item: Parameters, names: Mapping[str, str]) -> dict[str, Any]:
    """A step's parameters as a row of the batch (``names``: parameter → column)."""
    return {column: item[name] for name, column in names.items()}


def _fenced_batch(
    backend: Backend, columns: Mapping[str, TypeEngine[Any]], *, refuse_cancelled: bool
) -> CTE:
    """The batch's rows whose fence holds on their run's row, locked in id order (or skipped).

    Each row has the step's run, attempt, owner and key, then ``columns``.

    ``runs.id = ANY(:run_ids)`` finds the rows by primary key whatever the planner guesses
    of the batch's size; the join keeps each row's own fence.
    """
    keyed: dict[str, TypeEngine[Any]] = {
        "run_id": String(),
        "attempt": Integer(),
        "owner": String(),
        "key": String(),
    }
    batch = backend.rows_parameter("steps", {**keyed, **columns})
    if batch is None:  # pragma: no cover - StepBatches.can_batch is checked first
        raise AssertionError(f"{backend.name} has no rows parameter")
    fenced = and_(
        runs.c.id == batch.c.run_id,
        runs.c.attempt == batch.c.attempt,
        runs.c.lease_owner == batch.c.owner,
    )
    chosen = (
        select(runs.c.attempt, batch)
        .select_from(runs.join(batch, fenced))
        .where(
            runs.c.id == any_(bindparam("run_ids", type_=postgresql.ARRAY(String()))),
            is_running(),
        )
        .order_by(runs.c.id)
    )
    if refuse_cancelled:
        chosen = chosen.where(runs.c.cancel_requested_at.is_(None))
    # SKIP LOCKED: a run another transaction holds (a cancel, a reclaim) is left to its step's
    # own statement, which waits for it; the batch, and the batches queued behind it, do not.
    return chosen.with_for_update(of=runs, key_share=True, skip_locked=True).cte("fenced")


def _start_statement(backend: Backend) -> Insert:
    """``WITH fenced AS (…) INSERT INTO steps … SELECT … FROM fenced RETURNING run_id, key``.

    Each row as :func:`~.step_statements.insert_new_statement` (numbered, refusing a recorded
    cancel, started now) writes it: ``running`` under the run's attempt.
    """
    fenced = _fenced_batch(
        backend,
        {"function": String(), "call_hash": String(), "seq": Integer()},
        refuse_cancelled=True,
    )
    columns = {
        "run_id": fenced.c.run_id,
        "key": fenced.c.key,
        "status": literal(StepStatus.RUNNING.value, steps.c.status.type),
        "attempt": fenced.c.attempt,
        "function": fenced.c.function,
        "call_hash": fenced.c.call_hash,
        "started_at": backend.now(),
        "seq": fenced.c.seq,
    }
    return (
        insert(steps)
        .from_select(list(columns), select(*columns.values()))
        .returning(steps.c.run_id, steps.c.key)
    )


def _succeed_statement(backend: Backend) -> Update:
    """``WITH fenced AS (…) UPDATE steps … FROM fenced … RETURNING run_id, key``.

    Each row as :func:`~.step_statements.finish_statement` (succeeded) writes it: only a step
    ``running`` under the fence's attempt.
    """
    fenced = _fenced_batch(backend, {"boxed": postgresql.JSONB()}, refuse_cancelled=False)
    return (
        update(steps)
        .where(
            steps.c.run_id == fenced.c.run_id,
            steps.c.key == fenced.c.key,
            steps.c.attempt == fenced.c.attempt,
            steps.c.status == StepStatus.RUNNING.value,
        )
        .values(
            status=StepStatus.SUCCEEDED.value,
            output=type_coerce(fenced.c.boxed.op("->")("output"), steps.c.output.type),
            error=None,
            finished_at=backend.now(),
        )
        .returning(steps.c.run_id, steps.c.key)
    )
