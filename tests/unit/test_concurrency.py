"""The concurrency utilities with real tasks and real threads.

Orderings are forced with events, barriers and the poll-with-deadline helper, never with sleeps:
a test that shows two things overlap makes them wait for each other (a barrier that would
deadlock otherwise), and a test that shows one thing waits for another polls the waiting
state the utility reports.
"""

import asyncio
import contextvars
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from moorline.concurrency import (
    BoundedQueue,
    KeyedLock,
    ThreadBridge,
    TTLCache,
    cancel_and_wait,
    is_set_within,
    keep_cancel,
    run_in_thread,
)
from tests.helpers import wait_for

TIMEOUT_S = 10.0
"""Longest any single wait in these tests may take before the test fails instead of hanging."""

_REQUEST: contextvars.ContextVar[str] = contextvars.ContextVar("request", default="none")


async def until(predicate: Callable[[], bool], message: str) -> None:
    """Poll a plain predicate with the deadline helper."""

    async def check() -> bool:
        return predicate()

    await wait_for(check, timeout_s=TIMEOUT_S, message=message)


# --- KeyedLock -------------------------------------------------------------------------------


async def test_keyed_lock_serialises_one_key() -> None:
    locks: KeyedLock[str] = KeyedLock()
    inside = 0
    most = 0

    async def use() -> None:
        nonlocal inside, most
        async with locks.hold("run-1"):
            inside += 1
            most = max(most, inside)
            for _ in range(3):  # give every other task the chance to barge in
                await asyncio.sleep(0)
            inside -= 1

    await asyncio.wait_for(asyncio.gather(*(use() for _ in range(20))), TIMEOUT_S)
    assert most == 1
    assert len(locks) == 0


async def test_keyed_lock_lets_different_keys_run_together() -> None:
    locks: KeyedLock[int] = KeyedLock()
    barrier = asyncio.Barrier(5)

    async def use(key: int) -> None:
        async with locks.hold(key):
            # Every key must be held at once for the barrier to open.
            await barrier.wait()

    await asyncio.wait_for(asyncio.gather(*(use(key) for key in range(5))), TIMEOUT_S)
    assert len(locks) == 0


async def test_keyed_lock_removes_a_key_once_nobody_holds_or_waits() -> None:
    locks: KeyedLock[str] = KeyedLock()
    release = asyncio.Event()
    entered = asyncio.Event()

    async def holder() -> None:
        async with locks.hold("a"):
            entered.set()
            await release.wait()

    async def waiter() -> None:
        async with locks.hold("a"):
            raise AssertionError("the cancelled waiter must never get the lock")

    holding = asyncio.create_task(holder())
    await entered.wait()
    waiting = asyncio.create_task(waiter())
    await until(lambda: locks._entries["a"].users == 2, "the waiter to queue")
    assert locks.locked("a") and len(locks) == 1
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert len(locks) == 1  # still held
    release.set()
    await holding
    assert len(locks) == 0 and not locks.locked("a")
    for key in range(1000):
        async with locks.hold(str(key)):
            pass
    assert len(locks) == 0


# --- BoundedQueue ----------------------------------------------------------------------------


def test_bounded_queue_needs_a_bound() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        BoundedQueue[int](0)


async def test_bounded_queue_makes_a_producer_wait_for_room() -> None:
    queue: BoundedQueue[int] = BoundedQueue(2)
    await queue.put(1)
    await queue.put(2)
    with pytest.raises(asyncio.QueueFull):
        queue.put_nowait(3)
    blocked = asyncio.create_task(queue.put(3))  # waits for room
    assert await queue.get() == 1
    await asyncio.wait_for(blocked, TIMEOUT_S)
    assert [await queue.get(), await queue.get()] == [2, 3]


async def test_bounded_queue_drain_takes_everything_and_frees_producers() -> None:
    queue: BoundedQueue[str] = BoundedQueue(2)
    for item in ("a", "b"):
        queue.put_nowait(item)
    blocked = asyncio.create_task(queue.put("c"))
    await until(lambda: not blocked.done() and queue.full(), "the producer to wait for room")
    assert queue.drain_nowait() == ["a", "b"]
    await asyncio.wait_for(blocked, TIMEOUT_S)
    assert queue.drain_nowait() == ["c"]


# --- ThreadBridge ----------------------------------------------------------------------------


class Source:
    """A blocking generator that records what it did, and in which thread."""

    def __init__(self, count: int | None = None, fail_at: int | None = None) -> None:
        self.count = count
        self.fail_at = fail_at
        self.produced = 0
        self.threads: set[int] = set()
        self.closed = threading.Event()
        self.closed_in: int | None = None

    def __iter__(self) -> Iterator[int]:
        try:
            index = 0
            while self.count is None or index < self.count:
                self.threads.add(threading.get_ident())
                if index == self.fail_at:
                    raise ValueError(f"source failed at {index}")
                self.produced += 1
                yield index
                index += 1
        finally:
            self.closed_in = threading.get_ident()
            self.closed.set()


async def test_bridge_delivers_every_item_in_order_from_another_thread() -> None:
    source = Source(count=500)
    async with ThreadBridge(source, max_queued=8) as items:
        received = [item async for item in items]
    assert received == list(range(500))
    assert threading.get_ident() not in source.threads
    await until(source.closed.is_set, "the generator to close")
    assert source.closed_in in source.threads


@pytest.mark.parametrize("error", [ValueError("boom"), KeyboardInterrupt()])
async def test_bridge_raises_the_sources_exception_after_its_items(error: BaseException) -> None:
    def failing() -> Iterator[int]:
        yield 1
        yield 2
        raise error

    received: list[int] = []
    with pytest.raises(type(error)) as caught:
        async with ThreadBridge(failing()) as items:
            async for item in items:
                received.append(item)
    assert caught.value is error
    assert received == [1, 2]


async def test_bridge_producer_runs_ahead_by_at_most_max_queued() -> None:
    source = Source(count=200)
    max_queued = 4
    async with ThreadBridge(source, max_queued=max_queued) as items:
        # One item more than the slots: it is made, then waits for a slot.
        await until(lambda: source.produced == max_queued + 1, "the producer to fill the queue")
        taken = 0
        async for _ in items:
            taken += 1
            assert source.produced <= taken + max_queued + 1
    assert taken == 200


async def test_bridge_leaving_early_releases_a_producer_blocked_on_a_full_queue() -> None:
    source = Source()  # endless
    async with ThreadBridge(source, max_queued=1) as items:
        assert await anext(items) == 0
        # Item 1 is queued, item 2 is made and blocked waiting for a slot.
        await until(lambda: source.produced == 3, "the producer to block on the full queue")
    await until(source.closed.is_set, "the producer to stop")
    assert source.produced == 3


async def test_cancelling_the_consumer_stops_the_producer() -> None:
    source = Source()
    first = asyncio.Event()

    async def consume() -> None:
        async with ThreadBridge(source, max_queued=2) as items:
            async for _ in items:
                first.set()
                await asyncio.Event().wait()  # a consumer stuck on something else

    task = asyncio.create_task(consume())
    await first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(source.closed.is_set, "the producer to stop")
    assert source.produced <= 1 + 2 + 1


async def test_bridge_carries_context_variables_and_keeps_the_loop_free() -> None:
    started, release = threading.Event(), threading.Event()

    def blocking() -> Iterator[str]:
        started.set()
        if not release.wait(TIMEOUT_S):
            raise TimeoutError("the loop never released the producer")
        yield _REQUEST.get()

    _REQUEST.set("req-42")
    async with ThreadBridge(blocking()) as items:
        await until(started.is_set, "the producer to start")  # the loop runs meanwhile
        release.set()
        assert [item async for item in items] == ["req-42"]


async def test_bridge_misuse_is_refused() -> None:
    with pytest.raises(ValueError, match="max_queued"):
        ThreadBridge([1], max_queued=0)
    bridge = ThreadBridge([1])
    with pytest.raises(RuntimeError, match="async with"):
        await anext(bridge)
    async with bridge:
        with pytest.raises(RuntimeError, match="only once"):
            await bridge.__aenter__()


# --- run_in_thread ---------------------------------------------------------------------------


async def test_run_in_thread_returns_raises_and_sees_context() -> None:
    def where(offset: int, *, scale: int) -> tuple[int, str, int]:
        return threading.get_ident(), _REQUEST.get(), offset * scale

    def broken() -> None:
        raise LookupError("no such thing")

    _REQUEST.set("req-7")
    ident, request, value = await run_in_thread(where, 2, scale=21)
    assert ident != threading.get_ident()
    assert (request, value) == ("req-7", 42)
    with pytest.raises(LookupError, match="no such thing"):
        await run_in_thread(broken)


async def test_run_in_thread_is_not_capped_by_the_default_executor() -> None:
    # More calls than the loop's default executor has threads (CPU count + 4, at most 32),
    # each waiting for all the others: they only finish if every one has a thread at once.
    calls = 40
    barrier = threading.Barrier(calls)

    def meet() -> int:
        return barrier.wait(timeout=TIMEOUT_S)

    arrivals = await asyncio.gather(*(run_in_thread(meet) for _ in range(calls)))
    assert sorted(arrivals) == list(range(calls))


async def test_cancelling_run_in_thread_returns_at_once() -> None:
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def slow() -> str:
        started.set()
        release.wait(TIMEOUT_S)
        finished.set()
        return "dropped"

    task = asyncio.create_task(run_in_thread(slow))
    await until(started.is_set, "the call to start")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not finished.is_set()  # the caller did not wait for the call
    release.set()
    await until(finished.is_set, "the call to finish in its thread")


# --- TTLCache --------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Loader:
    """An async loader whose calls can be held open and made to fail."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.version = 1
        self.gate: asyncio.Event | None = None
        self.error: Exception | None = None

    async def __call__(self, key: str) -> str:
        self.calls.append(key)
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        return f"{key}@v{self.version}"


async def test_cache_serves_fresh_values_and_reloads_stale_ones() -> None:
    clock, load = FakeClock(), Loader()
    cache: TTLCache[str, str] = TTLCache(load, ttl_s=5.0, clock=clock)
    assert await cache.get("plans") == "plans@v1"
    load.version = 2
    clock.now += 4.9
    assert await cache.get("plans") == "plans@v1"
    clock.now += 0.2
    assert await cache.get("plans") == "plans@v2"
    assert load.calls == ["plans", "plans"]


async def test_cache_loads_a_missing_key_once_for_every_caller() -> None:
    load = Loader()
    load.gate = asyncio.Event()
    cache: TTLCache[str, str] = TTLCache(load, ttl_s=5.0)
    callers = [asyncio.create_task(cache.get("k")) for _ in range(10)]
    await until(lambda: load.calls == ["k"], "the first load to start")
    assert not any(caller.done() for caller in callers)
    load.gate.set()
    assert await asyncio.gather(*callers) == ["k@v1"] * 10
    assert load.calls == ["k"]


async def test_cache_serves_the_stale_value_while_one_caller_reloads() -> None:
    clock, load = FakeClock(), Loader()
    cache: TTLCache[str, str] = TTLCache(load, ttl_s=1.0, clock=clock)
    await cache.get("k")
    clock.now += 2
    load.version, load.gate = 2, asyncio.Event()
    reloading = asyncio.create_task(cache.get("k"))
    await until(lambda: len(load.calls) == 2, "the reload to start")
    # Others are not held up by the slow reload, and do not start loads of their own.
    assert await asyncio.wait_for(cache.get("k"), TIMEOUT_S) == "k@v1"
    load.gate.set()
    assert await reloading == "k@v2"
    assert await cache.get("k") == "k@v2"
    assert len(load.calls) == 2


async def test_cache_keeps_the_last_value_when_a_reload_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, load = FakeClock(), Loader()
    cache: TTLCache[str, str] = TTLCache(load, ttl_s=1.0, clock=clock, name="plans")
    await cache.get("k")
    clock.now += 2
    load.error = OSError("file vanished")
    with caplog.at_level(logging.ERROR, logger="moorline.concurrency"):
        assert await cache.get("k") == "k@v1"
    assert "plans: reloading 'k' failed" in caplog.text and "file vanished" in caplog.text
    # The failed reload counts as a read: the broken source is asked once per TTL.
    clock.now += 0.5
    assert await cache.get("k") == "k@v1"
    assert len(load.calls) == 2
    load.error, load.version = None, 3
    clock.now += 0.6
    assert await cache.get("k") == "k@v3"


async def test_cache_raises_when_there_is_nothing_to_fall_back_on() -> None:
    load = Loader()
    load.error = OSError("unreachable")
    cache: TTLCache[str, str] = TTLCache(load, ttl_s=1.0)
    with pytest.raises(OSError, match="unreachable"):
        await cache.get("k")
    assert len(cache) == 0
    load.error = None
    assert await cache.get("k") == "k@v1"


async def test_cache_loads_different_keys_concurrently() -> None:
    barrier = asyncio.Barrier(3)

    async def load(key: str) -> str:
        await barrier.wait()  # opens only with all three loads in flight
        return key.upper()

    cache: TTLCache[str, str] = TTLCache(load, ttl_s=1.0)
    got = await asyncio.wait_for(asyncio.gather(*(cache.get(k) for k in "abc")), TIMEOUT_S)
    assert got == ["A", "B", "C"]


async def test_cache_put_invalidate_and_bound() -> None:
    load = Loader()
    cache: TTLCache[str, str] = TTLCache(load, ttl_s=60.0, max_entries=2)
    cache.put("a", "seeded")
    assert await cache.get("a") == "seeded" and load.calls == []
    cache.invalidate("a")
    assert await cache.get("a") == "a@v1"
    await cache.get("b")
    await cache.get("c")  # evicts "a", the least recently loaded
    assert len(cache) == 2
    assert await cache.get("a") == "a@v1" and load.calls == ["a", "b", "c", "a"]
    with pytest.raises(ValueError, match="ttl_s"):
        TTLCache(load, ttl_s=0)


async def test_keep_cancel_raises_a_cancel_the_awaited_call_swallowed() -> None:
    # What Python 3.11's asyncio.wait_for (used by redis-py to send) does when the cancel lands
    # as the call completes: it returns the result and the cancel is gone.
    entered = asyncio.Event()

    async def swallowing_call() -> str:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return "result"
        raise AssertionError("unreachable")  # pragma: no cover

    async def waiter(call: Callable[[], "asyncio.Future[str] | Any"]) -> str:
        result: str = await call()
        await asyncio.sleep(0)  # a later await the cancel would otherwise have ended
        return result

    unprotected = asyncio.create_task(waiter(swallowing_call))
    await asyncio.wait_for(entered.wait(), TIMEOUT_S)
    unprotected.cancel()
    assert await unprotected == "result"  # the bug this guards against: the cancel is lost

    entered.clear()
    protected = asyncio.create_task(waiter(lambda: keep_cancel(swallowing_call())))
    await asyncio.wait_for(entered.wait(), TIMEOUT_S)
    protected.cancel()
    with pytest.raises(asyncio.CancelledError):
        await protected
    assert protected.cancelled()


async def test_keep_cancel_passes_results_and_errors_through() -> None:
    async def answer() -> int:
        return 42

    async def fail() -> int:
        raise ValueError("boom")

    assert await keep_cancel(answer()) == 42
    with pytest.raises(ValueError, match="boom"):
        await keep_cancel(fail())


async def test_cancel_and_wait_cancels_again_a_task_that_swallowed_the_first_cancel() -> None:
    entered, swallowed = asyncio.Event(), asyncio.Event()

    async def swallows_once() -> None:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            swallowed.set()  # as redis-py under Python 3.11 can: the cancel is gone
        await asyncio.Event().wait()  # would wait for ever without a second cancel

    task = asyncio.create_task(swallows_once())
    await asyncio.wait_for(entered.wait(), TIMEOUT_S)
    await asyncio.wait_for(cancel_and_wait([task], recancel_every_s=0.05), TIMEOUT_S)
    assert swallowed.is_set()
    assert task.cancelled()


async def test_cancel_and_wait_returns_at_once_for_finished_tasks() -> None:
    async def answer() -> int:
        return 1

    task = asyncio.create_task(answer())
    await task
    await asyncio.wait_for(cancel_and_wait([task]), TIMEOUT_S)
    assert task.result() == 1


async def test_is_set_within_answers_whether_the_event_came_in_time() -> None:
    event = asyncio.Event()
    assert await is_set_within(event, 0.01) is False  # nobody set it: the time ran out
    asyncio.get_running_loop().call_soon(event.set)
    assert await is_set_within(event, 30) is True  # set by a callback, long before 30 s
    assert await is_set_within(event, 0) is True  # already set: at once, even with no time


async def test_is_set_within_passes_a_cancel_on() -> None:
    event = asyncio.Event()
    waiting = asyncio.create_task(is_set_within(event, 30))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
