"""Wake-ups across processes through Redis Pub/Sub (:mod:`moorline.dispatch.wakeups`)."""

import asyncio
from typing import Any

from moorline.dispatch.wakeups import (
    NOTIFY_TIMEOUT_S,
    PING_INTERVAL_S,
    PING_TIMEOUT_S,
    ListeningWakeups,
    LocalWakeups,
)
from moorline.errors import ConfigError

REDIS_CHANNEL_SUFFIX = "wakeups"


def redis_channel(prefix: str) -> str:
    """The Pub/Sub channel of lane wake-ups under the Redis prefix ``prefix``."""
    return f"{prefix}:{REDIS_CHANNEL_SUFFIX}"


class RedisWakeups(ListeningWakeups):
    """Wake-ups across processes through Redis Pub/Sub on ``<prefix>:wakeups``.

    One client serves both sides: ``PUBLISH`` on pooled connections, ``SUBSCRIBE`` on a
    connection of its own. Its connections are named ``<prefix>:wakeups`` (``CLIENT LIST``).
    redis-py retries a failed read once, reconnecting and subscribing again; every subscribe
    confirmation counts as a (re)connect, so a reconnect made inside redis-py wakes the lanes
    just as one made here does.
    """

    transport = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "mo",
        hub: LocalWakeups | None = None,
        notify_timeout_s: float = NOTIFY_TIMEOUT_S,
        ping_interval_s: float = PING_INTERVAL_S,
    ) -> None:
        """Create Redis wake-ups; nothing connects before ``start`` or ``notify``.

        Args:
            url: The Redis URL (``MOORLINE_REDIS_URL``): one server, Sentinel or Cluster.
            prefix: The key and channel prefix (``MOORLINE_REDIS_PREFIX``).
            hub: The in-process wake-ups to fan out to; a new one when None.
            notify_timeout_s: Longest a ``notify`` may take before it is given up.
            ping_interval_s: Seconds of silence before the listener pings its connection.

        Raises:
            ConfigError: the ``redis`` package is not installed, or the URL is wrong.
        """
        try:
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff

            from moorline.runtime.redis_client import RedisConnector
        except ImportError:  # pragma: no cover - the test environment installs every extra
            raise ConfigError(
                "MOORLINE_REDIS_URL: the redis package is missing; install moorline[redis]"
            ) from None
        super().__init__(
            hub=hub, notify_timeout_s=notify_timeout_s, ping_interval_s=ping_interval_s
        )
        self.channel = redis_channel(prefix)
        self.client_name = f"{prefix}:{REDIS_CHANNEL_SUFFIX}"
        self._connector = RedisConnector(url)
        self._client = self._connector.client(
            client_name=self.client_name,
            socket_connect_timeout=PING_TIMEOUT_S,
            socket_timeout=PING_TIMEOUT_S,
            # One immediate retry: enough to ride over a killed connection; a server that is
            # down fails fast into this class's own reconnect loop and its backoff.
            retry=Retry(NoBackoff(), 1),
        )

    async def _publish(self, lanes: list[str]) -> None:
        if len(lanes) == 1:
            # The usual case: the command alone costs redis-py less than a pipeline of one.
            await self._client.publish(self.channel, self._payload(lanes[0]))
            return
        if self._connector.is_cluster:
            # redis-py's cluster pipeline refuses PUBLISH, which names no key to route by.
            await asyncio.gather(
                *(self._client.publish(self.channel, self._payload(lane)) for lane in lanes)
            )
            return
        async with self._client.pipeline(transaction=False) as pipe:
            for lane in lanes:
                pipe.publish(self.channel, self._payload(lane))
            await pipe.execute()

    async def _listen(self) -> None:
        pubsub = await self._connector.pubsub(self._client)
        try:
            await pubsub.subscribe(self.channel)
            loop = asyncio.get_running_loop()
            heard = loop.time()
            ping_at = heard + self._ping_interval_s
            while True:
                message = await pubsub.get_message(timeout=max(0.0, ping_at - loop.time()))
                now = loop.time()
                if message is not None:
                    heard = now
                    self._on_message(message)
                if now >= ping_at:
                    if now - heard > 1.5 * self._ping_interval_s:
                        raise ConnectionResetError("the Pub/Sub connection stopped answering")
                    await pubsub.ping()
                    ping_at = now + self._ping_interval_s
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]

    def _on_message(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "subscribe":
            self._on_listening()
        elif kind == "message":
            data = message["data"]
            self._receive(data.decode() if isinstance(data, bytes) else str(data))

    def _is_transport_error(self, exc: Exception) -> bool:
        from redis.exceptions import RedisError

        return isinstance(exc, RedisError | OSError | TimeoutError)

    async def _close_transport(self) -> None:
        await self._client.aclose()
