"""Server-Sent Events, parsed from the lines of a response."""

import json
from collections.abc import AsyncIterator

from moorline.client.results import Event
from moorline.types import JSONValue


async def parse_sse(lines: AsyncIterator[str]) -> AsyncIterator[Event]:
    """The events of an SSE stream, from its lines.

    Written here rather than taken from ``httpx-sse``, which is not a dependency: the server
    sends only ``id``/``event``/``data`` fields and comment pings, so the part of the SSE
    grammar needed is a few lines. Comments (``:``) and ``retry`` are skipped; an event
    without an id (none is sent) is skipped too, since it could not be resumed after.
    """
    fields: dict[str, list[str]] = {}
    async for raw in lines:
        line = raw.rstrip("\r\n")
        if not line:
            event = _event_of(fields)
            fields = {}
            if event is not None:
                yield event
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        fields.setdefault(name, []).append(value.removeprefix(" "))
    event = _event_of(fields)
    if event is not None:
        yield event


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
