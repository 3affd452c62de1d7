"""The one place ``MOORLINE_REDIS_URL`` becomes a Redis client: one server, Sentinel or Cluster.

Three URL forms, each through redis-py's own client for it:

- ``redis://``, ``rediss://``, ``unix://``: one server (``redis.asyncio.Redis``).
- ``redis+sentinel://[[user]:password@]host:port[,host:port...]/<service_name>[/<db>]``: the
  master of ``service_name`` as the sentinels name it (``redis.asyncio.sentinel.Sentinel``,
  ``master_for``). The userinfo is the master's; the sentinels' own credentials, when they
  have any, are the query parameters ``sentinel_username`` and ``sentinel_password``. After a
  fail-over, the next connection asks the sentinels again and reaches the new master.
- ``redis+cluster://[[user]:password@]host:port[,host:port...]``: Redis Cluster
  (``redis.asyncio.cluster.RedisCluster``), the nodes being where it starts discovering the
  slots. ``rediss+sentinel://`` and ``rediss+cluster://`` speak TLS.

Anything else (an unknown scheme, no host, a port that is not a number, a Sentinel URL
without a service, a database on Cluster, an unknown query parameter) is a
:class:`~moorline.errors.ConfigError` naming the setting, raised where a client is built, at
start.

Pub/Sub is plain ``PUBLISH``/``SUBSCRIBE`` on all three: a Cluster forwards every message to
every node over its bus, so a subscriber on any one node hears them all. Sharded Pub/Sub
(``SSUBSCRIBE``) would spread that load, but one connection would then be needed per shard and
per Moorline store, and the volume here (wake-up signals and event batches) does not need it.
"""

import random
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeAlias
from urllib.parse import parse_qsl, unquote, urlsplit

from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff

from moorline.errors import ConfigError

RedisClient: TypeAlias = Redis | RedisCluster
"""A client of any topology; both kinds offer the commands, scripts and pipelines used here."""

SETTING = "MOORLINE_REDIS_URL"
SENTINEL_OPTIONS = frozenset({"sentinel_username", "sentinel_password"})


class RedisTopology(StrEnum):
    """How the Redis behind a URL is run."""

    SERVER = "server"
    SENTINEL = "sentinel"
    CLUSTER = "cluster"


@dataclass(frozen=True, slots=True, kw_only=True)
class RedisTarget:
    """A parsed ``MOORLINE_REDIS_URL``.

    Attributes:
        topology: One server, a Sentinel-watched master, or a Cluster.
        url: The URL as given (one server connects with it as it is).
        nodes: The sentinels, or the cluster nodes to start from.
        service_name: Sentinel's name of the master.
        db: The database number (always 0 on Cluster).
        username: The data nodes' user.
        password: The data nodes' password.
        sentinel_username: The sentinels' user.
        sentinel_password: The sentinels' password.
        ssl: Whether the data nodes speak TLS.
    """

    topology: RedisTopology
    url: str
    nodes: tuple[tuple[str, int], ...] = ()
    service_name: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    ssl: bool = False


_SCHEMES: Mapping[str, tuple[RedisTopology, bool]] = {
    "redis+sentinel": (RedisTopology.SENTINEL, False),
    "rediss+sentinel": (RedisTopology.SENTINEL, True),
    "redis+cluster": (RedisTopology.CLUSTER, False),
    "rediss+cluster": (RedisTopology.CLUSTER, True),
}


def parse_redis_url(url: str) -> RedisTarget:
    """Read a ``MOORLINE_REDIS_URL`` (see the module docstring for its forms).

    Raises:
        ConfigError: the URL is none of the forms.
    """
    scheme, _, rest = url.partition("://")
    if not rest:
        # Not echoed: what was meant as a URL may hold a password.
        raise ConfigError(f"{SETTING}: not a URL; expected e.g. redis://host:6379/0")
    if scheme in ("redis", "rediss", "unix"):
        _check_server_url(url)
        return RedisTarget(topology=RedisTopology.SERVER, url=url)
    if scheme not in _SCHEMES:
        raise ConfigError(
            f"{SETTING}: unknown scheme {scheme!r}; use redis://, rediss://, unix://, "
            "redis+sentinel:// or redis+cluster://"
        )
    topology, ssl = _SCHEMES[scheme]
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    options = dict(parse_qsl(parts.query, keep_blank_values=True))
    allowed = SENTINEL_OPTIONS if topology is RedisTopology.SENTINEL else frozenset()
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ConfigError(f"{SETTING}: unknown parameter {unknown[0]!r} for {scheme}://")
    path = [segment for segment in parts.path.split("/") if segment]
    service_name, db = "", 0
    if topology is RedisTopology.SENTINEL:
        if not path or len(path) > 2:
            raise ConfigError(
                f"{SETTING}: a Sentinel URL names the master's service: "
                "redis+sentinel://host:port,host:port/<service_name>[/<db>]"
            )
        service_name = unquote(path[0])
        db = _db_number(path[1]) if len(path) == 2 else 0
    elif path:
        raise ConfigError(f"{SETTING}: Redis Cluster has one database; drop the path {parts.path}")
    return RedisTarget(
        topology=topology,
        url=url,
        nodes=_nodes(hosts, default_port=26379 if topology is RedisTopology.SENTINEL else 6379),
        service_name=service_name,
        db=db,
        username=unquote(username) or None,
        password=unquote(password) or None,
        sentinel_username=options.get("sentinel_username") or None,
        sentinel_password=options.get("sentinel_password") or None,
        ssl=ssl,
    )


def _check_server_url(url: str) -> None:
    # redis-py's own parser decides what a one-server URL means; only its complaint is ours.
    try:
        ConnectionPool.from_url(url)
    except ValueError as exc:
        raise ConfigError(f"{SETTING}: {exc}") from None


def _nodes(hosts: str, *, default_port: int) -> tuple[tuple[str, int], ...]:
    nodes: list[tuple[str, int]] = []
    for node in hosts.split(","):
        host, colon, port = node.strip().rpartition(":")
        if not colon:
            host, port = port, str(default_port)
        host = host.strip("[]")  # an IPv6 address is written [::1]:6379
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{SETTING}: {node!r} is not host:port")
        nodes.append((host, int(port)))
    return tuple(nodes)


def _db_number(text: str) -> int:
    if not text.isdigit():
        raise ConfigError(f"{SETTING}: the database {text!r} is not a number")
    return int(text)


class _SentinelPool(SentinelConnectionPool):
    """Sentinel's pool that closes its sentinel clients with itself (it is their only user)."""

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            await self.sentinel_manager.aclose()


class _BlockingSentinelPool(_SentinelPool, BlockingConnectionPool):
    """Sentinel's pool, whose callers past ``max_connections`` wait as in a blocking pool."""


class _Cluster(RedisCluster):
    """``RedisCluster`` whose commands wait for its one discovery of the slots to end.

    With redis-py 8.1 a burst of commands on a fresh client, some run before the discovery
    ended, fails now and then with ``AttributeError`` ('NoneType' object has no attribute
    'writelines'): measured 7 of 60 bursts of 50 on a loaded machine, none once discovered.
    ``initialize`` holds a lock and returns at once when done, so this costs one check.
    """

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if self._initialize:
            await self.initialize()
        return await super().execute_command(*args, **kwargs)


class RedisConnector:
    """Builds the clients of one ``MOORLINE_REDIS_URL``; every Redis user in Moorline asks it.

    Args:
        url: The URL (``redis://``, ``redis+sentinel://``, ``redis+cluster://``, ...).

    Raises:
        ConfigError: the URL is none of the accepted forms.
    """

    def __init__(self, url: str) -> None:
        self.target = parse_redis_url(url)

    @property
    def topology(self) -> RedisTopology:
        return self.target.topology

    @property
    def is_cluster(self) -> bool:
        """Whether the clients are ``RedisCluster`` (whose pipelines refuse ``PUBLISH``)."""
        return self.target.topology is RedisTopology.CLUSTER

    def client(
        self,
        *,
        max_connections: int | None = None,
        decode_responses: bool = False,
        client_name: str | None = None,
        retry: Retry | None = None,
        socket_timeout: float | None = None,
        socket_connect_timeout: float | None = None,
    ) -> RedisClient:
        """A client with its own connections; the caller closes it (``aclose``).

        Args:
            max_connections: With a number, callers beyond it wait for a free connection (a
                blocking pool); on Cluster it is the cap per node, and a call past it fails
                at once, as redis-py's cluster client has no blocking pool.
            decode_responses: Replies as ``str`` rather than ``bytes``.
            client_name: ``CLIENT SETNAME`` of every connection.
            retry: How a command rides over a dropped connection; None: redis-py's default.
            socket_timeout: Longest wait for a reply.
            socket_connect_timeout: Longest wait for a connection.
        """
        # Only what the caller set: a one-server URL's own query (``?socket_timeout=5``) stays.
        given = {
            "client_name": client_name,
            "retry": retry,
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": socket_connect_timeout,
        }
        options: dict[str, Any] = {"decode_responses": decode_responses}
        options.update((name, value) for name, value in given.items() if value is not None)
        target = self.target
        if target.topology is RedisTopology.SERVER:
            if max_connections is None:
                return Redis.from_pool(ConnectionPool.from_url(target.url, **options))
            return Redis.from_pool(
                BlockingConnectionPool.from_url(
                    target.url, max_connections=max_connections, **options
                )
            )
        options.update(username=target.username, password=target.password, ssl=target.ssl)
        if max_connections is not None:
            options["max_connections"] = max_connections
        if target.topology is RedisTopology.SENTINEL:
            sentinel = Sentinel(  # type: ignore[no-untyped-call]  # redis-py leaves it untyped
                list(target.nodes),
                sentinel_kwargs={
                    "username": target.sentinel_username,
                    "password": target.sentinel_password,
                    "socket_timeout": socket_timeout,
                    "socket_connect_timeout": socket_connect_timeout,
                },
            )
            pool = _SentinelPool if max_connections is None else _BlockingSentinelPool
            master: Redis = sentinel.master_for(
                target.service_name, connection_pool_class=pool, db=target.db, **options
            )
            return master
        nodes = [ClusterNode(host, port) for host, port in target.nodes]
        return _Cluster(startup_nodes=nodes, **options)

    def pubsub_client(
        self, commands: RedisClient, *, decode_responses: bool, client_name: str | None
    ) -> RedisClient:
        """The client to open Pub/Sub connections from, whose connections never retry.

        Its caller must see every broken connection (a silent reconnect hides lost messages).
        On Cluster, ``commands`` itself: redis-py retries there at the cluster level only,
        never on a node's connection, and reusing it spares the first subscription a second
        discovery of the slots (a quarter of a second measured on a loaded machine). Close it
        only if it is not ``commands``.
        """
        if isinstance(commands, RedisCluster):
            return commands
        return self.client(
            decode_responses=decode_responses,
            client_name=client_name,
            retry=Retry(NoBackoff(), 0),
        )

    async def pubsub(self, client: RedisClient) -> PubSub:
        """A Pub/Sub object on a connection of its own, made from ``client``'s settings.

        On Cluster the connection goes to one node picked at random: every node hears every
        ``PUBLISH`` (module docstring), and a node that died is left for another on the next
        call.
        """
        if isinstance(client, RedisCluster):
            await client.initialize()
            return client.pubsub(node=random.choice(client.get_nodes()))
        return client.pubsub()
