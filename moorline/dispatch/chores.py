"""Leader-elected chores: a loop of passes every interval, acting only while it leads.

The reaper and the timer sweep are chores. Every process runs their loops; the
:class:`~moorline.dispatch.leader.LeaderElector` decides, pass by pass, which one acts, and
each pass is made of conditional statements, so two processes that both believe they lead
still move every run once. A pass that fails because the database is unreachable is logged and
the next one comes an interval later; any other error is a bug and ends the loop, for the
process's supervisor to report.
"""

import abc
import asyncio
import logging

from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from moorline.concurrency import is_set_within
from moorline.db.failures import is_transient
from moorline.dispatch.leader import LeaderElector
from moorline.errors import BackendUnavailable

logger = logging.getLogger(__name__)


def is_transient_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the database being unreachable for a while, not a bug.

    Lost or refused connections (after ``with_retry`` gave up), no failover address
    answering, an exhausted pool, a statement or connect timeout.
    """
    return is_transient(exc) or isinstance(
        exc, BackendUnavailable | PoolTimeoutError | ConnectionError | TimeoutError
    )


class LeaderChore(abc.ABC):
    """A pass every ``interval_s`` while ``elector`` says this process leads."""

    name: str
    """What the log calls the chore."""

    def __init__(self, elector: LeaderElector, *, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.elector = elector
        self.interval_s = interval_s

    @abc.abstractmethod
    async def _pass(self, stop: asyncio.Event | None) -> object:
        """One pass: nothing unless the elector's tick says this process leads."""

    async def run(self, stop: asyncio.Event) -> None:
        """Pass every ``interval_s`` until ``stop`` is set, then resign the leadership.

        A pass that fails because the database is unreachable is logged and the loop goes
        on; any other error ends the loop (after resigning) and propagates to the caller,
        whose supervisor stops the process rather than leave it running without the chore.
        Resigning lets another process take over at once instead of after the lease TTL.
        """
        try:
            while not stop.is_set():
                try:
                    await self._pass(stop)
                except Exception as exc:
                    if not is_transient_error(exc):
                        raise
                    logger.warning(
                        "%s pass failed, the database is unreachable; next pass in %.1fs: %s: %s",
                        self.name,
                        self.interval_s,
                        type(exc).__name__,
                        exc,
                    )
                await is_set_within(stop, self.interval_s)
        finally:
            await asyncio.shield(self._resign())

    async def _resign(self) -> None:
        try:
            await self.elector.resign()
        except Exception as exc:
            if not is_transient_error(exc):
                raise
            # The lease then simply expires after its TTL.
            logger.warning(
                "could not resign the %s leadership: %s: %s", self.name, type(exc).__name__, exc
            )
