"""RuntimeStore fixtures: every contract test runs on the in-memory store and on Redis.

Redis three ways: the shared server, a Sentinel-watched master with its replica, and a six-node
Cluster (``tests/redis_topologies.py``; the last two started once per test module that asks).
Each Redis test gets a key prefix of its own; at teardown every key under it must have a TTL
(no immortal key, ever) and is then deleted. Nothing here flushes the server.
"""

from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from moorline.runtime.base import DEFAULT_EVENT_QUEUE_SIZE, RuntimeStore
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.runtime.redis import RedisRuntimeStore
from moorline.runtime.redis_client import RedisClient
from tests.redis_topologies import ClusterRedis, SentinelRedis
from tests.servers import REDIS_TEST_URL, require_server, unique_name

STORE_KINDS = ["memory", "redis", "sentinel", "cluster"]

RETENTION_S = 60.0
POLL_INTERVAL_S = 0.5
MAX_MESSAGES = 500


async def keys_under(client: RedisClient, prefix: str) -> list[str]:
    """Every key under ``prefix`` (SCAN, never KEYS)."""
    return [str(key) async for key in client.scan_iter(match=f"{prefix}:*", count=1000)]


async def keys_without_ttl(client: RedisClient, prefix: str) -> list[str]:
    """Keys under ``prefix`` whose PTTL is -1 (no expiry); keys that vanished meanwhile are fine."""
    keys = await keys_under(client, prefix)
    if not keys:
        return []
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.pttl(key)
    ttls = await pipe.execute()
    return [key for key, ttl in zip(keys, ttls, strict=True) if ttl == -1]


async def delete_keys(client: RedisClient, prefix: str) -> None:
    keys = await keys_under(client, prefix)
    for start in range(0, len(keys), 500):
        await client.delete(*keys[start : start + 500])


def make_redis_store(
    prefix: str,
    *,
    url: str = REDIS_TEST_URL,
    poll_interval_s: float = POLL_INTERVAL_S,
    client_name: str | None = None,
    event_queue_size: int = DEFAULT_EVENT_QUEUE_SIZE,
) -> RedisRuntimeStore:
    return RedisRuntimeStore(
        url,
        prefix=prefix,
        retention_s=RETENTION_S,
        poll_interval_s=poll_interval_s,
        client_name=client_name,
        max_messages=MAX_MESSAGES,
        event_queue_size=event_queue_size,
    )


@pytest.fixture
async def redis_client() -> AsyncIterator[Redis]:
    """A plain client on the test server, to look at what the store wrote."""
    require_server("redis")
    client = Redis.from_url(REDIS_TEST_URL, decode_responses=True)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def redis_prefix(redis_client: Redis) -> AsyncIterator[str]:
    """A fresh key prefix; at teardown every key under it must expire, then it is deleted."""
    prefix = unique_name("mo_test")
    yield prefix
    try:
        immortal = await keys_without_ttl(redis_client, prefix)
        assert not immortal, f"keys without a TTL: {immortal}"
    finally:
        await delete_keys(redis_client, prefix)


@pytest.fixture
async def redis_store(redis_prefix: str) -> AsyncIterator[RedisRuntimeStore]:
    store = make_redis_store(redis_prefix)
    try:
        yield store
    finally:
        await store.close()


async def _checked_store(url: str) -> AsyncIterator[RedisRuntimeStore]:
    """A store under a fresh prefix; at teardown its keys must all expire, then go."""
    prefix = unique_name("mo_test")
    store = make_redis_store(prefix, url=url)
    try:
        yield store
    finally:
        try:
            immortal = await keys_without_ttl(store.client, prefix)
            assert not immortal, f"keys without a TTL: {immortal}"
        finally:
            await delete_keys(store.client, prefix)
            await store.close()


@pytest.fixture
async def sentinel_store(sentinel_redis: SentinelRedis) -> AsyncIterator[RedisRuntimeStore]:
    """The Redis store through Sentinel (``redis+sentinel://``)."""
    async for store in _checked_store(sentinel_redis.url):
        yield store


@pytest.fixture
async def cluster_store(cluster_redis: ClusterRedis) -> AsyncIterator[RedisRuntimeStore]:
    """The Redis store on a six-node Cluster (``redis+cluster://``)."""
    async for store in _checked_store(cluster_redis.url):
        yield store


@pytest.fixture(params=STORE_KINDS)
def store_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


@pytest.fixture
async def memory_store() -> AsyncIterator[InMemoryRuntimeStore]:
    store = InMemoryRuntimeStore(retention_s=RETENTION_S, max_messages=MAX_MESSAGES)
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture
def store(store_kind: str, request: pytest.FixtureRequest) -> RuntimeStore:
    """The store under contract: in-memory, or Redis (server, Sentinel, Cluster) under a fresh
    prefix."""
    chosen: RuntimeStore = request.getfixturevalue(f"{store_kind}_store")
    return chosen
