"""The RuntimeStore seam: coordination state that may be lost and rebuilt.

The database is the source of truth for runs; the RuntimeStore only coordinates live work:

- **conversation lease**: at most one active run per conversation, with a TTL renewed by the
  holder's heartbeat (``acquire_lease`` / ``renew_lease`` / ``release_lease``);
- **interactive window**: which run of a conversation has its engine loop live, so messages and
  cancellation are only accepted while someone can act on them;
- **interrupts**: a run pauses on a human decision (``open_interrupt`` → ``wait_interrupt``,
  ``resolve_interrupt`` from the API); the first decision wins;
- **cancellation**: a flag per run, with a wait that wakes on it;
- **injected messages**: a signal queue per run, ordered and de-duplicated by the message's
  ``seq`` (the database holds the messages themselves), drained all at once;
- **live events**: best-effort fan-out of a run's events to stream subscribers, in batches.

Two implementations share one contract suite: :class:`~moorline.runtime.memory.InMemoryRuntimeStore`
(one process) and :class:`~moorline.runtime.redis.RedisRuntimeStore` (many processes).

Waits end in a defined way, so a run never hangs on the store:

==================  ===========================================  =========================
wait                resolved / signalled                         timeout
==================  ===========================================  =========================
``wait_interrupt``  the decision (``CANCELLED_DECISION`` on      ``None``
                    cancel)
``wait_cancelled``  ``True``                                     ``False``
==================  ===========================================  =========================

After :meth:`RuntimeStore.shutdown` every wait in this process, running or new, raises
:class:`StoreShutdown`, and every event subscription ends.

Live events are JSON objects carrying the event's ``seq``. A subscriber has a bounded queue:
one that falls :data:`DEFAULT_EVENT_QUEUE_SIZE` events behind is cut off
(:attr:`EventSubscription.is_dropped`) with the ``seq`` of the last event it took
(:attr:`EventSubscription.last_seq`), and resumes from the database after it. A publisher never
waits for a subscriber.
"""

import asyncio
import json
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import TracebackType
from typing import NamedTuple, Protocol, Self

from moorline.errors import LimitExceeded, MoorlineError
from moorline.types import JSONObject, RunId, TenantId

CANCELLED_DECISION: JSONObject = {"approved": False, "reason": "cancelled"}
"""The decision an interrupt gets when its run is cancelled while the interrupt is pending."""

DEFAULT_EVENT_QUEUE_SIZE = 1000
"""Events a subscriber may fall behind by before it is dropped."""

DEFAULT_MAX_MESSAGES = 1000
"""Injected-message signals a run may have queued before more are refused."""


class StoreShutdown(MoorlineError):
    """The store is shutting down in this process; the wait ended without an answer.

    The engine turns it into a denial with reason ``shutdown``; the run is reclaimed and
    replayed by another worker, and the decision (if any) is read again there.
    """

    code = "shutdown"
    status = 503


def queue_full(run_id: RunId, max_messages: int) -> LimitExceeded:
    """The error of a push onto a full message queue."""
    return LimitExceeded(f"run {run_id} already has {max_messages} messages waiting")


class QueuedMessage(NamedTuple):
    """An injected message as the store's queue holds it: its ``seq`` in the run, and its text."""

    seq: int
    text: str


class InterruptStatus(StrEnum):
    """Where an interrupt stands."""

    PENDING = "pending"
    RESOLVED = "resolved"


@dataclass(frozen=True, slots=True, kw_only=True)
class InterruptState:
    """An interrupt as the store holds it."""

    status: InterruptStatus
    decision: JSONObject | None
    """The winning decision once resolved, else ``None``."""


class WindowChange(NamedTuple):
    """One change of an interactive window, for :meth:`RuntimeStore.change_windows`."""

    conversation_id: str
    run_id: RunId
    opens: bool
    """True to open (or extend) the window for ``run_id``; False to close it if it holds it."""


class LeaseAcquisition(NamedTuple):
    """The answer of :meth:`RuntimeStore.acquire_lease`; unpacks as ``(acquired, holder)``."""

    acquired: bool
    holder: str
    """The holder after the call: the caller when acquired, else whoever holds the lease."""


def conversation_key(tenant_id: TenantId, conversation_id: str) -> str:
    """The store's name of one tenant's conversation: ``<tenant id>:<conversation id>``.

    Conversation ids are each tenant's own names, so two tenants may use the same one; the
    store's lease and window methods take this key, never the bare id, so that one tenant's
    conversation never holds up, or names a run of, another's. Tenant ids contain no ``:``.
    """
    return f"{tenant_id}:{conversation_id}"


def encode_decision(decision: JSONObject) -> str:
    """Canonical JSON of a decision, so two equal decisions compare equal as strings."""
    return json.dumps(decision, sort_keys=True, separators=(",", ":"), allow_nan=False)


def decode_decision(text: str) -> JSONObject:
    """The decision stored by :func:`encode_decision`."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("a stored decision is not a JSON object")
    return value


class EventSubscription:
    """Live events of one run, in publish order, until closed, cut off or shut down.

    Iterate with ``async for`` (or take everything queued at once with :meth:`take`); close
    with :meth:`close` (or use ``async with``). Live fan-out is best-effort: a reader of a
    run's events reads the stored ones from the database and de-duplicates by ``seq``
    (:class:`moorline.engine.streams.EventStream` does both).

    The queue is bounded: a subscriber that falls ``max_queued`` events behind is cut off
    (:attr:`is_dropped` becomes true, the events it had not taken are discarded and iteration
    ends) so that it can never stall a publisher. It resumes from the database after
    :attr:`last_seq`, the last event it took. A subscriber that has taken everything always
    accepts the next batch whole, however large: it has not fallen behind.
    """

    def __init__(
        self,
        *,
        max_queued: int = DEFAULT_EVENT_QUEUE_SIZE,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be at least 1, got {max_queued}")
        self._items: deque[JSONObject] = deque()
        self._max_queued = max_queued
        self._ready = asyncio.Event()
        self._ended = False
        self._dropped = False
        self._last_seq: int | None = None
        self._on_close = on_close

    @property
    def is_dropped(self) -> bool:
        """True when events may have been missed (slow consumer or lost connection)."""
        return self._dropped

    @property
    def is_ended(self) -> bool:
        return self._ended

    @property
    def last_seq(self) -> int | None:
        """``seq`` of the last event taken from this subscription (None before the first)."""
        return self._last_seq

    def offer(self, events: Sequence[JSONObject]) -> None:
        """Queue a batch of events; cut the subscriber off instead of blocking when it is full.

        The events may be shared with other subscribers: nobody may change them.
        """
        if self._ended or not events:
            return
        if self._items and len(self._items) + len(events) > self._max_queued:
            self.end(dropped=True)
            return
        self._items.extend(events)
        self._ready.set()

    def end(self, *, dropped: bool = False) -> None:
        """Stop the stream after the queued events (at once, discarding them, when dropped)."""
        if dropped:
            self._dropped = True
            self._items.clear()
        self._ended = True
        self._ready.set()

    async def close(self) -> None:
        """End the stream and release what it holds (idempotent)."""
        self.end()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            await on_close()

    async def take(self) -> list[JSONObject]:
        """Wait for events, then take every queued one; an empty list once the stream ended.

        Safe to cancel: nothing is taken until the wait is over.
        """
        while not self._items:
            if self._ended:
                return []
            self._ready.clear()
            await self._ready.wait()
        taken = list(self._items)
        self._items.clear()
        self._note(taken[-1])
        return taken

    def _note(self, event: JSONObject) -> None:
        seq = event.get("seq")
        if isinstance(seq, int):
            self._last_seq = seq

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> JSONObject:
        while True:
            if self._items:
                event = self._items.popleft()
                self._note(event)
                return event
            if self._ended:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class RuntimeStore(Protocol):
    """Coordination of live runs: leases, interactive windows, interrupts, cancels, messages.

    Every TTL is in seconds and every key the store writes expires: state left behind by a dead
    process disappears on its own. Methods raise
    :class:`~moorline.errors.BackendUnavailable` when the backend cannot be reached.
    """

    async def acquire_lease(
        self, conversation_id: str, holder: str, ttl_s: float
    ) -> LeaseAcquisition:
        """Take the conversation's lease unless someone else holds it.

        Args:
            conversation_id: The conversation to lock, as :func:`conversation_key` names it.
            holder: Who takes it (a run id); acquiring again as the holder refreshes the TTL.
            ttl_s: Seconds the lease lives without a renewal.

        Returns:
            ``(True, holder)`` when the caller holds the lease now, else
            ``(False, current_holder)``.
        """
        ...

    async def renew_lease(self, conversation_id: str, holder: str, ttl_s: float) -> bool:
        """Extend the lease to ``ttl_s`` from now, only if ``holder`` still holds it.

        Returns:
            False when the lease expired or belongs to someone else: the caller lost it and
            must stop.
        """
        ...

    async def release_lease(self, conversation_id: str, holder: str) -> bool:
        """Give the lease up, only if ``holder`` holds it.

        Returns:
            True when it was released; False (and nothing changed) otherwise.
        """
        ...

    async def get_lease_holder(self, conversation_id: str) -> str | None:
        """Who holds the conversation's lease, or ``None``."""
        ...

    async def mark_interactive(self, conversation_id: str, run_id: RunId, ttl_s: float) -> None:
        """Open (or extend) the conversation's interactive window for ``run_id``.

        The window covers only the engine loop of the run, so messages and cancels arriving
        after it closed are refused. Mark again from the heartbeat to keep it open. A run with
        no conversation may use its run id as the conversation id.
        """
        ...

    async def get_interactive_run(self, conversation_id: str) -> RunId | None:
        """The run whose engine loop is live in the conversation, or ``None``."""
        ...

    async def is_interactive(self, conversation_id: str, run_id: RunId) -> bool:
        """Whether ``run_id`` holds the conversation's interactive window."""
        ...

    async def clear_interactive(self, conversation_id: str, run_id: RunId) -> bool:
        """Close the window, only if ``run_id`` holds it; True when it was closed."""
        ...

    async def change_windows(self, changes: Sequence[WindowChange], ttl_s: float) -> list[bool]:
        """Open or close each window, in the order given, in one round trip.

        An open is :meth:`mark_interactive` for ``ttl_s``; a close, :meth:`clear_interactive`.

        Returns:
            For each change, in order: True for an open, and for a close that closed.
        """
        ...

    async def open_interrupt(self, run_id: RunId, interrupt_id: str, ttl_s: float) -> None:
        """Create a pending interrupt, or keep the existing one (a replayed run re-opens it).

        Args:
            run_id: The run that pauses.
            interrupt_id: Unique within the run.
            ttl_s: Seconds the interrupt, pending or resolved, stays in the store; pass the
                wait's timeout plus a margin.
        """
        ...

    async def resolve_interrupt(
        self, run_id: RunId, interrupt_id: str, decision: JSONObject
    ) -> bool:
        """Record a decision and wake the waiter; the first decision wins.

        Returns:
            True when this decision was recorded now or was already the recorded one (an
            idempotent retry); False when the interrupt is unknown (never opened, expired or
            cleaned up) or already resolved with a different decision.
        """
        ...

    async def get_interrupt(self, run_id: RunId, interrupt_id: str) -> InterruptState | None:
        """The interrupt's state, or ``None`` when unknown."""
        ...

    async def wait_interrupt(
        self, run_id: RunId, interrupt_id: str, timeout_s: float
    ) -> JSONObject | None:
        """Wait for the interrupt's decision.

        Returns at once when it is already resolved. When the run is cancelled while the
        interrupt is pending, the interrupt is resolved with :data:`CANCELLED_DECISION` (first
        writer wins, so a later approval is refused) and that is returned.

        Returns:
            The decision; ``None`` on timeout, or when the interrupt is unknown or disappears
            (expired, cleaned up) while waiting.

        Raises:
            StoreShutdown: :meth:`shutdown` was called in this process.
            BackendUnavailable: the backend stayed unreachable until the timeout.
        """
        ...

    async def request_cancel(self, run_id: RunId) -> None:
        """Flag the run as cancelled and wake its waiters (the flag expires with the run)."""
        ...

    async def is_cancelled(self, run_id: RunId) -> bool:
        """Whether the run's cancel flag is set."""
        ...

    async def wait_cancelled(self, run_id: RunId, timeout_s: float) -> bool:
        """Wait until the run is cancelled.

        Returns:
            True once cancelled (at once when it already is); False on timeout.

        Raises:
            StoreShutdown: :meth:`shutdown` was called in this process.
            BackendUnavailable: the backend stayed unreachable until the timeout.
        """
        ...

    async def push_message(self, run_id: RunId, seq: int, text: str) -> None:
        """Signal that message ``seq`` of the run was stored: queue it, once per ``seq``.

        Idempotent: pushing a ``seq`` that is queued already changes nothing, so a push
        retried after a lost reply never queues the message twice. The queue is bounded
        (``max_messages`` of the store): a run that does not drain it cannot make it grow
        without limit.

        Args:
            run_id: The run the message was posted to.
            seq: The message's number in the run (from the database).
            text: The message.

        Raises:
            LimitExceeded: the queue is full; nothing was added.
        """
        ...

    async def drain_messages(self, run_id: RunId) -> list[QueuedMessage]:
        """Take every queued message at once, in ``seq`` order (an empty list when none)."""
        ...

    async def publish_events(self, run_id: RunId, events: Sequence[JSONObject]) -> None:
        """Send a batch of events to the run's live subscribers (best-effort, at most once).

        The batch travels as one message and reaches every subscriber whole and in order.
        """
        ...

    async def subscribe_events(self, run_id: RunId) -> EventSubscription:
        """Subscribe to the run's live events.

        The subscription is active when this returns: every event published afterwards is
        delivered (unless the subscriber is cut off). Read stored events after subscribing,
        then de-duplicate by ``seq``.
        """
        ...

    async def cleanup_run(self, run_id: RunId) -> None:
        """Delete the run's interrupts, cancel flag and message queue at its end.

        Waiters on the run wake: an interrupt wait returns ``None``.
        """
        ...

    async def check_available(self, timeout_s: float) -> None:
        """Prove the store answers within ``timeout_s``; the in-memory store always does.

        Raises:
            BackendUnavailable: no answer in time, or the server refused; the message is
                ``<backend> is down: <reason>``.
        """
        ...

    async def shutdown(self) -> None:
        """Wake every waiter in this process with :class:`StoreShutdown` and end subscriptions.

        State in a shared backend is left alone: other processes keep working with it. Waits
        started afterwards raise :class:`StoreShutdown` at once; other methods keep working.
        """
        ...

    async def close(self) -> None:
        """Shut down (see :meth:`shutdown`) and release connections; idempotent."""
        ...
