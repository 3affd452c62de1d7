"""The RuntimeStore contract, run on the in-memory store and on Redis (``store`` fixture)."""

import asyncio
import time

import pytest

from moorline.errors import LimitExceeded
from moorline.runtime import (
    CANCELLED_DECISION,
    InMemoryRuntimeStore,
    InterruptState,
    InterruptStatus,
    QueuedMessage,
    RuntimeStore,
    StoreShutdown,
    WindowChange,
    make_runtime_store,
)
from moorline.runtime.redis import RedisRuntimeStore
from moorline.settings import Settings
from moorline.types import JSONObject, RunId
from tests.helpers import wait_for
from tests.runtime.conftest import MAX_MESSAGES

RUN = RunId("run-1")
OTHER_RUN = RunId("run-2")
CONV = "conv-1"
LONG_S = 30.0
SHORT_S = 0.05
APPROVE: JSONObject = {"approved": True, "data": {"note": "ok", "n": 1}}
DENY: JSONObject = {"approved": False, "reason": "denied"}


async def until_waiting(task: "asyncio.Task[object]", seconds: float = 0.2) -> None:
    """Give a waiter time to subscribe; the contract must hold however long this takes."""
    done, _ = await asyncio.wait((task,), timeout=seconds)
    assert not done, f"the waiter returned early: {task.result()!r}"


# -- conversation lease ----------------------------------------------------------------------


async def test_acquire_free_lease_then_others_are_refused(store: RuntimeStore) -> None:
    assert await store.acquire_lease(CONV, "a", LONG_S) == (True, "a")
    acquired, holder = await store.acquire_lease(CONV, "b", LONG_S)
    assert (acquired, holder) == (False, "a")
    assert await store.get_lease_holder(CONV) == "a"
    assert await store.acquire_lease("conv-2", "b", LONG_S) == (True, "b")


async def test_holder_reacquires_its_own_lease(store: RuntimeStore) -> None:
    assert (await store.acquire_lease(CONV, "a", SHORT_S)).acquired
    result = await store.acquire_lease(CONV, "a", LONG_S)
    assert result.acquired and result.holder == "a"
    await asyncio.sleep(SHORT_S * 3)
    assert await store.get_lease_holder(CONV) == "a", "re-acquiring refreshes the TTL"


async def test_renew_only_by_the_holder(store: RuntimeStore) -> None:
    await store.acquire_lease(CONV, "a", 0.5)
    assert not await store.renew_lease(CONV, "b", LONG_S)
    assert await store.renew_lease(CONV, "a", LONG_S)
    await asyncio.sleep(0.6)
    assert await store.get_lease_holder(CONV) == "a", "renewal extended the lease"
    assert not await store.renew_lease("conv-unknown", "a", LONG_S)


async def test_release_only_by_the_holder(store: RuntimeStore) -> None:
    await store.acquire_lease(CONV, "a", LONG_S)
    assert not await store.release_lease(CONV, "b")
    assert await store.get_lease_holder(CONV) == "a"
    assert await store.release_lease(CONV, "a")
    assert await store.get_lease_holder(CONV) is None
    assert not await store.release_lease(CONV, "a")
    assert not await store.renew_lease(CONV, "a", LONG_S)
    assert await store.acquire_lease(CONV, "b", LONG_S) == (True, "b")


async def test_lease_expires_after_its_ttl(store: RuntimeStore) -> None:
    await store.acquire_lease(CONV, "a", SHORT_S)

    async def is_free() -> bool:
        return await store.get_lease_holder(CONV) is None

    await wait_for(is_free, timeout_s=5, message="the lease to expire")
    assert not await store.renew_lease(CONV, "a", LONG_S), "an expired lease cannot be renewed"
    assert await store.acquire_lease(CONV, "b", LONG_S) == (True, "b")
    assert not await store.release_lease(CONV, "a")


async def test_concurrent_acquirers_get_one_holder(store: RuntimeStore) -> None:
    results = await asyncio.gather(*(store.acquire_lease(CONV, f"h{i}", LONG_S) for i in range(50)))
    winners = [result.holder for result in results if result.acquired]
    assert len(winners) == 1
    assert {result.holder for result in results} == {winners[0]}


# -- interactive window ----------------------------------------------------------------------


async def test_interactive_window(store: RuntimeStore) -> None:
    assert await store.get_interactive_run(CONV) is None
    assert not await store.is_interactive(CONV, RUN)
    await store.mark_interactive(CONV, RUN, LONG_S)
    assert await store.get_interactive_run(CONV) == RUN
    assert await store.is_interactive(CONV, RUN)
    assert not await store.is_interactive(CONV, OTHER_RUN)
    assert not await store.clear_interactive(CONV, OTHER_RUN)
    assert await store.is_interactive(CONV, RUN)
    assert await store.clear_interactive(CONV, RUN)
    assert await store.get_interactive_run(CONV) is None
    assert not await store.clear_interactive(CONV, RUN)


async def test_interactive_windows_change_many_at_once_in_order(store: RuntimeStore) -> None:
    # On a Cluster the windows' keys fall in different slots, so one pipeline reaches several
    # nodes.
    runs = [(f"conv-{index}", RunId(f"run-{index}")) for index in range(20)]
    opens = [WindowChange(key, run, opens=True) for key, run in runs]
    assert await store.change_windows(opens, LONG_S) == [True] * 20
    assert [await store.get_interactive_run(key) for key, _ in runs] == [run for _, run in runs]
    someone_else = [WindowChange(key, RunId("someone-else"), opens=False) for key, _ in runs[:5]]
    assert await store.change_windows(someone_else, LONG_S) == [False] * 5
    closes = [WindowChange(key, run, opens=False) for key, run in runs]
    assert await store.change_windows(closes[:10], LONG_S) == [True] * 10
    assert await store.change_windows(closes, LONG_S) == [False] * 10 + [True] * 10
    assert [await store.get_interactive_run(key) for key, _ in runs] == [None] * 20
    # In the order given: closed, opened, closed again, opened again.
    again = [opens[0], closes[0], closes[0], opens[0]]
    assert await store.change_windows(again, LONG_S) == [True, True, False, True]
    assert await store.get_interactive_run(runs[0][0]) == runs[0][1]
    assert await store.change_windows([opens[0], closes[0]], LONG_S) == [True, True]
    assert await store.get_interactive_run(runs[0][0]) is None
    assert await store.change_windows(opens[:1], SHORT_S) == [True]

    async def is_closed() -> bool:
        return await store.get_interactive_run(runs[0][0]) is None

    await wait_for(is_closed, timeout_s=5, message="the window to expire")


async def test_interactive_window_expires_and_marking_extends_it(store: RuntimeStore) -> None:
    await store.mark_interactive(CONV, RUN, SHORT_S)
    await store.mark_interactive(CONV, RUN, LONG_S)
    await asyncio.sleep(SHORT_S * 3)
    assert await store.is_interactive(CONV, RUN)
    await store.mark_interactive(CONV, RUN, SHORT_S)

    async def is_closed() -> bool:
        return await store.get_interactive_run(CONV) is None

    await wait_for(is_closed, timeout_s=5, message="the window to expire")


# -- interrupts ------------------------------------------------------------------------------


async def test_first_decision_wins(store: RuntimeStore) -> None:
    await store.open_interrupt(RUN, "i1", LONG_S)
    assert await store.get_interrupt(RUN, "i1") == InterruptState(
        status=InterruptStatus.PENDING, decision=None
    )
    assert await store.resolve_interrupt(RUN, "i1", APPROVE)
    assert await store.resolve_interrupt(RUN, "i1", dict(reversed(APPROVE.items()))), (
        "the same decision again is an idempotent success, whatever the key order"
    )
    assert not await store.resolve_interrupt(RUN, "i1", DENY), "a conflicting decision"
    assert await store.get_interrupt(RUN, "i1") == InterruptState(
        status=InterruptStatus.RESOLVED, decision=APPROVE
    )
    assert await store.wait_interrupt(RUN, "i1", LONG_S) == APPROVE


async def test_unknown_interrupt(store: RuntimeStore) -> None:
    assert not await store.resolve_interrupt(RUN, "nope", APPROVE)
    assert await store.get_interrupt(RUN, "nope") is None
    assert await store.wait_interrupt(RUN, "nope", LONG_S) is None


async def test_reopening_keeps_the_decision(store: RuntimeStore) -> None:
    await store.open_interrupt(RUN, "i1", LONG_S)
    await store.resolve_interrupt(RUN, "i1", DENY)
    await store.open_interrupt(RUN, "i1", LONG_S)
    assert await store.wait_interrupt(RUN, "i1", LONG_S) == DENY


async def test_waiter_wakes_with_the_decision(store: RuntimeStore) -> None:
    await store.open_interrupt(RUN, "i1", LONG_S)
    await store.open_interrupt(RUN, "i2", LONG_S)
    first = asyncio.create_task(store.wait_interrupt(RUN, "i1", LONG_S))
    second = asyncio.create_task(store.wait_interrupt(RUN, "i2", LONG_S))
    await until_waiting(first)
    resolved_at = time.monotonic()
    assert await store.resolve_interrupt(RUN, "i1", APPROVE)
    assert await asyncio.wait_for(first, 5) == APPROVE
    assert time.monotonic() - resolved_at < 0.4, "woken by the signal, not by polling"
    assert not second.done(), "another interrupt of the run keeps waiting"
    assert await store.resolve_interrupt(RUN, "i2", DENY)
    assert await asyncio.wait_for(second, 5) == DENY


async def test_wait_times_out_with_none(store: RuntimeStore) -> None:
    await store.open_interrupt(RUN, "i1", LONG_S)
    began = time.monotonic()
    assert await store.wait_interrupt(RUN, "i1", 0.3) is None
    assert 0.29 <= time.monotonic() - began < 2.0
    assert (await store.get_interrupt(RUN, "i1")) == InterruptState(
        status=InterruptStatus.PENDING, decision=None
    )


async def test_interrupt_expires_after_its_ttl(store: RuntimeStore) -> None:
    await store.open_interrupt(RUN, "i1", 0.3)
    began = time.monotonic()
    assert await store.wait_interrupt(RUN, "i1", LONG_S) is None, "gone while waiting"
    assert time.monotonic() - began < 5.0
    assert await store.get_interrupt(RUN, "i1") is None
    assert not await store.resolve_interrupt(RUN, "i1", APPROVE)


async def test_cancel_denies_a_pending_interrupt(store: RuntimeStore) -> None:
    await store.open_interrupt(RUN, "i1", LONG_S)
    waiter = asyncio.create_task(store.wait_interrupt(RUN, "i1", LONG_S))
    await until_waiting(waiter)
    await store.request_cancel(RUN)
    assert await asyncio.wait_for(waiter, 5) == CANCELLED_DECISION
    assert not await store.resolve_interrupt(RUN, "i1", APPROVE), "the cancel decided first"
    assert await store.wait_interrupt(RUN, "i1", LONG_S) == CANCELLED_DECISION


async def test_cancel_before_the_wait_and_after_the_decision(store: RuntimeStore) -> None:
    await store.open_interrupt(RUN, "i1", LONG_S)
    await store.open_interrupt(RUN, "i2", LONG_S)
    await store.resolve_interrupt(RUN, "i2", APPROVE)
    await store.request_cancel(RUN)
    assert await store.wait_interrupt(RUN, "i1", LONG_S) == CANCELLED_DECISION
    assert await store.wait_interrupt(RUN, "i2", LONG_S) == APPROVE, "decided before the cancel"


async def test_cleanup_ends_interrupt_waits(store: RuntimeStore) -> None:
    await store.open_interrupt(RUN, "i1", LONG_S)
    waiter = asyncio.create_task(store.wait_interrupt(RUN, "i1", LONG_S))
    await until_waiting(waiter)
    await store.cleanup_run(RUN)
    assert await asyncio.wait_for(waiter, 5) is None


# -- cancellation ----------------------------------------------------------------------------


async def test_cancel_flag(store: RuntimeStore) -> None:
    assert not await store.is_cancelled(RUN)
    await store.request_cancel(RUN)
    await store.request_cancel(RUN)
    assert await store.is_cancelled(RUN)
    assert not await store.is_cancelled(OTHER_RUN)
    assert await store.wait_cancelled(RUN, LONG_S)


async def test_cancel_wakes_wait_cancelled(store: RuntimeStore) -> None:
    waiter = asyncio.create_task(store.wait_cancelled(RUN, LONG_S))
    other = asyncio.create_task(store.wait_cancelled(OTHER_RUN, LONG_S))
    await until_waiting(waiter)
    cancelled_at = time.monotonic()
    await store.request_cancel(RUN)
    assert await asyncio.wait_for(waiter, 5) is True
    assert time.monotonic() - cancelled_at < 0.4, "woken by the signal, not by polling"
    assert not other.done()
    other.cancel()
    with pytest.raises(asyncio.CancelledError):
        await other


async def test_wait_cancelled_times_out_false(store: RuntimeStore) -> None:
    began = time.monotonic()
    assert await store.wait_cancelled(RUN, 0.3) is False
    assert 0.29 <= time.monotonic() - began < 2.0


# -- injected messages -----------------------------------------------------------------------


async def test_drain_is_in_seq_order_and_takes_everything(store: RuntimeStore) -> None:
    assert await store.drain_messages(RUN) == []
    # Concurrent posters may signal out of order; the queue orders by seq.
    for seq, text in ((2, "two"), (1, "one"), (3, "three")):
        await store.push_message(RUN, seq, text)
    await store.push_message(OTHER_RUN, 1, "elsewhere")
    assert await store.drain_messages(RUN) == [(1, "one"), (2, "two"), (3, "three")]
    assert await store.drain_messages(RUN) == []
    await store.push_message(RUN, 4, "four")
    assert await store.drain_messages(RUN) == [QueuedMessage(4, "four")]
    assert await store.drain_messages(OTHER_RUN) == [QueuedMessage(1, "elsewhere")]


async def test_a_retried_push_queues_the_message_once(store: RuntimeStore) -> None:
    await store.push_message(RUN, 1, "hello")
    # The same push again, as a client retrying after its first reply was lost.
    await store.push_message(RUN, 1, "hello")
    await store.push_message(RUN, 2, "world")
    await store.push_message(RUN, 2, "world")
    assert await store.drain_messages(RUN) == [(1, "hello"), (2, "world")]


async def test_concurrent_drains_lose_and_repeat_nothing(store: RuntimeStore) -> None:
    sent = list(range(1, 301))
    drained: list[list[QueuedMessage]] = []

    async def push_all() -> None:
        for seq in sent:
            await store.push_message(RUN, seq, f"m{seq}")

    async def drain_often() -> None:
        for _ in range(100):
            drained.append(await store.drain_messages(RUN))
            await asyncio.sleep(0)

    await asyncio.gather(push_all(), drain_often(), drain_often())
    drained.append(await store.drain_messages(RUN))
    received = [message.seq for batch in drained for message in batch]
    assert sorted(received) == sent
    for batch in drained:
        assert batch == sorted(batch), "each batch is in seq order"
        assert all(message.text == f"m{message.seq}" for message in batch)


async def test_a_full_message_queue_refuses_more(store: RuntimeStore) -> None:
    for seq in range(1, MAX_MESSAGES + 1):
        await store.push_message(RUN, seq, f"m{seq}")
    with pytest.raises(LimitExceeded):
        await store.push_message(RUN, MAX_MESSAGES + 1, "one too many")
    # A retried push of a message already queued is no new message: no refusal.
    await store.push_message(RUN, 1, "m1")
    drained = await store.drain_messages(RUN)
    assert drained == [(seq, f"m{seq}") for seq in range(1, MAX_MESSAGES + 1)]
    await store.push_message(RUN, MAX_MESSAGES + 1, "room again")
    assert await store.drain_messages(RUN) == [(MAX_MESSAGES + 1, "room again")]


# -- live events -----------------------------------------------------------------------------


def batch_of(seqs: range) -> list[JSONObject]:
    return [{"seq": seq, "type": "delta", "data": {"i": seq}} for seq in seqs]


async def test_subscribers_get_batches_whole_and_in_order(store: RuntimeStore) -> None:
    first = await store.subscribe_events(RUN)
    second = await store.subscribe_events(RUN)
    elsewhere = await store.subscribe_events(OTHER_RUN)
    batches = [batch_of(range(1, 4)), batch_of(range(4, 5)), batch_of(range(5, 21))]
    for batch in batches:
        await store.publish_events(RUN, batch)
    expected = [event for batch in batches for event in batch]
    received = [await asyncio.wait_for(anext(first), 5) for _ in expected]
    assert received == expected
    taken: list[JSONObject] = []
    while len(taken) < len(expected):
        taken += await asyncio.wait_for(second.take(), 5)
    assert taken == expected
    assert second.last_seq == 20
    await store.publish_events(OTHER_RUN, [{"seq": 1}])
    assert await asyncio.wait_for(anext(elsewhere), 5) == {"seq": 1}
    for subscription in (first, second, elsewhere):
        await subscription.close()
        assert not subscription.is_dropped
    await store.publish_events(RUN, [{"seq": 99}])
    assert [event async for event in first] == []
    assert await first.take() == []


async def test_closing_a_subscription_ends_iteration(store: RuntimeStore) -> None:
    async with await store.subscribe_events(RUN) as subscription:
        reader = asyncio.create_task(anext(subscription))
        await asyncio.wait((reader,), timeout=0.05)
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(reader, 5)


async def test_a_slow_subscriber_is_cut_off_with_its_last_seq(store: RuntimeStore) -> None:
    slow = await store.subscribe_events(RUN)
    keeping_up = await store.subscribe_events(RUN)
    await store.publish_events(RUN, batch_of(range(1, 11)))
    assert [(await asyncio.wait_for(anext(slow), 5))["seq"] for _ in range(5)] == [1, 2, 3, 4, 5]
    # The slow one stops reading; the publisher goes on without waiting for it.
    received: list[JSONObject] = []
    for start in range(11, 1111, 100):
        await store.publish_events(RUN, batch_of(range(start, start + 100)))
        received += await asyncio.wait_for(keeping_up.take(), 5)

    async def is_cut_off() -> bool:
        return slow.is_dropped

    await wait_for(is_cut_off, timeout_s=10, message="the slow subscriber to be cut off")
    assert slow.last_seq == 5, "it resumes from the database after the last event it took"
    assert [event async for event in slow] == []
    assert [event["seq"] for event in received] == list(range(1, 1111))
    assert not keeping_up.is_dropped
    await slow.close()
    await keeping_up.close()


# -- cleanup and shutdown --------------------------------------------------------------------


async def test_cleanup_run_deletes_its_state_only(store: RuntimeStore) -> None:
    for run in (RUN, OTHER_RUN):
        await store.open_interrupt(run, "i1", LONG_S)
        await store.request_cancel(run)
        await store.push_message(run, 1, "hello")
    await store.acquire_lease(CONV, RUN, LONG_S)
    await store.cleanup_run(RUN)
    assert await store.get_interrupt(RUN, "i1") is None
    assert not await store.is_cancelled(RUN)
    assert await store.drain_messages(RUN) == []
    assert await store.get_interrupt(OTHER_RUN, "i1") is not None
    assert await store.is_cancelled(OTHER_RUN)
    assert await store.drain_messages(OTHER_RUN) == [(1, "hello")]
    assert await store.get_lease_holder(CONV) == RUN, "leases are released, not cleaned up"
    await store.cleanup_run(RunId("never-seen"))


async def test_shutdown_ends_every_wait(store: RuntimeStore) -> None:
    await store.open_interrupt(RUN, "i1", LONG_S)
    interrupt_wait = asyncio.create_task(store.wait_interrupt(RUN, "i1", LONG_S))
    cancel_wait = asyncio.create_task(store.wait_cancelled(OTHER_RUN, LONG_S))
    subscription = await store.subscribe_events(RUN)
    await until_waiting(interrupt_wait)
    await until_waiting(cancel_wait)
    began = time.monotonic()
    await store.shutdown()
    for task in (interrupt_wait, cancel_wait):
        with pytest.raises(StoreShutdown):
            await asyncio.wait_for(task, 5)
    assert time.monotonic() - began < 1.0
    assert [event async for event in subscription] == []
    with pytest.raises(StoreShutdown):
        await store.wait_interrupt(RUN, "i1", LONG_S)
    with pytest.raises(StoreShutdown):
        await store.wait_cancelled(RUN, LONG_S)
    late = await store.subscribe_events(RUN)
    assert [event async for event in late] == []
    # The rest keeps working, so the process can record how its runs ended.
    assert await store.resolve_interrupt(RUN, "i1", APPROVE)
    assert await store.acquire_lease(CONV, "a", LONG_S) == (True, "a")
    await store.cleanup_run(RUN)


async def test_shutdown_does_not_swallow_cancellation(store: RuntimeStore) -> None:
    waiter = asyncio.create_task(store.wait_cancelled(RUN, LONG_S))
    await until_waiting(waiter)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await store.shutdown()


# -- factory ---------------------------------------------------------------------------------


async def test_factory_picks_the_backend() -> None:
    memory = make_runtime_store(Settings(redis_url=None))
    assert isinstance(memory, InMemoryRuntimeStore)
    await memory.close()
    redis = make_runtime_store(
        Settings(redis_url="redis://127.0.0.1:6379/0", redis_prefix="custom")
    )
    assert isinstance(redis, RedisRuntimeStore)
    assert redis.keys.lease("c") == "custom:{conv:c}:lease"
    await redis.close()
