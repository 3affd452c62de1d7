"""A run's events as Server-Sent Events, for the tenant's and the admin's run routes.

The stream is read from :class:`~moorline.engine.streams.EventStreams`: each event carries its
``seq`` as its ``id``, so a client that reconnects with ``Last-Event-ID`` (or ``?after=``)
resumes after the last one it saw, with neither gap nor duplicate. The stream closes after
the run's terminal event, after ``EXECUTION_TIMEOUT`` (a client reconnects and resumes), or
when the client leaves; a comment every ``SSE_PING_INTERVAL`` keeps proxies from closing an
idle one. Each tenant may hold ``MAX_STREAMS_PER_TENANT`` streams open per process
(:class:`~moorline.api.deps.StreamSlots`).
"""

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Header, Query
from sse_starlette import EventSourceResponse, ServerSentEvent

from moorline.api.deps import (
    CallerDep,
    RateKind,
    RunIdPath,
    Services,
    ServicesDep,
    StreamSlots,
    count_request,
    owned_run,
)
from moorline.db.repos.records import Event, Run
from moorline.engine.streams import EventStream

MAX_EVENT_ID = 2**31 - 1
"""The largest event id (``seq`` is a 32-bit integer on every backend): a larger one names no
event, and PostgreSQL would refuse to compare with it after the stream's 200."""

AfterQuery = Annotated[
    int | None,
    Query(ge=0, le=MAX_EVENT_ID, description="Resume after this event id."),
]
LastEventIdHeader = Annotated[
    int | None,
    Header(
        ge=0,
        le=MAX_EVENT_ID,
        description="Resume after this event id (what EventSource sends when it reconnects); "
        "wins over `after`.",
    ),
]


def resume_point(last_event_id: int | None, after: int | None) -> int:
    """The ``seq`` to stream after: ``Last-Event-ID`` wins over ``?after=``; 0 for all.

    Both were checked against :data:`AfterQuery` and :data:`LastEventIdHeader` (0 to
    :data:`MAX_EVENT_ID`) by FastAPI: a 422 ``invalid_request`` otherwise, as documented.
    """
    if last_event_id is not None:
        return last_event_id
    return 0 if after is None else after


def sse_event(event: Event) -> ServerSentEvent:
    """An event as sent: its ``seq`` as ``id``, its type as ``event``, its data as JSON."""
    return ServerSentEvent(
        id=str(event.seq),
        event=event.type,
        data=json.dumps(event.data, separators=(",", ":")),
    )


async def stream_events(
    run_id: RunIdPath,
    caller: CallerDep,
    services: ServicesDep,
    after: AfterQuery = None,
    last_event_id: LastEventIdHeader = None,
) -> EventSourceResponse:
    """The run's events as Server-Sent Events: stored ones after the cursor, then live ones."""
    await count_request(services, caller, RateKind.STREAMS)
    run = await owned_run(services, caller, run_id)
    return await event_stream(
        services, run, resume_point(last_event_id, after), slot=caller.tenant.tenant_id
    )


async def event_stream(
    services: Services, run: Run, after_seq: int, *, slot: str
) -> EventSourceResponse:
    """``run``'s events after ``after_seq`` as Server-Sent Events, counted in ``slot``'s streams.

    Raises:
        RateLimited: ``slot`` already holds as many open streams as allowed.
    """
    services.stream_slots.take(slot)
    try:
        stream = await services.streams.open(run.tenant_id, run.run_id, after_seq=after_seq)
    except BaseException:
        services.stream_slots.give_back(slot)
        raise
    settings = services.settings
    return EventSourceResponse(
        _send(stream, services.stream_slots, slot, settings.execution_timeout),
        ping=settings.sse_ping_interval,
        headers={"Cache-Control": "no-store"},
    )


async def _send(
    stream: EventStream, slots: StreamSlots, slot: str, lifetime_s: float
) -> AsyncIterator[ServerSentEvent]:
    """The stream's events until it ends or its lifetime is over; releases its slot."""
    try:
        async with stream, asyncio.timeout(lifetime_s):
            async for event in stream:
                yield sse_event(event)
    except TimeoutError:
        return  # the client reconnects with Last-Event-ID and resumes
    finally:
        slots.give_back(slot)
