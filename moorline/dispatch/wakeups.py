"""Wake-ups: telling waiting workers that a lane has new work, without polling hard.

A notification is a hint, never the source of truth. A worker claims after every wake-up *and*
after every timeout of its wait, so a lost notification (Redis Pub/Sub and LISTEN/NOTIFY are
at-most-once, and nothing is delivered while a listener reconnects) costs latency, never a run:
the timeout is the slow poll.

Four transports behind one pair of Protocols, :class:`Notifier` (producers: enqueue, retry,
the reaper) and :class:`Waiter` (worker loops):

- :class:`LocalWakeups`: one :class:`asyncio.Event` per lane, for producers and workers that
  share a process (and the in-process half of the other two).
- :class:`~moorline.dispatch.pg_wakeups.PostgresWakeups`: ``SELECT pg_notify(channel,
  payload)`` and ``LISTEN``, each on an asyncpg connection of its own that is not part of the
  pool (to ``MOORLINE_LISTEN_URL`` when set: behind PgBouncer the pool's sessions are not its
  own).
- :class:`~moorline.dispatch.redis_wakeups.RedisWakeups`: ``PUBLISH`` and ``SUBSCRIBE`` on
  ``<redis_prefix>:wakeups``.
- :class:`~moorline.dispatch.datagrams.DatagramWakeups`: Unix datagram sockets in a directory
  next to a SQLite file, for the processes of one host without Redis.

The remote ones fan out: ``notify`` wakes this process's waiters directly, then tells the
other processes. Each payload carries the sender's origin id, so a listener skips what its own
process sent and a local waiter is not woken twice. A listener that (re)connects wakes every
lane of its process, because anything sent while it was away was lost; it reconnects after a
lost connection (``pg_terminate_backend``, ``CLIENT KILL``, a server restart) with a capped
backoff and notices a silently dead one by pinging it.

:func:`make_wakeups` picks the transport from the settings: Redis when ``redis_url`` is set,
else LISTEN/NOTIFY on PostgreSQL (when a LISTEN has a session to stay on), else datagrams on a
SQLite file, else in-process only.
"""

import asyncio
import logging
import math
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar, Protocol

from moorline.db.manager import DatabaseManager
from moorline.db.repos.announcements import Announcement, wake_payload
from moorline.settings import Settings

logger = logging.getLogger(__name__)

NOTIFY_TIMEOUT_S = 2.0
"""Longest a remote ``notify`` may take before the hint is given up (logged, not raised)."""

PING_INTERVAL_S = 5.0
"""Seconds of silence after which a listener pings its connection to prove it alive."""

PING_TIMEOUT_S = 5.0
"""Seconds a listener's ping may take before the connection counts as dead."""

RECONNECT_MIN_S = 0.05
RECONNECT_MAX_S = 5.0
"""Backoff between reconnection attempts: doubles from the minimum up to the maximum."""


class Notifier(Protocol):
    """The producer side: tells waiters that runs may have become claimable."""

    async def notify(self, lanes: set[str]) -> None:
        """Wake every waiter of each lane in ``lanes``, in this process and (remote) others.

        Call it after the transaction that made the runs claimable has committed, so a woken
        worker's claim sees them. Transport failures are logged and dropped, never raised:
        a lost notification costs a worker's slow poll, nothing more.
        """
        ...


class Waiter(Protocol):
    """The worker side: waits for a lane's notification, or for the slow-poll timeout."""

    async def start(self) -> None:
        """Start listening; returns once the first connection attempt succeeded or failed.

        After a failed first attempt the waiter keeps reconnecting in the background, and
        ``wait`` still returns on its timeouts.
        """
        ...

    async def wait(self, lane: str, timeout_s: float, *, seen_before: float | None = None) -> bool:
        """Wait until ``lane`` is notified or ``timeout_s`` seconds pass.

        A notification that arrived while no task of this process was waiting on the lane is
        kept for the next ``wait`` on it, so one sent between a worker's empty claim and its
        ``wait`` is not lost. All tasks waiting on the lane wake together.

        Args:
            lane: The lane to wait for.
            timeout_s: The slow poll: return False after this many seconds.
            seen_before: A ``time.monotonic()`` instant by which the caller's last look at
                the lane (its claim's transaction) had begun. Notifications are sent after
                the commit that made runs claimable, so those kept from before it announce
                runs that look already saw: they are dropped instead of waking the caller
                for a claim that would find nothing new.

        Returns:
            True when woken (by a notification or a listener reconnect), False on timeout.
        """
        ...

    async def close(self) -> None:
        """Stop listening and release connections; idempotent."""
        ...


class LocalWakeups(Notifier, Waiter):
    """Wake-ups between the tasks of one event loop; also the local half of the others.

    One :class:`asyncio.Event` per lane, level-triggered: a notification sets it and a waiter
    that returns clears it, before its caller claims, so every notification either finds the
    lane's waiters (all of them wake: setting an event releases every task waiting on it) or
    is kept for the next one. Lanes are the handful of names the plans route to, so the map
    never grows past them.
    """

    def __init__(self) -> None:
        self.origin = uuid.uuid4().hex
        """Id of this process's wake-ups, carried by remote payloads to skip our own echo."""
        self._events: dict[str, asyncio.Event] = {}
        self._woken_at: dict[str, float] = {}
        """``time.monotonic()`` of each lane's latest wake-up."""

    def _event(self, lane: str) -> asyncio.Event:
        event = self._events.get(lane)
        if event is None:
            event = self._events[lane] = asyncio.Event()
        return event

    def wake(self, lanes: Iterable[str]) -> None:
        """Wake the waiters of ``lanes`` now (synchronous, for listener callbacks)."""
        now = time.monotonic()
        for lane in lanes:
            self._woken_at[lane] = now
            self._event(lane).set()

    def wake_all(self) -> None:
        """Wake every lane this process has waited on or been notified about."""
        self.wake(list(self._events))

    async def notify(self, lanes: set[str]) -> None:
        self.wake(lanes)

    async def start(self) -> None:
        return None

    async def wait(self, lane: str, timeout_s: float, *, seen_before: float | None = None) -> bool:
        event = self._event(lane)
        if (
            event.is_set()
            and seen_before is not None
            and self._woken_at.get(lane, math.inf) <= seen_before
        ):
            event.clear()  # every wake-up kept is older than the caller's last look
        if not event.is_set():
            if timeout_s <= 0:
                return False
            try:
                async with asyncio.timeout(timeout_s):
                    await event.wait()
            except TimeoutError:
                # A notification landing together with the timeout stays set for the next
                # wait: it is late, not lost.
                return False
        event.clear()
        return True

    async def close(self) -> None:
        return None


class ListeningWakeups(Notifier, Waiter, ABC):
    """Shared machinery of the remote transports: fan-out, the listener task, reconnects.

    A subclass sends a payload (:meth:`_publish`) and listens on one connection until it is
    lost (:meth:`_listen`); this class runs the listener as a named task, reconnects it with a
    capped backoff, and surfaces a listener that died of a programming error from ``wait``.
    """

    transport: ClassVar[str]

    def __init__(
        self,
        *,
        hub: LocalWakeups | None,
        notify_timeout_s: float,
        ping_interval_s: float,
    ) -> None:
        self.hub = hub if hub is not None else LocalWakeups()
        """The in-process half: notified first, woken by the listener."""
        self._notify_timeout_s = notify_timeout_s
        self._ping_interval_s = ping_interval_s
        self._task: asyncio.Task[None] | None = None
        self._first_attempt = asyncio.Event()
        self._connections = 0

    @property
    def connections(self) -> int:
        """How many times the listener has connected (and subscribed) so far."""
        return self._connections

    def _payload(self, lane: str) -> str:
        return wake_payload(self.hub.origin, lane)

    def announcement(self) -> Announcement | None:
        """What a write needs to send this transport's wake-ups itself; None: it cannot."""
        return None

    def _receive(self, payload: str) -> None:
        origin, sep, lane = payload.partition(":")
        if not sep:  # a bare lane, from a sender that does not tag its payloads
            origin, lane = "", payload
        if origin != self.hub.origin:
            self.hub.wake((lane,))

    def _on_listening(self) -> None:
        """Called by :meth:`_listen` once the listener is subscribed on a new connection."""
        self._connections += 1
        if self._connections > 1:
            logger.info("%s wake-up listener reconnected", self.transport)
        # Whatever was sent while the listener was away is lost: wake every lane so the
        # workers claim once, instead of waiting for their slow poll.
        self.hub.wake_all()
        self._first_attempt.set()

    async def notify(self, lanes: set[str]) -> None:
        if not lanes:
            return
        self.hub.wake(lanes)
        await self.publish(lanes)

    def wake(self, lanes: Iterable[str]) -> None:
        """Wake this process's waiters of ``lanes`` now (the local half of ``notify``)."""
        self.hub.wake(lanes)

    async def publish(self, lanes: set[str]) -> None:
        """Tell the other processes only (the remote half of ``notify``); failures are logged."""
        if not lanes:
            return
        try:
            async with asyncio.timeout(self._notify_timeout_s):
                await self._publish(sorted(lanes))
        except Exception as exc:
            if not self._is_transport_error(exc):
                raise
            self._not_sent(lanes, exc)

    def publish_now(self, lanes: set[str]) -> bool:
        """:meth:`publish` without waiting, where the transport never waits; else False.

        False: nothing was sent, and :meth:`publish` must be awaited (a server's round trip).
        """
        return False

    def _not_sent(self, lanes: set[str], exc: Exception) -> None:
        logger.warning(
            "could not send a %s wake-up for lanes %s; workers elsewhere find the runs "
            "on their next poll: %s",
            self.transport,
            ", ".join(sorted(lanes)),
            _describe(exc),
        )

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(
                self._listen_forever(), name=f"moorline-wakeups-{self.transport}"
            )
        await self._first_attempt.wait()
        self._raise_if_dead()

    async def wait(self, lane: str, timeout_s: float, *, seen_before: float | None = None) -> bool:
        self._raise_if_dead()
        return await self.hub.wait(lane, timeout_s, seen_before=seen_before)

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            [outcome] = await asyncio.gather(task, return_exceptions=True)
            if isinstance(outcome, Exception):
                logger.error("%s wake-up listener had died", self.transport, exc_info=outcome)
        await self._close_transport()

    def _raise_if_dead(self) -> None:
        task = self._task
        if task is not None and task.done() and not task.cancelled():
            error = task.exception()
            if error is not None:
                raise error

    async def _listen_forever(self) -> None:
        delay_s = RECONNECT_MIN_S
        try:
            while True:
                connections = self._connections
                try:
                    await self._listen()
                    why = "the connection was closed"
                except Exception as exc:
                    if not self._is_transport_error(exc):
                        raise
                    why = _describe(exc)
                if self._connections != connections:
                    delay_s = RECONNECT_MIN_S  # it was listening: this is a fresh outage
                logger.warning(
                    "%s wake-up listener is not listening; reconnecting in %.2fs: %s",
                    self.transport,
                    delay_s,
                    why,
                )
                self._first_attempt.set()
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, RECONNECT_MAX_S)
        finally:
            self._first_attempt.set()

    @abstractmethod
    async def _publish(self, lanes: list[str]) -> None:
        """Send one payload per lane to every other process."""

    @abstractmethod
    async def _listen(self) -> None:
        """Connect, subscribe, call :meth:`_on_listening`, deliver payloads until lost.

        Returns or raises a transport error when the connection is lost; never returns
        while it is healthy.
        """

    @abstractmethod
    def _is_transport_error(self, exc: Exception) -> bool:
        """Whether ``exc`` is the transport failing (reconnect), not a programming error."""

    async def _close_transport(self) -> None:
        return None


class BackgroundNotifier:
    """The :class:`~moorline.dispatch.submit.Submitter`'s ``on_enqueued`` hook for a Notifier.

    The submitter calls its hook synchronously from its writer task, which must not wait for a
    remote ``notify``. Each call adds its lanes to a pending set; one sender task sends
    whatever is pending, then again for what arrived meanwhile, so a burst of batches costs a
    few notifications, not one task each, and nothing grows without bound.
    """

    def __init__(self, notifier: Notifier) -> None:
        self._notifier = notifier
        self._pending: set[str] = set()
        self._sender: asyncio.Task[None] | None = None

    def __call__(self, lanes: set[str]) -> bool:
        """Wake ``lanes`` here and elsewhere; True when that waits for the sender task."""
        notifier = self._notifier
        if isinstance(notifier, LocalWakeups | ListeningWakeups):
            # This process's waiters are woken here, synchronously: through the sender task
            # they would first wait a turn of the event loop behind every ready callback. So
            # are the other processes' where sending never waits (datagrams).
            notifier.wake(lanes)
            if isinstance(notifier, LocalWakeups) or notifier.publish_now(lanes):
                return False
        self._pending |= lanes
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send(), name="moorline-wakeups-sender")
        return True

    async def _send(self) -> None:
        notifier = self._notifier
        while self._pending:
            lanes, self._pending = self._pending, set()
            try:
                if isinstance(notifier, ListeningWakeups):
                    await notifier.publish(lanes)  # its local half went out in __call__
                else:
                    await notifier.notify(lanes)
            except Exception:
                logger.exception("wake-up for lanes %s failed", ", ".join(sorted(lanes)))

    async def close(self) -> None:
        """Send what is pending; idempotent."""
        sender = self._sender
        if sender is not None:
            await sender


def make_wakeups(settings: Settings, db: DatabaseManager) -> tuple[Notifier, Waiter]:
    """The wake-ups to use: Redis, LISTEN/NOTIFY, datagrams (SQLite), else in-process only.

    Datagrams go between the processes of the host that share a SQLite file. Both halves
    are one object that fans out to the in-process waiters as well. ``start`` the waiter in
    processes that wait for work; ``close`` it on shutdown in every process, since
    it also releases the notifier's connections.

    The database's backend says whether it offers LISTEN/NOTIFY
    (``Capabilities.listen_notify``); the transport built on it lives here, in ``dispatch``,
    because ``moorline.db`` sits below ``dispatch`` and may not import the :class:`Notifier`
    seam it implements. The backend states the capability, this factory chooses from it.
    """
    # Imported here: each transport builds on ListeningWakeups, defined in this module.
    from moorline.dispatch.datagrams import datagram_wakeups_or_none
    from moorline.dispatch.pg_wakeups import PostgresWakeups
    from moorline.dispatch.redis_wakeups import RedisWakeups

    wakeups: LocalWakeups | ListeningWakeups | None = None
    if settings.redis_url:
        wakeups = RedisWakeups(settings.redis_url, prefix=settings.redis_prefix)
    elif db.backend.capabilities.listen_notify and db.listen_targets:
        wakeups = PostgresWakeups(db)
    elif db.backend.capabilities.listen_notify:
        logger.warning(
            "wake-ups: no LISTEN behind PgBouncer without MOORLINE_LISTEN_URL; other processes "
            "find new work by polling every %g s (MOORLINE_POLL_INTERVAL)",
            settings.poll_interval,
        )
    elif db.backend.shared_file is not None:
        wakeups = datagram_wakeups_or_none(db.backend.shared_file)
    if wakeups is None:
        wakeups = LocalWakeups()
    return wakeups, wakeups


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
