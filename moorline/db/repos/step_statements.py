"""The statements of step checkpoints, built once per repository (see :mod:`.steps`).

Each is one fenced statement: it reads the run's row under the attempt's fence and locks it,
and writes the step only where the fence holds (the module docstring of :mod:`.steps` says why
that is as safe as locking the run first).
"""

from typing import Any

from sqlalchemy import (
    ColumnElement,
    Insert,
    Integer,
    Update,
    bindparam,
    func,
    insert,
    literal,
    select,
    update,
)

from moorline.db.backends import Backend
from moorline.db.repos.fences import fence_by_parameters
from moorline.db.schema import runs, steps
from moorline.types import StepStatus

RUNNING = StepStatus.RUNNING.value
SUCCEEDED = StepStatus.SUCCEEDED.value


def next_seq(run_id: ColumnElement[Any]) -> ColumnElement[int]:
    """The ``seq`` of a run's next new step: one more than its largest (1 for the first).

    Taken under the run's row lock (the fence), so a run's steps started one after another
    are numbered in order; two started at once by ``asyncio.gather`` may share a number on a
    server (its statement snapshot predates the lock wait), and then sort by time and key.
    """
    earlier = steps.alias("earlier")
    return (
        select(func.coalesce(func.max(earlier.c.seq), 0) + 1)
        .where(earlier.c.run_id == run_id)
        .scalar_subquery()
    )


def insert_new_statement(
    backend: Backend, *, numbered: bool, refuse_cancelled: bool = True
) -> Insert:
    """``INSERT INTO steps … SELECT … FROM runs WHERE <fence> AND no cancel`` (locked).

    Parameters: the fence's, ``step_key``, ``step_function`` and ``step_call_hash``; with
    ``numbered``, ``step_seq`` and ``step_elapsed_s`` (the start is dated that long ago: a
    start written once the function has run that long). Without ``refuse_cancelled`` a
    recorded cancel does not stop it (the function was called already).
    """
    return _insert_from_run(
        backend,
        {
            **_called(RUNNING),
            "started_at": backend.now_less("step_elapsed_s") if numbered else backend.now(),
            "seq": bindparam("step_seq", type_=Integer()) if numbered else next_seq(runs.c.id),
        },
        refuse_cancelled=refuse_cancelled,
    )


def finish_statement(backend: Backend, status: StepStatus, *, counted: bool = False) -> Update:
    """``UPDATE steps … WHERE <running under the attempt> AND EXISTS (<fenced run, locked>)``.

    Parameters: the fence's, ``step_key``, and ``step_output`` (succeeded) or ``step_error``
    (failed); with ``counted``, ``step_usage`` too (the step's model calls).
    """
    fenced_run = backend.lock_rows(select(runs.c.id).where(fence_by_parameters()))
    values: dict[str, Any] = (
        {"output": bindparam("step_output", type_=steps.c.output.type), "error": None}
        if status is StepStatus.SUCCEEDED
        # The output stays SQL NULL: start() cleared it when this attempt took the step.
        else {"error": bindparam("step_error", type_=steps.c.error.type)}
    )
    if counted:
        values["usage"] = bindparam("step_usage", type_=steps.c.usage.type)
    return (
        update(steps)
        .where(
            steps.c.run_id == bindparam("fence_run_id", type_=runs.c.id.type),
            steps.c.key == bindparam("step_key", type_=steps.c.key.type),
            steps.c.attempt == bindparam("fence_attempt", type_=runs.c.attempt.type),
            steps.c.status == RUNNING,
            fenced_run.exists(),
        )
        .values(status=status.value, finished_at=backend.now(), **values)
    )


def record_statement(backend: Backend, *, refuse_cancelled: bool, counted: bool) -> Insert:
    """``INSERT INTO steps … SELECT … FROM runs WHERE <fence>`` of a step that has ended.

    A step whose function returned before its start was written is recorded ``succeeded`` by
    this one statement, its start dated ``step_elapsed_s`` before the database's time. With
    ``refuse_cancelled`` it writes nothing when the run's cancel is recorded.

    Parameters: the fence's, ``step_key``, ``step_function``, ``step_call_hash``,
    ``step_seq``, ``step_output``, ``step_elapsed_s``; with ``counted``, ``step_usage``.
    """
    columns: dict[str, Any] = {
        **_called(SUCCEEDED),
        "started_at": backend.now_less("step_elapsed_s"),
        "finished_at": backend.now(),
        "seq": bindparam("step_seq", type_=Integer()),
        "output": bindparam("step_output", type_=steps.c.output.type),
    }
    if counted:
        columns["usage"] = bindparam("step_usage", type_=steps.c.usage.type)
    return _insert_from_run(backend, columns, refuse_cancelled=refuse_cancelled)


def _called(status: str) -> dict[str, Any]:
    """A new step row's identity columns: the fenced run's, the call's, and ``status``."""
    return {
        "run_id": runs.c.id,
        "key": bindparam("step_key", type_=steps.c.key.type),
        "status": literal(status, steps.c.status.type),
        "attempt": runs.c.attempt,
        "function": bindparam("step_function", type_=steps.c.function.type),
        "call_hash": bindparam("step_call_hash", type_=steps.c.call_hash.type),
    }


def _insert_from_run(
    backend: Backend, columns: dict[str, Any], *, refuse_cancelled: bool
) -> Insert:
    """``INSERT INTO steps (columns) SELECT … FROM runs WHERE <fence>``, the run's row locked.

    With ``refuse_cancelled``, also ``AND`` no cancel recorded.
    """
    source = select(*columns.values()).where(fence_by_parameters())
    if refuse_cancelled:
        source = source.where(runs.c.cancel_requested_at.is_(None))
    return insert(steps).from_select(list(columns), backend.lock_rows(source))
