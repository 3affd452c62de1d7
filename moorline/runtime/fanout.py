"""Live events fanned out to this process's subscribers of a run.

Both stores end here: the in-memory store hands a published batch straight to
:meth:`LocalFanout.deliver`; the Redis store receives one Pub/Sub message per batch on its
shared connection and hands the decoded batch over the same way (see
:mod:`moorline.runtime.pubsub`). A batch is decoded once per process and shared by every
subscriber of the run, so a hundred subscribers cost a hundred queue appends, not a hundred
JSON decodes.

Delivery never waits: each subscriber has its own bounded queue and is cut off when it is full
(:meth:`~moorline.runtime.base.EventSubscription.offer`), so a slow reader costs the publisher
nothing.
"""

from collections.abc import Awaitable, Callable, Sequence

from moorline.runtime.base import EventSubscription
from moorline.types import JSONObject, RunId


class LocalFanout:
    """The live subscriptions of this process, per run.

    Args:
        max_queued: Events a subscriber may fall behind by before it is cut off.
    """

    def __init__(self, *, max_queued: int) -> None:
        self._max_queued = max_queued
        self._subscribers: dict[RunId, set[EventSubscription]] = {}

    def subscribe(
        self,
        run_id: RunId,
        *,
        on_last_close: Callable[[], Awaitable[None]] | None = None,
    ) -> EventSubscription:
        """A new subscription to ``run_id``, active at once.

        Args:
            run_id: The run.
            on_last_close: Awaited when the run's last subscription in this process closes
                (the Redis store unsubscribes its channel then).
        """

        async def unregister() -> None:
            subscribers = self._subscribers.get(run_id)
            if subscribers is None or subscription not in subscribers:
                return
            subscribers.discard(subscription)
            if subscribers:
                return
            del self._subscribers[run_id]
            if on_last_close is not None:
                await on_last_close()

        subscription = EventSubscription(max_queued=self._max_queued, on_close=unregister)
        self._subscribers.setdefault(run_id, set()).add(subscription)
        return subscription

    def has_subscribers(self, run_id: RunId) -> bool:
        """Whether this process has a live subscription to ``run_id``."""
        return bool(self._subscribers.get(run_id))

    def deliver(self, run_id: RunId, events: Sequence[JSONObject]) -> None:
        """Offer one batch to every subscriber of ``run_id`` (shared, never copied per reader)."""
        for subscription in tuple(self._subscribers.get(run_id, ())):
            subscription.offer(events)

    def cut_off(self, run_id: RunId) -> None:
        """Cut every subscriber of ``run_id`` off: events may have been lost (a broken link)."""
        for subscription in self._subscribers.pop(run_id, set()):
            subscription.end(dropped=True)

    def end_all(self) -> None:
        """End every subscription after what it has queued (shutdown)."""
        for subscribers in self._subscribers.values():
            for subscription in subscribers:
                subscription.end()
        self._subscribers.clear()
