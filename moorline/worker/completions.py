"""Group commit of run outcomes: many finished runs, one transaction.

A worker draining a queue of short runs finishes hundreds of them a second; one transaction
each would cap it at the database's commit rate. Executions hand their outcome to the
:class:`Completer` and await its verdict; a single writer takes everything waiting (up to
``max_batch``) and writes it with one fenced ``finish_many``. Under light load a batch is one
outcome and costs no added latency: the writer never waits for a batch to fill.
"""

import asyncio
import logging

from moorline.concurrency import settle
from moorline.db.repos.runs import Outcome, RunsRepo

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 256


class Completer:
    """Writes outcomes in batches; each ``complete`` call learns whether its own applied."""

    def __init__(self, runs: RunsRepo, *, max_batch: int = DEFAULT_MAX_BATCH) -> None:
        self._runs = runs
        self._max_batch = max_batch
        self._pending: asyncio.Queue[tuple[Outcome, asyncio.Future[bool]] | None] = asyncio.Queue()
        self.batches_written = 0

    async def complete(self, outcome: Outcome) -> bool:
        """Write ``outcome`` (in some batch); False when its lease was already gone.

        Raises:
            Exception: the batch could not be written even after ``with_retry``; the run
                stays ``running`` and the reaper takes it back when its lease expires.
        """
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending.put_nowait((outcome, future))
        return await future

    async def run(self) -> None:
        """The writer loop; returns after :meth:`close` once everything queued is written."""
        while True:
            first = await self._pending.get()
            if first is None:
                return
            batch = [first]
            closing = False
            while len(batch) < self._max_batch and not self._pending.empty():
                item = self._pending.get_nowait()
                if item is None:
                    closing = True
                    break
                batch.append(item)
            await self._write(batch)
            if closing:
                return

    async def _write(self, batch: list[tuple[Outcome, asyncio.Future[bool]]]) -> None:
        outcomes = [outcome for outcome, _ in batch]
        try:
            # finish_many retries transient disconnects itself (safe: every outcome is fenced).
            applied = await self._runs.finish_many(outcomes)
        except Exception as exc:
            logger.error("could not write %d run outcomes: %s", len(batch), exc)
            for _, future in batch:
                settle(future, exc)
            return
        self.batches_written += 1
        for (_, future), ok in zip(batch, applied, strict=True):
            settle(future, ok)

    def close(self) -> None:
        """Ask the writer to stop once everything queued so far is written."""
        self._pending.put_nowait(None)
