"""Reading a run's events as a stream: stored ones after a cursor, then live ones, each once.

What an SSE route needs (``GET /v1/runs/{id}/events`` with ``Last-Event-ID``): every event of
the run after a given ``seq``, in ``seq`` order, with neither gaps nor duplicates, until the run
ends. :class:`EventStream` joins the two sources at a seam that cannot lose anything:

1. it subscribes to the run's live events *first*, so nothing published from then on escapes;
2. it reads the stored events after the cursor from the database, page by page;
3. it then takes live batches, keeping each event whose ``seq`` is the next one expected and
   skipping those it already has. An event further ahead reveals a gap (an event another
   writer stored without publishing it, such as ``started`` or ``succeeded``, or a lost
   publish): the stream reads the database after its cursor, which holds the missing ones,
   since events are published only after their commit;
4. while nothing arrives it reads the database every ``poll_interval_s``, which brings the
   transitions nobody publishes and notices a run that ended without a terminal event (a
   refused run).

Live payloads are decoded into :class:`~moorline.db.repos.records.Event` once per process and
shared by every stream of the run (:class:`DecodedEvents`): a hundred readers of one run cost one
decode per event, not a hundred.

A subscriber that falls behind is cut off by the store (its queue is bounded, so it never
slows the worker). The stream then resumes by itself: it subscribes again and reads the
database after the last event it handed out. :attr:`EventStream.cut_offs` counts these.

The stream ends after the run's terminal event (``succeeded``, ``failed``, ``cancelled``,
``timed_out``), when the run is found ended, or when the store shuts down.
"""

import asyncio
import logging
from collections import deque
from types import TracebackType
from typing import Self

from moorline.db.manager import DatabaseManager
from moorline.db.repos.events import TERMINAL_EVENT_TYPES, EventsRepo
from moorline.db.repos.records import Event
from moorline.db.repos.runs import RunsRepo
from moorline.engine.events import event_from_payload
from moorline.errors import RunNotFound
from moorline.runtime.base import EventSubscription, RuntimeStore
from moorline.types import JSONObject, RunId, TenantId

logger = logging.getLogger(__name__)

DEFAULT_POLL_INTERVAL_S = 1.0
"""Longest a stream goes without reading the database while no live event arrives."""

DEFAULT_PAGE_SIZE = 500
"""Stored events read per query."""

DECODED_CAPACITY = 8192
"""Decoded live events kept for the other readers of their run (oldest dropped first)."""


class DecodedEvents:
    """Live payloads decoded once, shared by the streams of one :class:`EventStreams`.

    ``(run id, seq)`` names one event for good (events are never rewritten), so a cached
    :class:`Event` is never stale; the cache only bounds how many are kept.
    """

    def __init__(self, capacity: int = DECODED_CAPACITY) -> None:
        self._capacity = capacity
        self._events: dict[tuple[RunId, int], Event] = {}

    def decode(self, run_id: RunId, seq: int, payload: JSONObject) -> Event:
        """The event ``payload`` (whose ``seq`` the caller read) describes.

        Raises:
            ValueError: The payload is not a live event.
        """
        key = (run_id, seq)
        event = self._events.get(key)
        if event is None:
            event = self._events[key] = event_from_payload(run_id, payload)
            if len(self._events) > self._capacity:
                del self._events[next(iter(self._events))]
        return event


class EventStream:
    """One reader's view of a run's events (see the module docstring).

    Iterate with ``async for``; close with :meth:`close` or ``async with``. Built by
    :meth:`EventStreams.open`.
    """

    def __init__(
        self,
        run_id: RunId,
        *,
        events: EventsRepo,
        runs: RunsRepo,
        store: RuntimeStore,
        after_seq: int,
        poll_interval_s: float,
        page_size: int,
        decoded: DecodedEvents,
        log_fields: dict[str, object] | None = None,
    ) -> None:
        self.run_id = run_id
        # The run's fields for this stream's log lines: it is served from a request's task,
        # outside any attempt, so no bound run context supplies them.
        self._log_fields = log_fields if log_fields is not None else {"run_id": run_id}
        self.last_seq = after_seq
        """``seq`` of the last event handed out: the ``Last-Event-ID`` to resume after."""
        self.cut_offs = 0
        """How often the live subscription was cut off and the stream resumed."""
        self._events = events
        self._runs = runs
        self._store = store
        self._poll_interval_s = poll_interval_s
        self._page_size = page_size
        self._decoded = decoded
        self._cursor = after_seq
        self._ready: deque[Event] = deque()
        self._subscription: EventSubscription | None = None
        self._stored_after_cursor = True
        self._run_ended = False
        self._is_finished = False
        self._is_closed = False

    async def _subscribe(self) -> None:
        if self._subscription is not None:
            await self._subscription.close()
        self._subscription = await self._store.subscribe_events(self.run_id)
        self._stored_after_cursor = True

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Event:
        while True:
            if self._ready:
                event = self._ready.popleft()
                self.last_seq = event.seq
                return event
            if self._is_finished or self._is_closed:
                await self.close()
                raise StopAsyncIteration
            if self._stored_after_cursor:
                await self._read_stored()
            else:
                await self._take_live()

    async def close(self) -> None:
        """Stop reading and release the live subscription (idempotent)."""
        self._is_closed = True
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            await subscription.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def _accept(self, event: Event) -> None:
        if event.seq != self._cursor + 1 or self._is_finished:
            return
        self._ready.append(event)
        self._cursor = event.seq
        if event.type in TERMINAL_EVENT_TYPES:
            self._is_finished = True

    async def _read_stored(self) -> None:
        page = await self._events.list(self.run_id, after_seq=self._cursor, limit=self._page_size)
        self._stored_after_cursor = len(page) == self._page_size
        for event in page:
            self._accept(event)
        if self._run_ended and not self._stored_after_cursor:
            self._is_finished = True

    async def _take_live(self) -> None:
        subscription = self._subscription
        if subscription is None or subscription.is_ended:
            if subscription is not None and not subscription.is_dropped:
                self._is_finished = True  # the store is shutting down
                return
            if subscription is not None:
                self.cut_offs += 1
                logger.info(
                    "event stream of run %s fell behind; resuming after seq %d",
                    self.run_id,
                    self._cursor,
                    extra=self._log_fields,
                )
            await self._subscribe()
            return
        try:
            async with asyncio.timeout(self._poll_interval_s):
                batch = await subscription.take()
        except TimeoutError:
            await self._poll()
            return
        for payload in batch:
            seq = payload.get("seq")
            if not isinstance(seq, int) or seq <= self._cursor:
                continue
            if seq > self._cursor + 1:
                # A gap: the database has the missing events (and this one).
                self._stored_after_cursor = True
                return
            try:
                self._accept(self._decoded.decode(self.run_id, seq, payload))
            except ValueError as exc:
                logger.warning(
                    "event stream of run %s: %s", self.run_id, exc, extra=self._log_fields
                )
                self._stored_after_cursor = True
                return

    async def _poll(self) -> None:
        """Nothing live for a while: read the database, and end if the run has ended."""
        before = self._cursor
        await self._read_stored()
        if self._cursor != before or self._is_finished:
            return
        run = await self._runs.get(self.run_id)
        if run is None or run.status.is_terminal:
            # Its last events (if any) were committed with the status: read them, then end.
            self._run_ended = True
            self._stored_after_cursor = True


class EventStreams:
    """Opens event streams of runs for their tenants (the SSE route's entry point).

    Args:
        db: The database (stored events, run ownership).
        store: The RuntimeStore (live events).
        poll_interval_s: Longest a stream goes without reading the database.
        page_size: Stored events read per query.
    """

    def __init__(
        self,
        db: DatabaseManager,
        store: RuntimeStore,
        *,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> None:
        if poll_interval_s <= 0 or page_size < 1:
            raise ValueError("poll_interval_s must be positive and page_size at least 1")
        self._events = EventsRepo(db)
        self._runs = RunsRepo(db)
        self._store = store
        self._poll_interval_s = poll_interval_s
        self._page_size = page_size
        self._decoded = DecodedEvents()

    async def open(self, tenant_id: TenantId, run_id: RunId, *, after_seq: int = 0) -> EventStream:
        """A stream of the run's events after ``after_seq``, live once it is returned.

        Args:
            tenant_id: The caller's tenant; another tenant's run is not found.
            run_id: The run.
            after_seq: Events up to this ``seq`` are skipped (``Last-Event-ID``); 0 for all.

        Raises:
            RunNotFound: No such run for this tenant.
            ValueError: ``after_seq`` is negative.
            BackendUnavailable: The store could not subscribe.
        """
        if after_seq < 0:
            raise ValueError(f"after_seq must not be negative, got {after_seq}")
        run = await self._runs.get(run_id)
        if run is None or run.tenant_id != tenant_id:
            raise RunNotFound(f"no run {run_id}")
        stream = EventStream(
            run_id,
            events=self._events,
            runs=self._runs,
            store=self._store,
            after_seq=after_seq,
            poll_interval_s=self._poll_interval_s,
            page_size=self._page_size,
            decoded=self._decoded,
            log_fields={"run_id": run_id, "attempt": run.attempt, "tenant_id": tenant_id},
        )
        await stream._subscribe()
        return stream
