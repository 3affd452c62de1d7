"""Redis Pub/Sub for the runtime store: one shared connection, and live events fanned out from it.

- :class:`PubSubHub` carries every subscription of one store (interrupt and cancel wake-ups,
  event streams) over a single Pub/Sub connection, so a process with hundreds of paused runs
  and open streams holds one connection, not hundreds. It never reconnects silently: when the
  connection breaks, every listener hears :meth:`Listener.on_broken` and subscribes again on a
  fresh one, knowing that messages may have been lost meanwhile.
- :class:`EventFeeds` subscribes a run's events channel once per process, however many local
  subscribers the run has: each Pub/Sub message (one published batch) is decoded once and
  handed to :class:`~moorline.runtime.fanout.LocalFanout`, which offers it to every subscriber's
  bounded queue. A broken connection cuts the run's subscribers off (events were lost); they
  resume from the database.
"""

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError

from moorline.concurrency import cancel_and_wait, keep_cancel
from moorline.runtime.base import EventSubscription
from moorline.runtime.fanout import LocalFanout
from moorline.types import JSONObject, RunId

logger = logging.getLogger(__name__)


class Listener(Protocol):
    """A local interest in a channel; called from the hub's reader, so it must not block."""

    def on_message(self, data: str) -> None:
        """A message arrived on the channel."""
        ...

    def on_broken(self) -> None:
        """The connection broke: messages may have been lost, and none will come any more."""
        ...


@dataclass(eq=False, slots=True)
class _Channel:
    listeners: set[Listener] = field(default_factory=set)
    confirmed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when Redis confirmed the SUBSCRIBE (or when the link broke)."""


@dataclass(eq=False, slots=True)
class Link:
    """One Pub/Sub connection and the channels subscribed on it; replaced whole when it breaks."""

    pubsub: PubSub
    channels: dict[str, _Channel] = field(default_factory=dict)
    reader: "asyncio.Task[None] | None" = None
    is_broken: bool = False


class PubSubHub:
    """Every subscription of one store over a single Pub/Sub connection.

    The connection is opened without redis-py's retries: redis-py would reconnect and
    re-subscribe silently, hiding that messages were lost meanwhile. Here a broken connection
    is dropped whole and every listener hears :meth:`Listener.on_broken`.

    Args:
        open_pubsub: A fresh Pub/Sub object on a connection of its own
            (:meth:`~moorline.runtime.redis_client.RedisConnector.pubsub`), for each link.

    A channel's entry is only deleted (and unsubscribed) after its SUBSCRIBE was confirmed.
    Replies on one connection come in order, so every "subscribe" reply then belongs to the
    entry that is in the table: a confirmation is never credited to the wrong subscription.
    """

    def __init__(self, open_pubsub: Callable[[], Awaitable[PubSub]]) -> None:
        self._open_pubsub = open_pubsub
        self._link: Link | None = None
        self._lock = asyncio.Lock()

    async def subscribe(self, channel: str, listener: Listener) -> Link:
        """Add ``listener`` to ``channel``; return once Redis confirmed the subscription.

        Raises:
            redis.exceptions.ConnectionError: the connection broke (subscribe again).
        """
        link = await self._live_link()
        entry = link.channels.get(channel)
        first = entry is None
        if entry is None:
            entry = link.channels[channel] = _Channel()
        entry.listeners.add(listener)
        try:
            if first:
                # Shielded: a caller cancelled mid-write must not cut a command in half on the
                # shared connection. The reader unsubscribes if nobody is left at confirmation.
                await asyncio.shield(self._send(link, "subscribe", channel))
            await entry.confirmed.wait()
        except BaseException:
            await self.unsubscribe(link, channel, listener)
            raise
        if link.is_broken:
            raise RedisConnectionError("the Pub/Sub connection broke while subscribing")
        return link

    async def unsubscribe(self, link: Link, channel: str, listener: Listener) -> None:
        """Remove ``listener``; the last one out unsubscribes the connection."""
        entry = link.channels.get(channel)
        if entry is None:
            return
        entry.listeners.discard(listener)
        if entry.listeners or not entry.confirmed.is_set() or link.is_broken:
            return
        del link.channels[channel]
        await asyncio.shield(self._send(link, "unsubscribe", channel))

    async def close(self) -> None:
        """Drop the connection; listeners hear ``on_broken``."""
        if self._link is not None:
            await self._break(self._link, None)

    async def _live_link(self) -> Link:
        async with self._lock:
            if self._link is None or self._link.is_broken:
                pubsub = await keep_cancel(self._open_pubsub())
                try:
                    # keep_cancel: redis-py's connect may swallow a cancel on Python 3.11.
                    await keep_cancel(pubsub.connect())  # type: ignore[no-untyped-call]
                except BaseException:
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
                    raise
                link = Link(pubsub)
                link.reader = asyncio.create_task(self._read(link), name="moorline-pubsub")
                self._link = link
            return self._link

    async def _send(self, link: Link, command: str, channel: str) -> None:
        """Send (UN)SUBSCRIBE; on failure break the link instead of raising (callers check)."""
        try:
            if command == "subscribe":
                await link.pubsub.subscribe(channel)
            else:
                await link.pubsub.unsubscribe(channel)
        except Exception as exc:
            # A dead socket or a half-sent command: nobody can trust this connection now.
            await self._break(link, exc)
        except BaseException as exc:
            await self._break(link, exc)
            raise

    async def _read(self, link: Link) -> None:
        try:
            while True:
                # keep_cancel: a cancel redis-py swallows here left the reader reading a
                # connection nothing would ever write to again, and its closer waiting for it.
                message = await keep_cancel(link.pubsub.get_message(timeout=None))
                if message is not None:
                    await self._dispatch(link, message)
        except Exception as exc:
            await self._break(link, exc)

    async def _dispatch(self, link: Link, message: dict[str, Any]) -> None:
        channel = message["channel"]
        entry = link.channels.get(channel)
        if entry is None:
            return
        if message["type"] == "subscribe":
            entry.confirmed.set()
            if not entry.listeners:  # everyone left before the confirmation
                del link.channels[channel]
                await self._send(link, "unsubscribe", channel)
        elif message["type"] == "message":
            for listener in tuple(entry.listeners):
                listener.on_message(message["data"])

    async def _break(self, link: Link, error: BaseException | None) -> None:
        if link.is_broken:
            return
        link.is_broken = True
        if error is not None:
            logger.warning("runtime store: Pub/Sub connection lost: %r; subscribing again", error)
        for entry in link.channels.values():
            entry.confirmed.set()
            for listener in tuple(entry.listeners):
                listener.on_broken()
        link.channels.clear()
        if self._link is link:
            self._link = None
        reader = link.reader
        if reader is not None and reader is not asyncio.current_task():
            await cancel_and_wait((reader,))
        await link.pubsub.aclose()  # type: ignore[no-untyped-call]


class _ChannelFeed:
    """The hub listener of one run's events channel, shared by the run's local subscribers."""

    def __init__(self, run_id: RunId, fanout: LocalFanout) -> None:
        self.run_id = run_id
        self.link: Link | None = None
        self.ready = asyncio.Event()
        """Set once Redis confirmed the subscription, or it failed."""
        self.is_broken = False
        self._fanout = fanout

    def on_message(self, data: str) -> None:
        try:
            decoded = json.loads(data)
        except ValueError:
            logger.warning("runtime store: ignoring an event batch that is not JSON")
            return
        if not isinstance(decoded, list):
            logger.warning("runtime store: ignoring an event batch that is not a JSON array")
            return
        batch: list[JSONObject] = [event for event in decoded if isinstance(event, dict)]
        self._fanout.deliver(self.run_id, batch)

    def on_broken(self) -> None:
        # Events published while the connection was down are lost: report a gap.
        self.is_broken = True
        self.ready.set()
        self._fanout.cut_off(self.run_id)


class EventFeeds:
    """Live event subscriptions of one store over its :class:`PubSubHub`.

    Args:
        hub: The store's shared Pub/Sub connection.
        channel_of: The events channel of a run (:meth:`RedisKeys.events_channel`).
        max_queued: Events a subscriber may fall behind by before it is cut off.
    """

    def __init__(
        self, hub: PubSubHub, channel_of: Callable[[RunId], str], *, max_queued: int
    ) -> None:
        self._hub = hub
        self._channel_of = channel_of
        self._fanout = LocalFanout(max_queued=max_queued)
        self._feeds: dict[RunId, _ChannelFeed] = {}

    async def subscribe(self, run_id: RunId) -> EventSubscription:
        """A subscription to ``run_id``, active (confirmed by Redis) when this returns.

        Raises:
            redis.exceptions.ConnectionError: the connection broke while subscribing (the
                caller tries again).
        """
        feed = self._feeds.get(run_id)
        if feed is None or feed.is_broken:
            feed = self._feeds[run_id] = _ChannelFeed(run_id, self._fanout)
            try:
                feed.link = await self._hub.subscribe(self._channel_of(run_id), feed)
            except BaseException:
                feed.is_broken = True
                if self._feeds.get(run_id) is feed:
                    del self._feeds[run_id]
                raise
            finally:
                feed.ready.set()
        else:
            # Another subscriber of the run is being confirmed: share its subscription.
            await feed.ready.wait()
        if feed.is_broken:
            raise RedisConnectionError("the Pub/Sub connection broke while subscribing")
        return self._fanout.subscribe(run_id, on_last_close=lambda: self._leave(feed))

    async def _leave(self, feed: _ChannelFeed) -> None:
        """The run's last local subscriber left: unsubscribe its channel."""
        if self._feeds.get(feed.run_id) is feed:
            del self._feeds[feed.run_id]
        if feed.link is not None and not feed.is_broken:
            await self._hub.unsubscribe(feed.link, self._channel_of(feed.run_id), feed)

    def end_all(self) -> None:
        """End every subscription (shutdown); the hub is closed by its owner."""
        self._fanout.end_all()
        self._feeds.clear()
