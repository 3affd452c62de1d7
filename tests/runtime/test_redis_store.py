"""Redis-only properties of the runtime store: key formats, scripts, lost wake-ups, broken links.

docs/reliability.md D1 (approval lost-wakeup), D5 (script cache) and the "no key without TTL" rule.
"""

import asyncio
import contextlib
import functools
import random
import statistics
import time
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.crc import key_slot

from moorline.concurrency import RECANCEL_EVERY_S, cancel_and_wait
from moorline.errors import BackendUnavailable
from moorline.runtime.base import WindowChange
from moorline.runtime.keys import RedisKeys
from moorline.runtime.pubsub import PubSubHub
from moorline.runtime.redis import SCRIPT_NAMES, RedisRuntimeStore, load_script
from moorline.runtime.redis_client import RedisConnector
from moorline.types import JSONObject, RunId
from tests.helpers import wait_for
from tests.runtime.conftest import keys_under, keys_without_ttl, make_redis_store
from tests.servers import REDIS_TEST_URL, unique_name

LONG_S = 30.0

LOST_WAKEUP_TRIALS = 10_000
"""docs/reliability.md D1 asks 10,000 trials."""
BATCH = 200
"""Trials waiting at once."""
STEPS = ("subscribe", "recheck", "wait")
"""Where the resolve lands: before SUBSCRIBE, between SUBSCRIBE and the re-check, after it."""
QUIET_POLL_S = 30.0
"""Poll interval of the stores below: far beyond every assertion, so polling cannot hide a
lost wake-up; only the signal (or the re-check after a re-subscription) can wake a waiter."""
TRIAL_WAIT_S = 25.0
"""How long a lost-wake-up trial waits: far beyond the signal, short of its poll and of its
interrupt's expiry (``LONG_S``), so a waiter the signal missed still reads its decision."""
WOKEN_BY_SIGNAL_S = TRIAL_WAIT_S * 2 / 3
"""A waiter woken sooner than this after the resolve was woken by the signal or the re-check,
not by its poll or its deadline (a third of the wait later still). The latencies themselves are
printed, not asserted: on a loaded 2-core machine 200 waiters sharing one event loop and one
pool of Redis connections queue for seconds (one trial's subscription and re-check took 3 s
with the test suite running beside it, and a trial 10 s in CI), which says nothing about a
lost wake-up."""


@pytest.fixture
async def quiet_store(redis_prefix: str) -> AsyncIterator[RedisRuntimeStore]:
    store = make_redis_store(
        redis_prefix, poll_interval_s=QUIET_POLL_S, client_name=unique_name("moorline")
    )
    try:
        yield store
    finally:
        await store.close()


def test_key_formats_are_pinned() -> None:
    keys = RedisKeys("mo")
    run = RunId("r1")
    assert keys.lease("c1") == "mo:{conv:c1}:lease"
    assert keys.interactive("c1") == "mo:{conv:c1}:interactive"
    assert keys.interrupt(run, "i1") == "mo:{run:r1}:interrupt:i1"
    assert keys.interrupt_index(run) == "mo:{run:r1}:interrupts"
    assert keys.cancel(run) == "mo:{run:r1}:cancel"
    assert keys.messages(run) == "mo:{run:r1}:inbox"
    assert keys.signal_channel(run) == "mo:{run:r1}:signal"
    assert keys.events_channel(run) == "mo:{run:r1}:events"


def test_keys_of_an_entity_share_one_cluster_slot() -> None:
    keys = RedisKeys("mo")
    for entity in ("r1", "odd}{id:with}braces", "{"):
        run = RunId(entity)
        names = [
            keys.interrupt(run, "i1"),
            keys.interrupt(run, "i2"),
            keys.interrupt_index(run),
            keys.cancel(run),
            keys.messages(run),
        ]
        assert len({key_slot(name.encode()) for name in names}) == 1, names
        conversation = [keys.lease(entity), keys.interactive(entity)]
        assert len({key_slot(name.encode()) for name in conversation}) == 1, conversation


def test_every_script_ships_with_the_package() -> None:
    for name in SCRIPT_NAMES:
        assert "redis.call" in load_script(name)


async def test_every_key_written_has_a_ttl(
    redis_store: RedisRuntimeStore, redis_client: Redis, redis_prefix: str
) -> None:
    run = RunId("r1")
    await redis_store.acquire_lease("c1", "a", LONG_S)
    await redis_store.renew_lease("c1", "a", LONG_S)
    await redis_store.mark_interactive("c1", run, LONG_S)
    await redis_store.open_interrupt(run, "i1", LONG_S)
    await redis_store.open_interrupt(run, "i2", 1.0)
    await redis_store.resolve_interrupt(run, "i1", {"approved": True})
    await redis_store.request_cancel(run)
    await redis_store.push_message(run, 1, "hello")
    written = await keys_under(redis_client, redis_prefix)
    assert len(written) == 7, written
    assert await keys_without_ttl(redis_client, redis_prefix) == []
    index_ttl = await redis_client.pttl(redis_store.keys.interrupt_index(run))
    assert index_ttl > 20_000, "the index outlives its longest-lived interrupt"
    await redis_store.cleanup_run(run)
    await redis_store.release_lease("c1", "a")
    await redis_store.clear_interactive("c1", run)
    assert await keys_under(redis_client, redis_prefix) == []


async def test_scripts_survive_script_flush(
    redis_store: RedisRuntimeStore, redis_client: Redis
) -> None:
    run = RunId("r1")
    await redis_store.acquire_lease("c1", "a", LONG_S)
    await redis_store.open_interrupt(run, "i1", LONG_S)
    waiter = asyncio.create_task(redis_store.wait_interrupt(run, "i1", LONG_S))
    await asyncio.wait((waiter,), timeout=0.2)
    await redis_client.script_flush()
    assert await redis_store.renew_lease("c1", "a", LONG_S)
    assert await redis_store.acquire_lease("c1", "b", LONG_S) == (False, "a")
    assert await redis_store.resolve_interrupt(run, "i1", {"approved": True})
    assert await asyncio.wait_for(waiter, 5) == {"approved": True}
    await redis_client.script_flush()
    await redis_store.push_message(run, 1, "m")
    assert await redis_store.drain_messages(run) == [(1, "m")]
    await redis_store.request_cancel(run)
    assert await redis_store.release_lease("c1", "a")
    await redis_store.cleanup_run(run)


async def test_window_changes_keep_their_order_after_script_flush(
    redis_store: RedisRuntimeStore, redis_client: Redis
) -> None:
    # Redis forgot the script (a restart, a fail-over): the whole batch is refused with
    # NOSCRIPT and sent again in order, so the close still comes after the open.
    run = RunId("r1")
    opened, closed = WindowChange("c1", run, opens=True), WindowChange("c1", run, opens=False)
    # A lease release loads compare_and_delete, which used to close windows: no help now.
    await redis_store.acquire_lease("c2", "a", LONG_S)
    await redis_client.script_flush()
    assert await redis_store.release_lease("c2", "a")
    assert await redis_store.change_windows([opened, closed], LONG_S) == [True, True]
    assert await redis_store.get_interactive_run("c1") is None
    await redis_client.script_flush()
    assert await redis_store.change_windows([closed, opened], LONG_S) == [False, True]
    assert await redis_store.get_interactive_run("c1") == run
    # One change goes as the command alone, not a pipeline: its NOSCRIPT is met the same way.
    await redis_client.script_flush()
    assert await redis_store.change_windows([closed], LONG_S) == [True]
    assert await redis_store.get_interactive_run("c1") is None
    await redis_client.script_flush()
    assert await redis_store.change_windows([opened], LONG_S) == [True]
    await redis_store.clear_interactive("c1", run)


async def test_cancel_checks_asked_together_share_one_round_trip(
    redis_store: RedisRuntimeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker's runs reach their step boundaries together: their checks go as one pipeline
    # (counted here; the commands still go to Redis), each caller getting its own run's flag.
    runs = [RunId(f"r{index}") for index in range(6)]
    for run in runs[::2]:
        await redis_store.request_cancel(run)
    pipelines: list[object] = []
    client = redis_store._client
    make_pipeline = client.pipeline

    def counted(*args: object, **kwargs: object) -> object:
        pipeline = make_pipeline(*args, **kwargs)  # type: ignore[arg-type]
        pipelines.append(pipeline)
        return pipeline

    monkeypatch.setattr(client, "pipeline", counted)
    flags = await asyncio.gather(*(redis_store.is_cancelled(run) for run in runs))
    assert flags == [True, False, True, False, True, False]
    assert len(pipelines) == 1
    assert await redis_store.is_cancelled(runs[1]) is False  # one alone: no pipeline
    assert len(pipelines) == 1
    for run in runs:
        await redis_store.cleanup_run(run)


# Untraced by coverage: its trials repeat paths other tests cover, and tracing would double
# their cost (and slow one side of the race more than the other).
@pytest.mark.no_cover
async def test_lost_wakeup_trials(quiet_store: RedisRuntimeStore) -> None:
    """D1: the resolve lands before, between and after SUBSCRIBE and the re-check."""
    rng = random.Random(20240604)
    plans: dict[RunId, tuple[str, JSONObject]] = {}
    resolved_at: dict[RunId, float] = {}
    latencies: list[float] = []

    async def resolve(run: RunId) -> float:
        _, decision = plans[run]
        assert await quiet_store.resolve_interrupt(run, "i", decision)
        return time.monotonic()

    async def between_steps(step: str, run: RunId) -> None:
        planned_step, _ = plans[run]
        if step == planned_step:
            resolved_at[run] = await resolve(run)

    quiet_store._between_steps = between_steps

    async def trial(index: int) -> None:
        run = RunId(f"t{index}")
        plans[run] = (STEPS[index % len(STEPS)], {"approved": rng.random() < 0.5, "trial": index})
        await quiet_store.open_interrupt(run, "i", LONG_S)
        decision = await quiet_store.wait_interrupt(run, "i", TRIAL_WAIT_S)
        woke_at = time.monotonic()
        step = plans[run][0]
        assert decision == plans[run][1], f"trial {index} ({step}) got {decision}"
        latency = woke_at - resolved_at[run]
        assert latency < WOKEN_BY_SIGNAL_S, (
            f"trial {index} ({step}) woke {latency:.1f}s after the resolve: by a deadline?"
        )
        latencies.append(latency)

    began = time.monotonic()
    for start in range(0, LOST_WAKEUP_TRIALS, BATCH):
        await asyncio.gather(*(trial(i) for i in range(start, start + BATCH)))
    elapsed = time.monotonic() - began
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99)]
    print(
        f"{LOST_WAKEUP_TRIALS} trials in {elapsed:.1f}s; resume latency "
        f"median {statistics.median(latencies) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms"
    )
    assert len(latencies) == LOST_WAKEUP_TRIALS


# Untraced by coverage: its trials repeat paths other tests cover, and tracing would double
# their cost (and slow one side of the race more than the other).
@pytest.mark.no_cover
async def test_resolve_racing_the_waiter_at_random(quiet_store: RedisRuntimeStore) -> None:
    """Resolves at random instants around the subscription, with no hook to order them."""
    rng = random.Random(7)

    async def trial(index: int) -> None:
        run = RunId(f"r{index}")
        decision: JSONObject = {"approved": index % 2 == 0}
        await quiet_store.open_interrupt(run, "i", LONG_S)

        async def resolve_later() -> None:
            await asyncio.sleep(rng.random() * 0.01)
            assert await quiet_store.resolve_interrupt(run, "i", decision)

        got, _ = await asyncio.gather(quiet_store.wait_interrupt(run, "i", 10.0), resolve_later())
        assert got == decision

    for start in range(0, 1000, BATCH):
        await asyncio.gather(*(trial(i) for i in range(start, start + BATCH)))


async def test_a_wait_ends_at_its_deadline_even_when_a_call_lost_the_cancel(
    quiet_store: RedisRuntimeStore,
) -> None:
    """On Python 3.11 redis-py's ``wait_for`` can return instead of raising the cancel that
    asyncio.timeout sends at the deadline (CPython gh-86296): the watch must end all the same.
    Here a hook in the watch loses that cancel as such a call would; before the watch checked
    its deadline itself, it polled for ever (a child run's 50 ms message poll never returned,
    so the run never parked)."""

    async def lose_the_cancel(step: str, run: RunId) -> None:
        if step == "wait":
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(1.0)  # the wait's 0.2 s deadline passes in here

    quiet_store._between_steps = lose_the_cancel
    try:
        waited = quiet_store.wait_cancelled(RunId("lost-cancel"), 0.2)
        assert await asyncio.wait_for(waited, 10.0) is False
    finally:
        quiet_store._between_steps = None


async def kill_pubsub_connections(client: Redis, name: str | None) -> int:
    """Kill the store's subscribed connections (found by client name); how many there were."""
    clients = await client.client_list(_type="pubsub")
    ids = [entry["id"] for entry in clients if entry["name"] == name]
    for client_id in ids:
        await client.client_kill_filter(_id=client_id)
    return len(ids)


async def kill_then_resolve(store: RedisRuntimeStore, client: Redis, runs: list[RunId]) -> None:
    """Every waiter is waiting; kill the Pub/Sub connection, then resolve at once."""
    waiting: set[RunId] = set()
    all_waiting = asyncio.Event()

    async def between_steps(step: str, run: RunId) -> None:
        if step == "wait":
            waiting.add(run)
            if len(waiting) == len(runs):
                all_waiting.set()

    store._between_steps = between_steps
    for run in runs:
        await store.open_interrupt(run, "i", LONG_S)
    tasks = [asyncio.create_task(store.wait_interrupt(run, "i", 20.0)) for run in runs]
    await asyncio.wait_for(all_waiting.wait(), 10)
    killed = await kill_pubsub_connections(client, store.client_name)
    assert killed == 1, "all waits share one connection"
    began = time.monotonic()
    for index, run in enumerate(runs):
        assert await store.resolve_interrupt(run, "i", {"approved": True, "i": index})
    results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert results == [{"approved": True, "i": index} for index in range(len(runs))]
    assert time.monotonic() - began < 5.0, "woken by re-subscription, not by polling"


async def test_killed_subscriptions_do_not_lose_wakeups(
    quiet_store: RedisRuntimeStore, redis_client: Redis
) -> None:
    """D1: the subscriber connection is killed at publish time; waiters re-subscribe, re-check."""
    for round_ in range(3):
        await kill_then_resolve(
            quiet_store, redis_client, [RunId(f"k{round_}-{i}") for i in range(50)]
        )
    quiet_store._between_steps = None
    # Cancel waits recover the same way.
    runs = [RunId(f"c{i}") for i in range(10)]
    cancel_waits = [asyncio.create_task(quiet_store.wait_cancelled(run, 20.0)) for run in runs]
    await asyncio.wait(cancel_waits, timeout=0.3)
    assert await kill_pubsub_connections(redis_client, quiet_store.client_name) == 1
    for run in runs:
        await quiet_store.request_cancel(run)
    assert await asyncio.wait_for(asyncio.gather(*cancel_waits), 10) == [True] * 10


async def test_event_subscription_is_dropped_when_its_connection_breaks(
    quiet_store: RedisRuntimeStore, redis_client: Redis
) -> None:
    run = RunId("r1")
    subscription = await quiet_store.subscribe_events(run)
    await quiet_store.publish_events(run, [{"seq": 1}])
    assert await asyncio.wait_for(anext(subscription), 5) == {"seq": 1}
    assert await kill_pubsub_connections(redis_client, quiet_store.client_name) == 1

    async def is_dropped() -> bool:
        return subscription.is_dropped

    await wait_for(is_dropped, timeout_s=10, message="the subscription to report the gap")
    assert [event async for event in subscription] == []
    assert subscription.last_seq == 1
    await subscription.close()
    # A new subscription opens a fresh channel subscription and gets what follows.
    again = await quiet_store.subscribe_events(run)
    await quiet_store.publish_events(run, [{"seq": 2}])
    assert await asyncio.wait_for(anext(again), 5) == {"seq": 2}
    await again.close()


async def test_subscribers_of_a_run_share_one_channel_subscription(
    redis_store: RedisRuntimeStore, redis_client: Redis
) -> None:
    run = RunId("r1")
    channel = redis_store.keys.events_channel(run)

    async def subscribers() -> int:
        [(_, count)] = await redis_client.pubsub_numsub(channel)
        return int(count)

    subscriptions = await asyncio.gather(*(redis_store.subscribe_events(run) for _ in range(100)))
    assert await subscribers() == 1
    batch: list[JSONObject] = [{"seq": seq} for seq in range(1, 51)]
    await redis_store.publish_events(run, batch)
    for subscription in subscriptions:
        assert await asyncio.wait_for(subscription.take(), 5) == batch
    for subscription in subscriptions[:-1]:
        await subscription.close()
    assert await subscribers() == 1, "unsubscribed only when the last one leaves"
    await subscriptions[-1].close()

    async def unsubscribed() -> bool:
        return await subscribers() == 0

    await wait_for(unsubscribed, timeout_s=5, message="the channel to be unsubscribed")


async def test_unreachable_redis_fails_clearly_and_never_hangs() -> None:
    store = make_redis_store(unique_name("mo_test"), url="redis://127.0.0.1:1/0")
    try:
        began = time.monotonic()
        with pytest.raises(BackendUnavailable):
            await store.wait_interrupt(RunId("r1"), "i1", 0.5)
        with pytest.raises(BackendUnavailable):
            await store.wait_cancelled(RunId("r1"), 0.5)
        assert time.monotonic() - began < 4.0
        with pytest.raises(BackendUnavailable):
            await store.is_cancelled(RunId("r1"))
    finally:
        await store.close()


class _Deaf:
    def on_message(self, data: str) -> None:
        """Nothing to hear."""

    def on_broken(self) -> None:
        """Nothing to resubscribe."""


async def test_closing_the_hub_ends_a_reader_that_swallowed_its_cancel(redis_prefix: str) -> None:
    # redis-py may swallow a cancel on Python 3.11 (see keep_cancel): the hub's reader then
    # went back to reading a connection nothing would write to, and closing the hub waited
    # for it for ever (a CI run hung there in a store's teardown). A reader that swallows its
    # first cancel stands for it: closing must cancel it again until it ends.
    connector = RedisConnector(REDIS_TEST_URL)
    client = connector.client(decode_responses=True)
    hub = PubSubHub(functools.partial(connector.pubsub, client))
    read_again = asyncio.Event()

    async def swallowing_reader() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            pass  # swallowed, as redis-py's read did
        read_again.set()
        await asyncio.Event().wait()  # reading again: only a second cancel ends it

    try:
        link = await hub.subscribe(f"{redis_prefix}:deaf", _Deaf())
        assert link.reader is not None
        real_reader, link.reader = link.reader, asyncio.create_task(swallowing_reader())
        await asyncio.sleep(0)  # the stand-in waits in its first read
        await asyncio.wait_for(hub.close(), timeout=5 * RECANCEL_EVERY_S)
        assert read_again.is_set() and link.reader.cancelled()
        await cancel_and_wait((real_reader,))
    finally:
        await client.aclose()
