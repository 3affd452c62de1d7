"""Fencing: an attempt's writes prove that it still holds the run (invariant 2).

Each write proves it in its own transaction and locks the run's row while it writes.
:func:`hold_fence_txn` is the two-statement form, for transactions that write more than one
thing (steps, events, interrupts, messages); :func:`fence_by_parameters` is the condition for
statements built once that carry the fence themselves (a step's start and finish).
"""

import functools
from typing import Any

from sqlalchemy import ColumnElement, Update, and_, bindparam, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.backends import DialectName, backend_for
from moorline.db.repos.records import Fence, is_running
from moorline.db.schema import runs
from moorline.errors import CancelRequested, LeaseLost


async def hold_fence_txn(
    conn: AsyncConnection,
    dialect: DialectName,
    fence: Fence,
    action: str,
    *,
    refuse_cancelled: bool = False,
) -> None:
    """Prove ``fence`` still holds and lock the run's row until the transaction ends.

    With ``refuse_cancelled`` the same statement also requires that no cancel is recorded.
    ``RunsRepo.request_cancel`` takes the same row lock and reads the database time only once
    it holds it, so whatever starts here either commits before ``cancel_requested_at`` (and
    is dated before it) or finds the request and starts nothing: no step starts after its
    run's cancel was recorded. The happy path stays one statement; only a miss reads again, to
    tell a lost lease from a cancel.

    Args:
        conn: The caller's connection, inside a ``DatabaseManager.write_transaction()``.
        dialect: The database's dialect.
        fence: The writer's fence.
        action: What the caller is about to write, for the error message.
        refuse_cancelled: The caller starts new work (a step, an interrupt), which a
            recorded cancel forbids; finishing work already started is always allowed.

    Raises:
        LeaseLost: The fence matches no ``runs`` row; the caller must write nothing.
        CancelRequested: The fence holds but the run's cancel is recorded (only with
            ``refuse_cancelled``); the caller must write nothing.
    """
    parameters = fence_parameters(fence)
    result = await conn.execute(_hold_statement(dialect, refuse_cancelled), parameters)
    if result.rowcount == 1:
        return
    if refuse_cancelled and (await conn.execute(_STILL_OURS, parameters)).first() is not None:
        raise CancelRequested(fence, action)
    raise LeaseLost(fence, action)


@functools.cache
def _hold_statement(dialect: DialectName, refuse_cancelled: bool) -> Update:
    """``UPDATE runs SET updated_at = now WHERE <fence>`` (and no cancel), built once."""
    held = fence_by_parameters()
    if refuse_cancelled:
        held = and_(held, runs.c.cancel_requested_at.is_(None))
    return update(runs).where(held).values(updated_at=backend_for(dialect).now())


def fence_by_parameters() -> ColumnElement[bool]:
    """:meth:`Fence.clause` with the fence as the bound parameters of :func:`fence_parameters`.

    For statements built once and executed with the fence's values: building a statement costs
    more than a round trip to SQLite.
    """
    return and_(
        runs.c.id == bindparam("fence_run_id", type_=runs.c.id.type),
        runs.c.attempt == bindparam("fence_attempt", type_=runs.c.attempt.type),
        runs.c.lease_owner == bindparam("fence_owner", type_=runs.c.lease_owner.type),
        is_running(),
    )


def fence_parameters(fence: Fence) -> dict[str, Any]:
    """The values of :func:`fence_by_parameters`' bound parameters for ``fence``."""
    return {
        "fence_run_id": fence.run_id,
        "fence_attempt": fence.attempt,
        "fence_owner": fence.owner,
    }


_STILL_OURS = select(runs.c.cancel_requested_at).where(fence_by_parameters())
