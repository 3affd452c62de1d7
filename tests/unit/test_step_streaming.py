"""Generator steps' streaming, without a database: deltas, joining, and stopping the producer.

The sink here is a list (or an event that never comes, to play a consumer that stopped); the
bridge, its thread and the generators are real. "No thread left blocked" is checked the only
way that proves it: the producer thread is gone and the generator's ``finally`` has run.
"""

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from moorline.engine.steps import call_step_function, to_json
from moorline.engine.streaming import StepStream, delta_data, join_items
from moorline.types import JSONObject, JSONValue
from tests.helpers import wait_for

QUEUE = 4
"""Items a producer may run ahead in these tests: small, so the queue fills at once."""


class Stopped(BaseException):
    """What the stop check raises (a ``BaseException``, as ``Cancelled`` and ``LeaseLost``)."""


class Sink:
    """Collects the deltas; ``stop_after`` items later the stop check raises."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.events: list[tuple[str, JSONObject]] = []
        self.stop_after = stop_after

    async def send(self, event_type: str, data: JSONObject) -> None:
        self.events.append((event_type, data))

    def check(self) -> None:
        if self.stop_after is not None and len(self.events) >= self.stop_after:
            raise Stopped

    def stream(self, key: str = "gen") -> Callable[[], StepStream]:
        return lambda: StepStream(
            key, send=self.send, check=self.check, to_json=to_json, max_queued=QUEUE
        )


class Endless:
    """A sync generator function that never ends, recording where it runs and its close."""

    def __init__(self) -> None:
        self.produced = 0
        self.closed = threading.Event()
        self.threads: set[str] = set()

    def __call__(self, prefix: str) -> Iterator[str]:
        try:
            while True:
                self.threads.add(threading.current_thread().name)
                self.produced += 1
                yield f"{prefix}{self.produced} "
        finally:
            self.closed.set()

    def thread_alive(self) -> bool:
        return any(t.name in self.threads and t.is_alive() for t in threading.enumerate())


async def ended(endless: Endless) -> None:
    async def gone() -> bool:
        return endless.closed.is_set() and not endless.thread_alive()

    await wait_for(gone, timeout_s=5, message="the producer thread to end and close its generator")


def test_joined_means_strings_concatenated_else_the_list() -> None:
    assert join_items(["Hel", "lo", ""]) == "Hello"
    assert join_items([]) == ""
    assert join_items(["a", 1]) == ["a", 1]
    assert join_items([{"x": 1}, [2]]) == [{"x": 1}, [2]]
    assert delta_data("k", "hi") == {"step": "k", "text": "hi"}
    assert delta_data("k", {"n": 1}) == {"step": "k", "item": {"n": 1}}


async def test_a_sync_generator_streams_from_its_own_thread_and_joins_the_text() -> None:
    seen: set[str] = set()

    def chunks(words: list[str]) -> Iterator[str]:
        for word in words:
            seen.add(threading.current_thread().name)
            yield word

    sink = Sink()
    result = await call_step_function(chunks, [["a", "b", "c"]], {}, sink.stream("llm"))
    assert result == "abc"
    assert sink.events == [("delta", {"step": "llm", "text": t}) for t in "abc"]
    assert seen == {"moorline-step:llm"}


async def test_an_async_generator_streams_on_the_loop_and_joins_a_list() -> None:
    async def numbers(n: int) -> AsyncIterator[JSONValue]:
        for i in range(n):
            yield {"i": i}

    sink = Sink()
    result = await call_step_function(numbers, [3], {}, sink.stream())
    assert result == [{"i": 0}, {"i": 1}, {"i": 2}]
    expected = [{"step": "gen", "item": {"i": i}} for i in range(3)]
    assert [data for _, data in sink.events] == expected


async def test_a_function_returning_a_generator_is_streamed_but_a_list_is_not() -> None:
    def returns_generator() -> Iterator[str]:
        return iter_words()

    def iter_words() -> Iterator[str]:
        yield "x"
        yield "y"

    sink = Sink()
    assert await call_step_function(returns_generator, [], {}, sink.stream()) == "xy"
    assert await call_step_function(lambda: ["x", "y"], [], {}, Sink().stream()) == ["x", "y"]
    assert len(sink.events) == 2


async def test_a_generators_error_comes_after_its_items_and_ends_the_thread() -> None:
    def failing() -> Iterator[str]:
        yield "one"
        raise ConnectionError("the stream broke")

    sink = Sink()
    with pytest.raises(ConnectionError, match="the stream broke"):
        await call_step_function(failing, [], {}, sink.stream())
    assert [data for _, data in sink.events] == [{"step": "gen", "text": "one"}]


async def test_an_item_that_is_not_json_fails_with_type_error_and_stops_the_producer() -> None:
    endless = Endless()

    def objects() -> Iterator[object]:
        yield "fine"
        yield object()
        yield from endless("never ")

    with pytest.raises(TypeError, match="item 2 of step 'gen'"):
        await call_step_function(objects, [], {}, Sink().stream())
    assert endless.produced <= QUEUE + 1


async def test_a_stop_check_ends_the_stream_and_releases_a_producer_on_a_full_queue() -> None:
    endless = Endless()
    sink = Sink(stop_after=3)
    with pytest.raises(Stopped):
        await call_step_function(endless, ["x"], {}, sink.stream())
    await ended(endless)
    assert len(sink.events) == 3
    # It ran ahead by the queue at most, then waited: it was not left blocked there.
    assert endless.produced <= 3 + QUEUE + 2


async def test_cancelling_a_stalled_consumer_leaves_no_producer_thread_blocked() -> None:
    endless = Endless()
    never = asyncio.Event()

    async def stalled(event_type: str, data: JSONObject) -> None:
        await never.wait()  # a database that stopped answering

    stream = StepStream("gen", send=stalled, check=lambda: None, to_json=to_json, max_queued=QUEUE)
    task = asyncio.create_task(call_step_function(endless, ["x"], {}, lambda: stream))

    async def queue_full() -> bool:
        return endless.produced >= QUEUE + 1

    await wait_for(queue_full, message="the producer to fill the queue")
    assert endless.thread_alive()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await ended(endless)
    assert endless.produced <= QUEUE + 2
