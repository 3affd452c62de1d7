"""Server-Sent Events, parsed from the lines of a response (async or not)."""

import json
from collections.abc import AsyncIterator, Iterable, Iterator

from moorline.client.results import Event
from moorline.types import JSONValue


class SseParser:
    """The SSE grammar, fed a line at a time, so both clients' streams share it.

    Written here rather than taken from ``httpx-sse``, which is not a dependency: the server
    sends only ``id``/``event``/``data`` fields and comment pings, so the part of the SSE
    grammar needed is a few lines. Comments (``:``) and ``retry`` are skipped; an event
    without an id (none is sent) is skipped too, since it could not be resumed after.
    """

    def __init__(self) -> None:
        self._fields: dict[str, list[str]] = {}

    def feed(self, raw: str) -> Event | None:
        """Take one line; the event it completes, if any."""
        line = raw.rstrip("\r\n")
        if not line:
            event = _event_of(self._fields)
            self._fields = {}
            return event
        if not line.startswith(":"):
            name, _, value = line.partition(":")
            self._fields.setdefault(name, []).append(value.removeprefix(" "))
        return None

    def finish(self) -> Event | None:
        """The event the stream's last lines made, when it closed without a blank line."""
        event = _event_of(self._fields)
        self._fields = {}
        return event


async def parse_sse(lines: AsyncIterator[str]) -> AsyncIterator[Event]:
    """The events of an SSE stream, from its lines."""
    parser = SseParser()
    async for raw in lines:
        event = parser.feed(raw)
        if event is not None:
            yield event
    last = parser.finish()
    if last is not None:
        yield last


def parse_sse_sync(lines: Iterable[str]) -> Iterator[Event]:
    """:func:`parse_sse` for a synchronous stream's lines."""
    parser = SseParser()
    for raw in lines:
        event = parser.feed(raw)
        if event is not None:
            yield event
    last = parser.finish()
    if last is not None:
        yield last


def _event_of(fields: dict[str, list[str]]) -> Event | None:
    ids, data = fields.get("id"), fields.get("data")
    if not ids or data is None or not ids[-1].isdigit():
        return None
    text = "\n".join(data)
    try:
        payload: JSONValue = json.loads(text)
    except ValueError:
        payload = text
    return Event(seq=int(ids[-1]), type=(fields.get("event") or ["message"])[-1], data=payload)
