"""Many callers' requests to one store, sent in batches: one batch in flight at a time.

A worker's attempts start and end together (a claim hands out several runs; their outcomes are
committed together), so their calls to the stores come together too: the window changes of
:mod:`moorline.engine.windows`, the cancel checks of the Redis store's step boundaries, the
step checkpoints of :mod:`moorline.db.repos.step_batches`. Sent as they come, each is a round
trip of its own; a :class:`Coalescer` sends those asked for while one batch is in flight as
the next batch, so an idle worker pays one round trip per call, as before, and a busy one a
round trip per batch.
"""

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from moorline.concurrency import settle

T = TypeVar("T")
R = TypeVar("R")


class Coalescer(Generic[T, R]):
    """Sends the items of many callers in batches, one batch in flight at a time.

    The items that arrive while a batch is in flight go together in the next, so under load
    each caller waits for one round trip shared by all. A failed batch fails every caller in
    it; a caller that stops waiting (a timeout) leaves its item in the batch.

    Args:
        send: Sends a batch; returns one result per item, in order.
        name: The sending task's name.
    """

    def __init__(self, send: Callable[[list[T]], Awaitable[Sequence[R]]], *, name: str) -> None:
        self._send = send
        self._name = name
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._sender: asyncio.Task[None] | None = None

    async def __call__(self, item: T) -> R:
        return await self.submit(item)

    def submit(self, item: T) -> asyncio.Future[R]:
        """Queue ``item`` for the next batch; the future has its result once it is sent."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._sender is None:
            # Scheduled, not run: the items asked for in this turn of the loop join the batch.
            self._sender = asyncio.create_task(self._send_all(), name=self._name)
        return future

    def withdraw(self, future: asyncio.Future[R]) -> bool:
        """Take back the item of ``future`` if no batch has taken it yet (``future`` cancelled).

        Returns:
            True when the item was withdrawn: it will never be sent.
        """
        for index, (_, waiting) in enumerate(self._pending):
            if waiting is future:
                del self._pending[index]
                future.cancel()
                return True
        return False

    async def _send_all(self) -> None:
        batch: list[tuple[T, asyncio.Future[R]]] = []
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    results = await self._send([item for item, _ in batch])
                except Exception as exc:
                    for _, future in batch:
                        settle(future, exc)
                else:
                    for (_, future), result in zip(batch, results, strict=True):
                        settle(future, result)
                batch = []
        finally:
            # Cancelled (the loop is closing): nobody may wait for ever on a batch not sent.
            for _, future in (*batch, *self._pending):
                future.cancel()
            self._pending = []
            self._sender = None
