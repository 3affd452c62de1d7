"""Interactive windows change in shared round trips (moorline/engine/windows.py)."""

import asyncio

import pytest

from moorline.coalescer import Coalescer
from moorline.engine.windows import Windows
from moorline.errors import BackendUnavailable
from moorline.runtime.base import WindowChange
from moorline.types import RunId
from tests.engine.harness import CountingStore


class Recorder:
    """A batch sender that records its batches; each waits for ``gate`` when one is set."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.gate: asyncio.Event | None = None
        self.failure: Exception | None = None
        self.sending = asyncio.Event()

    async def send(self, items: list[str]) -> list[str]:
        self.batches.append(items)
        self.sending.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.failure is not None:
            raise self.failure
        return [item.upper() for item in items]


async def test_the_items_of_one_turn_go_in_one_batch() -> None:
    recorder = Recorder()
    coalescer = Coalescer(recorder.send, name="test")
    assert await asyncio.gather(*(coalescer(f"w{index}") for index in range(8))) == [
        f"W{index}" for index in range(8)
    ]
    assert recorder.batches == [[f"w{index}" for index in range(8)]]


async def test_the_items_asked_for_during_a_flight_go_in_the_next_batch() -> None:
    recorder = Recorder()
    recorder.gate = asyncio.Event()
    coalescer = Coalescer(recorder.send, name="test")
    first = asyncio.create_task(coalescer("a"))
    await recorder.sending.wait()
    rest = [asyncio.create_task(coalescer(item)) for item in "bcd"]
    await asyncio.sleep(0.01)
    assert recorder.batches == [["a"]]  # one batch in flight at a time
    recorder.gate.set()
    assert await first == "A"
    assert await asyncio.gather(*rest) == ["B", "C", "D"]
    assert recorder.batches == [["a"], ["b", "c", "d"]]


async def test_a_failed_batch_fails_its_callers_and_the_next_is_sent() -> None:
    recorder = Recorder()
    recorder.failure = BackendUnavailable("down")
    coalescer = Coalescer(recorder.send, name="test")
    results = await asyncio.gather(coalescer("a"), coalescer("b"), return_exceptions=True)
    assert [type(result) for result in results] == [BackendUnavailable, BackendUnavailable]
    recorder.failure = None
    assert await coalescer("c") == "C"


async def test_a_caller_that_stops_waiting_leaves_the_others_their_answers() -> None:
    recorder = Recorder()
    recorder.gate = asyncio.Event()
    coalescer = Coalescer(recorder.send, name="test")
    impatient = asyncio.create_task(coalescer("a"))
    patient = asyncio.create_task(coalescer("b"))
    await recorder.sending.wait()
    impatient.cancel()
    recorder.gate.set()
    assert await patient == "B"
    assert impatient.cancelled()
    assert await coalescer("c") == "C"


async def test_a_cancelled_sender_cancels_the_callers_waiting_on_it() -> None:
    recorder = Recorder()
    recorder.gate = asyncio.Event()
    coalescer = Coalescer(recorder.send, name="test")
    caller = asyncio.create_task(coalescer("a"))
    await recorder.sending.wait()
    senders = [task for task in asyncio.all_tasks() if task.get_name() == "test"]
    assert len(senders) == 1
    senders[0].cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller


async def test_an_item_withdrawn_before_its_batch_is_taken_is_never_sent() -> None:
    recorder = Recorder()
    recorder.gate = asyncio.Event()
    coalescer = Coalescer(recorder.send, name="test")
    flying = coalescer.submit("a")
    await recorder.sending.wait()
    queued, kept = coalescer.submit("b"), coalescer.submit("c")
    assert not coalescer.withdraw(flying), "a batch has taken it"
    assert coalescer.withdraw(queued)
    assert queued.cancelled()
    assert not coalescer.withdraw(queued), "withdrawn once"
    recorder.gate.set()
    assert await flying == "A"
    assert await kept == "C"
    assert recorder.batches == [["a"], ["c"]]


async def test_windows_opened_and_closed_together_share_a_store_call() -> None:
    store = CountingStore()
    windows = Windows(store, ttl_s=30.0, timeout_s=5.0)
    runs = [RunId(f"run-{index}") for index in range(8)]
    await asyncio.gather(*(windows.open(run, run) for run in runs))
    assert [len(batch) for batch in store.batches] == [8]
    assert [await store.get_interactive_run(run) for run in runs] == runs
    assert await asyncio.gather(*(windows.close(run, run) for run in runs)) == [True] * 8
    assert [len(batch) for batch in store.batches] == [8, 8]
    assert [await store.get_interactive_run(run) for run in runs] == [None] * 8
    await store.close()


async def test_a_close_asked_for_after_an_open_is_applied_after_it() -> None:
    # The heartbeat re-opens a window while the workflow returns: the close must win.
    store = CountingStore()
    windows = Windows(store, ttl_s=30.0, timeout_s=5.0)
    run = RunId("run-1")
    await windows.open("c1", run)
    renewal = asyncio.create_task(windows.open("c1", run))
    closing = asyncio.create_task(windows.close("c1", run))
    await asyncio.gather(renewal, closing)
    assert store.batches[-1] == [
        WindowChange("c1", run, opens=True),
        WindowChange("c1", run, opens=False),
    ]
    assert await store.get_interactive_run("c1") is None
    await store.close()


async def test_a_hung_batch_counts_as_an_unreachable_store_and_the_next_is_sent() -> None:
    store = CountingStore()
    windows = Windows(store, ttl_s=30.0, timeout_s=0.2)
    store.gate = asyncio.Event()  # never set
    with pytest.raises(BackendUnavailable, match=r"did not answer within 0\.2 s"):
        await asyncio.wait_for(windows.open("c1", RunId("run-1")), 5)
    store.gate = None
    await asyncio.wait_for(windows.open("c1", RunId("run-1")), 5)
    assert await store.get_interactive_run("c1") == "run-1"
    await store.close()


async def test_an_open_withdrawn_before_it_is_sent_leaves_the_store_untouched() -> None:
    store = CountingStore()
    windows = Windows(store, ttl_s=30.0, timeout_s=5.0)
    opening = windows.begin("c1", RunId("run-1"))
    assert windows.withdraw(opening)
    # A begun open the loop got to send is in the store, and can no longer be withdrawn.
    sent = windows.begin("c2", RunId("run-2"))
    assert await sent is True
    assert not windows.withdraw(sent)
    assert store.batches == [[WindowChange("c2", RunId("run-2"), opens=True)]]
    assert await store.get_interactive_run("c1") is None
    assert await store.get_interactive_run("c2") == "run-2"
    await store.close()
