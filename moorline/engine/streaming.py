"""Generator steps: a step whose function yields streams each item as a ``delta`` event.

``ctx.step(key, fn, ...)`` with a generator function (``def`` with ``yield``, run in a thread of
its own) or an async generator function (``async def`` with ``yield``, run on the loop) streams
what it yields. Each item is sent live as a ``delta`` event of the run and the items, *joined*,
are the step's result, checkpointed like any other:

- every item a string: the strings concatenated (an LLM's text chunks give the whole text);
- no item at all: ``""`` (iterable, empty and false, like an empty list);
- otherwise: the list of the items, in order.

A ``delta`` of a generator step is ``{"step": key, "text": item}`` for a string item and
``{"step": key, "item": item}`` for any other JSON value; each item must be JSON on its own.
A generator's ``return`` value is ignored: the result is what it yielded. A replay returns the
checkpointed result without calling the function again, so its deltas are not sent twice; a
step that fails after some items and is tried again streams them again after a new
``step_started``.

A sync generator runs in a producer thread behind a :class:`~moorline.concurrency.ThreadBridge`
(seed 002's thread bridge): it runs at most ``max_queued`` items ahead of the deltas the attempt
has taken and waits there, so a slow database slows the generator instead of filling memory.
Before each item the attempt's stop check runs (a cancel the runner has seen, a lost lease): it
raises into the step, and leaving the bridge stops the producer and gives it room, so a thread
blocked on the full queue always wakes and ends, and the generator is closed in its own thread
(its ``finally`` runs there). A thread blocked inside the generator (a network read) ends when
that call returns; nothing it yields afterwards is taken.
"""

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, Final

from moorline.concurrency import DEFAULT_BRIDGE_QUEUE, ThreadBridge
from moorline.engine.events import EVENT_DELTA
from moorline.types import JSONObject, JSONValue

EMPTY_STREAM: Final[JSONValue] = ""
"""The joined result of a generator step that yielded nothing."""

SendDelta = Callable[[str, JSONObject], Awaitable[None]]
"""Buffers one event of the attempt (``EventWriter.add``)."""


def is_generator_function(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` (or the function a ``functools.partial`` wraps) yields."""
    return inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn)


def is_stream(value: object) -> bool:
    """Whether ``value`` is a generator or an async generator to stream (not any iterable)."""
    return inspect.isgenerator(value) or inspect.isasyncgen(value)


def join_items(items: list[JSONValue]) -> JSONValue:
    """The result of a generator step: strings concatenated, else the list (see the module)."""
    if not items:
        return EMPTY_STREAM
    if all(isinstance(item, str) for item in items):
        return "".join(item for item in items if isinstance(item, str))
    return items


def delta_data(key: str, item: JSONValue) -> JSONObject:
    """The data of the ``delta`` event that streams ``item`` of step ``key``."""
    if isinstance(item, str):
        return {"step": key, "text": item}
    return {"step": key, "item": item}


class StepStream:
    """Streams the items of one try of one generator step and joins them.

    Args:
        key: The step's key, named by every delta.
        send: Buffers an event of the attempt (its batches and backpressure apply).
        check: Raises when the attempt must stop (cancel seen, lease lost); called before
            each item is sent.
        to_json: Turns an item into the JSON it is sent and stored as; raises ``TypeError``
            for an item that is not JSON.
        max_queued: Items a sync generator's thread may run ahead of the deltas sent.
    """

    def __init__(
        self,
        key: str,
        *,
        send: SendDelta,
        check: Callable[[], None],
        to_json: Callable[[object, str], JSONValue],
        max_queued: int = DEFAULT_BRIDGE_QUEUE,
    ) -> None:
        self._key = key
        self._send = send
        self._check = check
        self._to_json = to_json
        self._max_queued = max_queued
        self.items = 0
        """Items sent so far."""

    async def consume(self, stream: object) -> JSONValue:
        """Send every item of ``stream`` (a generator or async generator); return them joined.

        Raises:
            TypeError: An item is not JSON, or ``stream`` is no generator.
            Exception: Whatever the generator raised, after the items it yielded before.
        """
        items: list[JSONValue] = []
        if inspect.isasyncgen(stream):
            async with aclosing(stream) as chunks:
                await self._send_all(chunks, items)
        elif inspect.isgenerator(stream):
            # The thread's name carries the step key: a stuck generator is easy to find.
            name = f"moorline-step:{self._key}"
            async with ThreadBridge[object](
                stream, max_queued=self._max_queued, name=name
            ) as chunks:
                await self._send_all(chunks, items)
        else:
            raise TypeError(f"step {self._key!r}: {type(stream).__name__} is no generator")
        return join_items(items)

    async def _send_all(self, chunks: AsyncIterator[object], items: list[JSONValue]) -> None:
        async for chunk in chunks:
            self._check()
            item = self._to_json(chunk, f"item {len(items) + 1} of step {self._key!r}")
            await self._send(EVENT_DELTA, delta_data(self._key, item))
            items.append(item)
            self.items += 1
