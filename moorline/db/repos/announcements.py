"""Wake-ups a write sends itself: the NOTIFY of new runs, in the write that stores them.

With LISTEN/NOTIFY wake-ups (:class:`~moorline.dispatch.pg_wakeups.PostgresWakeups`), a process
that stores runs could tell the other processes' workers with a ``pg_notify`` after the
write: a statement of its own on a connection of its own, about a fifth of the CPU of an
``app.submit`` on PostgreSQL (docs/performance.md, "2026-12-01, 15:20-16:30 UTC"). PostgreSQL
delivers a notification when the transaction that sent it commits, and never if it rolls
back, so the write that stores the runs sends them itself, in its own statement
(:func:`~moorline.db.repos.stamped_inserts.submit_in_one_statement`) or transaction: the
listeners hear of the runs when they can be claimed, and no round trip is added. The price:
PostgreSQL commits notifying transactions one at a time, so submitting processes wait on
each other's commits (docs/deploy.md says when to use Redis instead).

An :class:`Announcement` is what the write needs for that: the channel, and the origin that
tags each payload (``<origin>:<lane>``), by which the sender's own listener skips its echo.
"""

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Select, select
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.backends import Backend, DialectName, backend_for


def wake_payload(origin: str, lane: str) -> str:
    """The payload of one lane's wake-up from the process ``origin``."""
    return f"{origin}:{lane}"


@dataclass(frozen=True, slots=True)
class Announcement:
    """The wake-ups of a write's new runs, sent by the write itself (PostgreSQL)."""

    channel: str
    origin: str

    def parameters(self, lanes: Iterable[str]) -> dict[str, Any]:
        """The bound values of the backend's ``notify_condition`` for ``lanes``."""
        payloads = [wake_payload(self.origin, lane) for lane in sorted(set(lanes))]
        return {"wake_channel": self.channel, "wake_payloads": payloads}


def check_backend(backend: Backend, announcement: Announcement | None) -> None:
    """Refuse an announcement on a backend without notifications.

    Raises:
        ValueError: ``announcement`` is given and ``backend`` cannot send it.
    """
    if announcement is not None and backend.notify_condition() is None:
        raise ValueError(f"{backend.name} cannot send a write's wake-ups")


async def announce_txn(
    conn: AsyncConnection, backend: Backend, announcement: Announcement, lanes: Iterable[str]
) -> None:
    """Send the wake-ups of ``lanes`` when ``conn``'s transaction commits."""
    statement = _announce_statement(backend.name)
    if statement is None:  # pragma: no cover - check_backend refused it before
        raise ValueError(f"{backend.name} cannot send a write's wake-ups")
    await conn.execute(statement, announcement.parameters(lanes))


@functools.cache
def _announce_statement(name: DialectName) -> Select[tuple[bool]] | None:
    condition = backend_for(name).notify_condition()
    return None if condition is None else select(condition)
