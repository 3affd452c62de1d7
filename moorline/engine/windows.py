"""The interactive windows of a worker's attempts, opened and closed in shared round trips.

Every attempt opens its window as its workflow starts and closes it as the workflow returns
(:mod:`moorline.engine.conversations` says why). With a Redis store that is two round trips
per run, made while the run holds its slot: for short runs they cost as much CPU as the rest
of the run's bookkeeping, and they break up the batches of the claims and group commits around
them. Attempts of one worker start and end together (a claim hands out several runs; their
outcomes are committed together), so their windows change together too.

:class:`Windows` sends the changes asked for while the previous round trip was in flight as
one batch (:meth:`~moorline.runtime.base.RuntimeStore.change_windows`), in order: an idle
worker pays one round trip per change, as before, and a busy one a round trip per batch.
A close waits until it is in the store: the window is closed before the attempt's last events
and outcome are written. An attempt's first open is only queued (:meth:`Windows.begin`): its
workflow starts at once, and the attempt's first write waits for the open
(:mod:`moorline.engine.conversations` says why that keeps messages safe). When the workflow
returns before any batch has taken that open, the open is withdrawn and there is nothing to
close: a run that does nothing worth a message costs the store nothing.
"""

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from moorline.coalescer import Coalescer
from moorline.errors import BackendUnavailable
from moorline.runtime.base import RuntimeStore, WindowChange
from moorline.types import RunId

T = TypeVar("T")


class Windows:
    """Opens, keeps open and closes interactive windows through shared round trips.

    Opens and closes go in one stream, in the order they were asked for, one batch in flight
    at a time: a close asked for after an open (the heartbeat's, say) is applied after it, so
    a window never opens again behind its own close.

    Args:
        store: The RuntimeStore.
        ttl_s: A window's TTL; the heartbeat opens it again every third of it.
        timeout_s: Longest a batch may take before its callers are told the store is
            unreachable (the next batch is sent then).
    """

    def __init__(self, store: RuntimeStore, *, ttl_s: float, timeout_s: float) -> None:
        self._changes: Coalescer[WindowChange, bool] = Coalescer(self._send, name="windows")
        self._store = store
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s

    async def open(self, key: str, run_id: RunId) -> None:
        """Open (or extend) ``key``'s window for ``run_id``.

        Raises:
            BackendUnavailable: The store could not be reached, or did not answer in time.
        """
        await self.begin(key, run_id)

    def begin(self, key: str, run_id: RunId) -> asyncio.Future[bool]:
        """Queue the opening of ``key``'s window for ``run_id``, without waiting for it.

        Returns:
            The open's future; a failure is :class:`BackendUnavailable`, as for :meth:`open`.
        """
        return self._changes.submit(WindowChange(key, run_id, opens=True))

    def withdraw(self, opening: asyncio.Future[bool]) -> bool:
        """Take back an open of :meth:`begin` that no batch has taken yet (it is cancelled).

        Returns:
            True when it was withdrawn: the store never saw it, so there is nothing to close.
        """
        return self._changes.withdraw(opening)

    async def close(self, key: str, run_id: RunId) -> bool:
        """Close ``key``'s window if ``run_id`` holds it; True when it was closed.

        Raises:
            BackendUnavailable: The store could not be reached, or did not answer in time.
        """
        return await self._changes(WindowChange(key, run_id, opens=False))

    async def _send(self, changes: list[WindowChange]) -> list[bool]:
        return await within(self._store.change_windows(changes, self._ttl_s), self._timeout_s)


async def within(call: Awaitable[T], timeout_s: float) -> T:
    """Await a store call; one that takes longer than ``timeout_s`` counts as unreachable.

    A store behind a dropping network answers nothing until the client's own connect timeouts
    and retries give up (docs/reliability.md, P6), and an attempt runs on without the store
    anyway: waiting that long would only delay it.

    Raises:
        BackendUnavailable: The call failed, or took longer than ``timeout_s``.
    """
    try:
        async with asyncio.timeout(timeout_s):
            return await call
    except TimeoutError as exc:
        raise BackendUnavailable(
            f"the runtime store did not answer within {timeout_s:g} s"
        ) from exc
