"""Collect a streamed reply while passing its text on as ``delta`` events.

:func:`complete` consumes :meth:`LLM.stream <moorline.llm.base.LLM.stream>` and hands every
piece of text to an ``emit`` callable with the signature of ``ctx.emit``, so a workflow streams
a model's tokens to SSE subscribers with one line::

    reply = await complete(llm, messages, emit=ctx.emit)

Each emitted event is one database write, and a model can stream a hundred tokens a second:
pieces that arrive within ``min_interval_s`` of the last event are held back and sent with the
next one (or when the stream ends), so a stream costs at most ``1/min_interval_s`` writes a
second while a subscriber still sees text arrive as it is produced.
"""

import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing

from moorline.llm.base import LLM, Message, Reply, Tool, ToolCall
from moorline.observability import tracing
from moorline.types import JSONObject

Emit = Callable[[str, JSONObject], Awaitable[None]]
"""Records one event of the run: ``ctx.emit`` fits."""

DELTA_EVENT = "delta"
"""The event type of streamed text: ``{"text": <piece>}`` plus the caller's ``extra`` fields."""

DEFAULT_DELTA_INTERVAL_S = 0.05
"""Shortest time between two ``delta`` events of one stream, in seconds."""


async def complete(
    llm: LLM,
    messages: Sequence[Message],
    *,
    tools: Sequence[Tool] = (),
    emit: Emit | None = None,
    extra: JSONObject | None = None,
    min_interval_s: float = DEFAULT_DELTA_INTERVAL_S,
) -> Reply:
    """Ask ``llm`` for the next message of the chat; stream its text through ``emit``.

    Args:
        llm: The model.
        messages: The chat so far, oldest first.
        tools: Tools the model may call.
        emit: Called as ``emit("delta", {"text": ..., **extra})`` while the text streams;
            None to stream nowhere.
        extra: Fields added to every ``delta`` event (which section, which turn).
        min_interval_s: Text arriving sooner than this after the last event waits for the
            next one; 0 emits every piece as it comes.

    Returns:
        The whole reply; its text is the concatenation of every emitted ``text``.

    Raises:
        ValueError: ``min_interval_s`` is negative.
        LLMError: The model call failed; the text emitted so far stays emitted.
    """
    if min_interval_s < 0:
        raise ValueError(f"min_interval_s must not be negative, got {min_interval_s}")
    fields: JSONObject = dict(extra or {})
    pieces: list[str] = []
    calls: list[ToolCall] = []
    held: list[str] = []
    last_emit = -float("inf")

    async def flush() -> None:
        nonlocal last_emit
        if emit is not None and held:
            text = "".join(held)
            held.clear()
            await emit(DELTA_EVENT, {"text": text, **fields})
            last_emit = time.monotonic()

    # The model call's span (GenAI conventions); the model notes its tokens on it.
    with tracing.model_span(model=llm.model, simulated=llm.simulated):
        async with aclosing(llm.stream(messages, tools=tools)) as stream:
            async for item in stream:
                if isinstance(item, ToolCall):
                    calls.append(item)
                    continue
                pieces.append(item)
                held.append(item)
                if time.monotonic() - last_emit >= min_interval_s:
                    await flush()
        tracing.record_reply(model=llm.model)
    await flush()
    return Reply(
        text="".join(pieces), model=llm.model, simulated=llm.simulated, tool_calls=tuple(calls)
    )
