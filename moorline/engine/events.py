"""How an attempt writes its events: persisted under the fence, in batches, then fanned out live.

``ctx.emit`` events are durable first and live second: each is written with the next ``seq`` of
the run in a transaction fenced by the attempt (a taken-over attempt writes nothing), and only
after the commit is it published through the RuntimeStore, so a live subscriber never sees an
event the database does not have, and a gap in the ``seq`` it receives can always be filled
from the database.

High-rate ``delta`` events (streamed LLM tokens) are buffered and written in batches, one
transaction and one Pub/Sub message per batch. The buffer is written

- in the background once it holds ``batch_size`` events, without stopping the workflow: while
  one batch commits, the next one gathers, so batches grow with the rate (group commit, up to
  :data:`MAX_BATCH_ROWS` rows a transaction). Only when ``max_pending`` events wait does the
  emitting workflow wait for the writer: it is the producer, and this is its backpressure;
- ``flush_interval_s`` after the first buffered event, by a timer, so a trickle still streams;
- before any other event, in the same transaction (order holds);
- before every other write of the attempt: step checkpoints, interrupts, message drains, and
  the attempt's outcome (durability points hold: a checkpoint never precedes a delta emitted
  before it). Progress events alone at a workflow's return are the exception: they are
  handed to the worker (:meth:`EventWriter.take_progress`) and committed in the outcome's own
  transaction, before the outcome's event.

One lock orders the writes, so events are committed and published in ``seq`` order. A write
that fails (the lease was lost, the database stayed away) is remembered and raised again by
the next emit or flush: the events of that batch are not written, and the attempt stops.
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import datetime

from moorline.db.repos.events import EventsRepo
from moorline.db.repos.records import Event, Fence
from moorline.errors import AttemptStopped, BackendUnavailable
from moorline.runtime.base import RuntimeStore
from moorline.types import Attempt, JSONObject, RunId

logger = logging.getLogger(__name__)

EVENT_DELTA = "delta"
EVENT_STEP_STARTED = "step_started"
"""A step's function is called: ``{"key", "try"}`` (the try within this attempt, from 1)."""
EVENT_STEP_FINISHED = "step_finished"
"""A step's call ended: ``{"key", "try", "status": "succeeded"|"failed", "duration_ms"}``,
and ``"error"`` when it failed."""
EVENT_PERMISSION_REQUEST = "permission_request"
"""The workflow waits for a decision: ``{"interrupt_id", "action", "data", "expires_at"}``."""
EVENT_PERMISSION_RESOLVED = "permission_resolved"
"""The wait ended: ``{"interrupt_id", "approved", "reason", "data"}``."""

PROGRESS_EVENT_TYPES = frozenset(
    {EVENT_STEP_STARTED, EVENT_STEP_FINISHED, EVENT_PERMISSION_RESOLVED}
)
"""Buffered, and not written ahead of a checkpoint: the checkpoint (for a decision, the
interrupt's row) is the record, these only show progress live, and a step or a resumed
workflow does not wait for their write. They keep their place among the other events (one
buffer) and are written by the batch's timer, with the next other event, or with the
outcome; a crash may lose an attempt's last ones, never the records they describe."""

BUFFERED_EVENT_TYPES = frozenset({EVENT_DELTA}) | PROGRESS_EVENT_TYPES
"""Event types written in batches; every other type is written (with the batch) at once."""

DEFAULT_BATCH_SIZE = 256
"""Most buffered events in one transaction and one Pub/Sub message."""

DEFAULT_FLUSH_INTERVAL_S = 0.05
"""Longest a buffered event waits for its batch, in seconds: the live latency of a trickle."""

MAX_BATCH_ROWS = 1024
"""Most events in one transaction (a bound on statement size and bound parameters)."""

PENDING_BATCHES = 8
"""``max_pending`` is this many batches: how far the workflow may run ahead of the writer."""


def live_payload(event: Event, created_at: str | None = None) -> JSONObject:
    """The JSON object an event travels as through the RuntimeStore.

    Args:
        event: The stored event.
        created_at: ``event.created_at`` in ISO format, when the caller has it already (the
            events of one transaction share it).
    """
    return {
        "seq": event.seq,
        "type": event.type,
        "attempt": event.attempt,
        "data": event.data,
        "created_at": created_at if created_at is not None else event.created_at.isoformat(),
    }


def event_from_payload(run_id: RunId, payload: JSONObject) -> Event:
    """The :class:`Event` a :func:`live_payload` object describes.

    Raises:
        ValueError: A field is missing or of the wrong type.
    """
    seq, event_type, attempt = payload.get("seq"), payload.get("type"), payload.get("attempt")
    created_at = payload.get("created_at")
    if not (
        isinstance(seq, int)
        and isinstance(event_type, str)
        and isinstance(attempt, int)
        and isinstance(created_at, str)
    ):
        raise ValueError(f"not a live event of run {run_id}: {payload!r}")
    return Event(
        run_id=run_id,
        seq=seq,
        type=event_type,
        attempt=Attempt(attempt),
        data=payload.get("data"),
        created_at=datetime.fromisoformat(created_at),
    )


class EventWriter:
    """The event writer of one attempt (see the module docstring).

    Args:
        fence: The attempt's fence; every write is conditional on it.
        events: The events repository.
        store: Where committed events are published.
        batch_size: Buffered events that start a background write.
        flush_interval_s: Longest a buffered event waits before a timer writes it.
        max_pending: Buffered events at which the emitting workflow waits for the writer
            (default ``PENDING_BATCHES`` batches).
        opened: Awaited before the attempt's first write, an event's or a checkpoint's
            (:meth:`flush_before_checkpoint`): its interactive window is open by then
            (:meth:`~moorline.engine.conversations.Conversations.opened`).
    """

    def __init__(
        self,
        fence: Fence,
        *,
        events: EventsRepo,
        store: RuntimeStore,
        batch_size: int = DEFAULT_BATCH_SIZE,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        max_pending: int | None = None,
        opened: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        max_pending = batch_size * PENDING_BATCHES if max_pending is None else max_pending
        if max_pending < batch_size:
            raise ValueError(f"max_pending ({max_pending}) is below batch_size ({batch_size})")
        if flush_interval_s <= 0:
            raise ValueError(f"flush_interval_s must be positive, got {flush_interval_s}")
        self._fence = fence
        self._events = events
        self._store = store
        self._batch_size = batch_size
        self._flush_interval_s = flush_interval_s
        self._max_pending = max_pending
        self._pending: list[tuple[str, JSONObject]] = []
        self._durable = 0
        """Of ``_pending``, the events a checkpoint must not precede (all but progress)."""
        self._lock = asyncio.Lock()
        self._timer: asyncio.TimerHandle | None = None
        self._writer: asyncio.Task[None] | None = None
        self._room = asyncio.Event()
        """Set while fewer than ``max_pending`` events wait: the workflow may emit on."""
        self._room.set()
        self._error: BaseException | None = None
        self._opened = opened
        self.batches_written = 0

    @property
    def pending(self) -> int:
        """Buffered events not written yet."""
        return len(self._pending)

    async def add(self, event_type: str, data: JSONObject) -> None:
        """Buffer an event; it is written with its batch (see the module docstring).

        Returns at once unless ``max_pending`` events wait: then once the writer has taken a
        batch (the workflow emits on while that batch commits).

        Raises:
            LeaseLost: A previous write found the fence gone; nothing more is written.
            Exception: The error another previous write ended with.
        """
        self._raise_error()
        self._pending.append((event_type, data))
        if event_type not in PROGRESS_EVENT_TYPES:
            self._durable += 1
        if len(self._pending) < self._batch_size:
            if self._timer is None and not self._is_writing:
                loop = asyncio.get_running_loop()
                self._timer = loop.call_later(self._flush_interval_s, self._start_writer)
            return
        self._start_writer()
        if len(self._pending) >= self._max_pending:
            self._room.clear()
            await self._room.wait()
            self._raise_error()

    async def write(self, event_type: str, data: JSONObject) -> Event:
        """Write the buffered events and this one, in one transaction; return this one.

        Raises:
            LeaseLost: The fence no longer holds; nothing was written.
        """
        async with self._lock:
            self._raise_error()
            written = await self._write_locked([(event_type, data)])
        return written[-1]

    async def flush(self) -> None:
        """Write the buffered events, after any write in progress.

        Raises:
            LeaseLost: The fence no longer holds; nothing was written.
        """
        if not self._pending and not self._lock.locked():
            self._raise_error()
            return
        async with self._lock:
            self._raise_error()
            await self._write_locked([])

    async def flush_before_checkpoint(self) -> None:
        """:meth:`flush`, unless only progress events wait (see :data:`PROGRESS_EVENT_TYPES`).

        Raises:
            LeaseLost: A write found the fence gone; nothing more is written.
        """
        if self._durable == 0 and not self._lock.locked():
            self._raise_error()
            await self._open()
            return
        await self.flush()

    def take_progress(self) -> list[tuple[str, JSONObject]] | None:
        """Hand over the buffered events if all are progress events; None if any is not.

        For the attempt's end: progress events are written with its outcome (in the worker's
        outcome batch, before the outcome's event) instead of in a transaction of their own.
        None when a durable event waits or a write is in progress: then :meth:`flush`.

        Raises:
            LeaseLost: A previous write found the fence gone; nothing more is written.
        """
        self._raise_error()
        if self._durable or self._lock.locked() or self._is_writing:
            return None
        self._cancel_timer()
        taken, self._pending = self._pending, []
        self._room.set()
        return taken

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Flush, then keep every other event write out until the block ends.

        For a write that appends events of its own (a message drain): it publishes them with
        :meth:`publish` inside the block, so they go out in ``seq`` order too.
        """
        async with self._lock:
            self._raise_error()
            await self._write_locked([])
            yield

    async def publish(self, events: Sequence[Event]) -> None:
        """Fan committed events out live; a store that cannot be reached costs only liveness."""
        if not events:
            return
        # The events of one transaction share its clock reading: format it once.
        stamp = events[0].created_at
        iso = stamp.isoformat()
        payloads = [
            live_payload(event, iso if event.created_at is stamp else None) for event in events
        ]
        try:
            await self._store.publish_events(self._fence.run_id, payloads)
        except BackendUnavailable as exc:
            # Live fan-out is best-effort: streams read the database and catch up.
            logger.warning(
                "run %s: %d live events not published: %r",
                self._fence.run_id,
                len(events),
                exc,
                extra={"run_id": self._fence.run_id, "attempt": self._fence.attempt},
            )

    def abandon(self) -> None:
        """Drop the buffered events and stop writing (the attempt is being cancelled)."""
        self._pending.clear()
        self._durable = 0
        self._room.set()
        self._cancel_timer()
        if self._writer is not None:
            self._writer.cancel()

    @property
    def _is_writing(self) -> bool:
        return self._writer is not None and not self._writer.done()

    async def _write_locked(self, extra: list[tuple[str, JSONObject]]) -> list[Event]:
        """Write everything buffered (and ``extra`` after it), a batch per transaction."""
        self._cancel_timer()
        await self._open()
        self._pending.extend(extra)
        # Everything buffered is written below (or the attempt is over): none left to wait for.
        self._durable = 0
        written: list[Event] = []
        while self._pending:
            # Taken at each turn: what was emitted while the last batch committed joins this one.
            items = self._pending[:MAX_BATCH_ROWS]
            del self._pending[:MAX_BATCH_ROWS]
            if len(self._pending) < self._max_pending:
                self._room.set()
            try:
                batch = await self._events.append_many(self._fence, items)
            except (Exception, AttemptStopped) as exc:
                self._pending.clear()
                self._error = exc
                self._room.set()
                raise
            self.batches_written += 1
            await self.publish(batch)
            written += batch
        return written

    async def _open(self) -> None:
        """Wait for the attempt's window the first time (see ``opened``)."""
        if self._opened is not None:
            await self._opened()
            self._opened = None

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _start_writer(self) -> None:
        """Write the buffer in a background task (one at a time), from the timer or ``add``."""
        self._timer = None
        if not self._is_writing:
            self._writer = asyncio.create_task(
                self._write_quietly(), name=f"events:{self._fence.run_id}:{self._fence.attempt}"
            )

    async def _write_quietly(self) -> None:
        try:
            await self.flush()
        except (Exception, AttemptStopped) as exc:
            # Remembered by _write_locked: the workflow's next emit, checkpoint or outcome
            # raises it.
            logger.debug("run %s: background event write failed: %r", self._fence.run_id, exc)
            return
        if self._pending and self._timer is None:
            # Emitted after the last batch was taken, while this task still counted as
            # writing: the timer writes them.
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._flush_interval_s, self._start_writer)
