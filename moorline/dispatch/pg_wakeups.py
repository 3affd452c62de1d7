"""Wake-ups across processes through PostgreSQL LISTEN/NOTIFY (:mod:`moorline.dispatch.wakeups`).

``SELECT pg_notify(channel, payload)`` and ``LISTEN``, each on an asyncpg connection of its
own that is not part of the pool (to ``MOORLINE_LISTEN_URL`` when set: behind PgBouncer the
pool's sessions are not its own).
"""

import asyncio
import functools
from typing import Any

from moorline.concurrency import is_set_within
from moorline.db.dsn import make_failover_creator
from moorline.db.failures import is_unavailable
from moorline.db.manager import DatabaseManager
from moorline.db.repos.announcements import Announcement
from moorline.dispatch.wakeups import (
    NOTIFY_TIMEOUT_S,
    PING_INTERVAL_S,
    PING_TIMEOUT_S,
    ListeningWakeups,
    LocalWakeups,
)
from moorline.errors import BackendUnavailable, ConfigError

PG_CHANNEL = "moorline_wakeups"
"""The LISTEN/NOTIFY channel; channels are per database, so one name serves every lane."""


@functools.cache
def _notify_sql(lanes: int) -> str:
    """``SELECT pg_notify($1, $2), pg_notify($1, $3), …``: the channel, then a payload a lane."""
    return "SELECT " + ", ".join(f"pg_notify($1, ${index + 2})" for index in range(lanes))


class PostgresWakeups(ListeningWakeups):
    """Wake-ups across processes through PostgreSQL LISTEN/NOTIFY.

    ``notify`` sends ``pg_notify``, one statement committed alone (NOTIFY is delivered at
    commit), on an asyncpg connection kept for it, opened at the first notify; the listener
    holds another. Both are opened by the manager's primary-first failover creator, so they
    follow a database failover too; a publishing connection that fails is dropped, and the
    notify is tried once more on a new one.
    A lost connection is noticed at once by asyncpg's termination callback, and a silently
    dead one by a ``SELECT 1`` after ``ping_interval_s`` of silence.
    """

    transport = "postgresql"

    def __init__(
        self,
        db: DatabaseManager,
        *,
        channel: str = PG_CHANNEL,
        hub: LocalWakeups | None = None,
        notify_timeout_s: float = NOTIFY_TIMEOUT_S,
        ping_interval_s: float = PING_INTERVAL_S,
    ) -> None:
        """Create PostgreSQL wake-ups; nothing connects before ``start`` or ``notify``.

        Args:
            db: The manager whose database (and failover addresses) to use.
            channel: The LISTEN/NOTIFY channel (at most 63 bytes).
            hub: The in-process wake-ups to fan out to; a new one when None.
            notify_timeout_s: Longest a ``notify`` may take before it is given up.
            ping_interval_s: Seconds of silence before the listener pings its connection.

        Raises:
            ConfigError: ``db`` is not a PostgreSQL database, or it is behind PgBouncer and
                ``MOORLINE_LISTEN_URL`` is not set.
        """
        if not db.backend.capabilities.listen_notify:
            raise ConfigError(f"LISTEN/NOTIFY wake-ups need PostgreSQL, not {db.backend.name}")
        if not db.listen_targets:
            raise ConfigError(
                "LISTEN/NOTIFY wake-ups behind PgBouncer need MOORLINE_LISTEN_URL "
                "(a direct PostgreSQL URL)"
            )
        super().__init__(
            hub=hub, notify_timeout_s=notify_timeout_s, ping_interval_s=ping_interval_s
        )
        self.channel = channel
        self._connect = make_failover_creator(db.listen_targets)
        self._backend_pid: int | None = None
        self._publisher: Any = None  # the asyncpg connection notifies go out on, once opened
        self._publishing = asyncio.Lock()  # one statement at a time on it

    def announcement(self) -> Announcement:
        """The channel and origin of ``pg_notify`` for a write that announces its runs.

        The write reaches the database through the pool (PgBouncer included, where a NOTIFY
        is allowed), the listeners through ``MOORLINE_LISTEN_URL``: one database, so its
        notifications reach them either way.
        """
        return Announcement(channel=self.channel, origin=self.hub.origin)

    @property
    def backend_pid(self) -> int | None:
        """Server process id of the listener connection while it is connected."""
        return self._backend_pid

    @property
    def publisher_pid(self) -> int | None:
        """Server process id of the connection notifies go out on, once one is open."""
        publisher = self._publisher
        return None if publisher is None or publisher.is_closed() else publisher.get_server_pid()

    async def _publish(self, lanes: list[str]) -> None:
        payloads = [self._payload(lane) for lane in lanes]
        # asyncpg's own statement, not one through SQLAlchemy and the pool: this is all a
        # submitting process sends besides its runs, and SQLAlchemy's way cost it several
        # times the CPU (docs/performance.md). Committed alone, the notifications go out at
        # once.
        async with self._publishing:
            if self._publisher is not None and not self._publisher.is_closed():
                try:
                    await self._send(payloads)
                    return
                except Exception:
                    # Kept from an earlier notify, it may have died since (a restart, a
                    # terminated backend): one more try, on a new connection.
                    pass
            self._publisher = await self._connect()
            await self._send(payloads)

    async def _send(self, payloads: list[str]) -> None:
        conn = self._publisher
        try:
            await conn.execute(_notify_sql(len(payloads)), self.channel, *payloads)
        except BaseException:
            self._publisher = None
            conn.terminate()
            raise

    async def _listen(self) -> None:
        conn = await self._connect()
        try:
            lost = asyncio.Event()
            conn.add_termination_listener(lambda _conn: lost.set())
            await conn.add_listener(self.channel, self._on_notification)
            self._backend_pid = conn.get_server_pid()
            self._on_listening()
            while not await is_set_within(lost, self._ping_interval_s):
                async with asyncio.timeout(PING_TIMEOUT_S):
                    await conn.fetchval("SELECT 1")
            raise ConnectionResetError("the LISTEN connection was closed")
        finally:
            self._backend_pid = None
            conn.terminate()

    def _on_notification(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        self._receive(payload)

    async def _close_transport(self) -> None:
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            publisher.terminate()

    def _is_transport_error(self, exc: Exception) -> bool:
        import asyncpg

        return (
            is_unavailable(exc)
            or isinstance(exc, BackendUnavailable | OSError | TimeoutError)
            or isinstance(exc, asyncpg.PostgresError | asyncpg.InterfaceError)
        )
