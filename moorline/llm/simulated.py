"""The simulated model: deterministic replies, streamed word by word, without any network.

It answers when ``MOORLINE_LLM_BASE_URL`` is unset (the embedded default, the tests), and says
so: every reply reports the model ``moorline-simulated``, and its text starts by saying that
it is simulated and how to use a real model instead.

A reply depends only on the chat (and the tools offered), never on chance or the clock, so a
test can predict it and a replayed step would get the same one:

- after a tool's result, it reports the result;
- when tools are offered and the last user message names one — every word of the tool's name
  (split at ``_``) appears in it, so "please create a ticket" names ``create_ticket`` — it
  calls that tool, filling each required string argument with the message (other argument
  types it cannot fill, so it does not call such a tool);
- otherwise it says how long the last message was, how it began, and two sentences picked by
  a hash of the chat.

Usage is deterministic too (:func:`simulated_usage`): a prompt token per four characters of
the chat (at least one a message), a completion token per word streamed (a tool call: per four
characters of its arguments), never a cached one. Its calls are governed like any model's
(:mod:`moorline.llm.governance`): they count toward budgets and declared limits.

Latency is realistic by default (a pause before the first word, then one word at a time) and
configurable, so that tests run in milliseconds.
"""

import asyncio
import hashlib
import json
import re
from collections.abc import AsyncGenerator, Sequence

from moorline.llm.base import LLM, SIMULATED_MODEL, Message, Role, Tool, ToolCall
from moorline.llm.governance import governed
from moorline.types import JSONObject
from moorline.usage import Usage

DEFAULT_FIRST_TOKEN_S = 0.4
"""Seconds before the first word, like a hosted model's time to first token."""

DEFAULT_WORD_INTERVAL_S = 0.03
"""Seconds between two words, about 30 words a second."""

SNIPPET_CHARS = 80
"""Characters of the last message quoted in a reply."""

ARGUMENT_CHARS = 200
"""Characters of the user's message put into a simulated tool call's string argument."""

PREAMBLE = (
    f"[Simulated reply from {SIMULATED_MODEL}: no LLM endpoint is configured; "
    "set MOORLINE_LLM_BASE_URL to ask a real model.]"
)
"""How every simulated text reply begins."""

SENTENCES = (
    "A real model would answer the request itself here.",
    "The text is streamed one word at a time, as a hosted model streams tokens.",
    "The same conversation always gets this same reply.",
    "Every word arrived as a delta event before the step stored the whole reply.",
    "Nothing here was checked by a model: treat it as a placeholder.",
    "The workflow around this reply runs exactly as it would with a real model.",
)

_WORDS = re.compile(r"\S+\s*")


def _digest(messages: Sequence[Message], tools: Sequence[Tool]) -> str:
    chat = json.dumps(
        {"messages": [m.to_json() for m in messages], "tools": [t.name for t in tools]},
        sort_keys=True,
    )
    return hashlib.sha256(chat.encode("utf-8")).hexdigest()


def _is_string_property(schema: object) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "string"


def _named_tool(text: str, tools: Sequence[Tool]) -> tuple[Tool, JSONObject] | None:
    """The first tool ``text`` names whose required arguments are all strings, and those."""
    words = set(re.findall(r"[a-z0-9]+", text.lower()))
    for tool in tools:
        if not set(tool.name.lower().split("_")) <= words:
            continue
        properties = tool.parameters.get("properties")
        required = tool.parameters.get("required", [])
        if not isinstance(properties, dict) or not isinstance(required, list):
            continue
        if all(_is_string_property(properties.get(str(name))) for name in required):
            value = text.strip()[:ARGUMENT_CHARS]
            return tool, {str(name): value for name in required}
    return None


def simulated_reply(messages: Sequence[Message], tools: Sequence[Tool] = ()) -> str | ToolCall:
    """The simulated model's answer to the chat: its text, or the tool it calls."""
    digest = _digest(messages, tools)
    last = messages[-1] if messages else Message.user("")
    if last.role is Role.TOOL:
        return f"{PREAMBLE} The tool answered: {last.content}"
    if last.role is Role.USER and tools:
        named = _named_tool(last.content, tools)
        if named is not None:
            tool, arguments = named
            return ToolCall(id=f"call_{digest[:16]}", name=tool.name, arguments=arguments)
    words = last.content.split()
    snippet = " ".join(words)[:SNIPPET_CHARS]
    first = int(digest[:8], 16) % len(SENTENCES)
    second = (first + 1 + int(digest[8:16], 16) % (len(SENTENCES) - 1)) % len(SENTENCES)
    return (
        f"{PREAMBLE} The last message has {len(words)} words and begins: “{snippet}”. "
        f"{SENTENCES[first]} {SENTENCES[second]}"
    )


def prompt_tokens(messages: Sequence[Message]) -> int:
    """The simulated model's count of a chat's tokens: one per 4 characters, 1 at least each."""
    return sum(max(1, -(-len(message.content) // 4)) for message in messages)


def simulated_usage(messages: Sequence[Message], tools: Sequence[Tool] = ()) -> Usage:
    """What the simulated model reports for its whole answer to the chat."""
    reply = simulated_reply(messages, tools)
    if isinstance(reply, ToolCall):
        completion = max(1, -(-len(json.dumps(reply.arguments)) // 4))
    else:
        completion = len(_WORDS.findall(reply))
    return Usage(
        model=SIMULATED_MODEL,
        prompt_tokens=prompt_tokens(messages),
        completion_tokens=completion,
    )


class SimulatedLLM(LLM):
    """A model that answers :func:`simulated_reply`, streamed one word at a time.

    Args:
        first_token_s: Seconds before the first word (or the tool call).
        word_interval_s: Seconds between two words.

    Raises:
        ValueError: A negative latency.
    """

    def __init__(
        self,
        *,
        first_token_s: float = DEFAULT_FIRST_TOKEN_S,
        word_interval_s: float = DEFAULT_WORD_INTERVAL_S,
    ) -> None:
        if first_token_s < 0 or word_interval_s < 0:
            raise ValueError("the simulated model's latencies must not be negative")
        self._first_token_s = first_token_s
        self._word_interval_s = word_interval_s

    @property
    def model(self) -> str:
        return SIMULATED_MODEL

    @property
    def simulated(self) -> bool:
        return True

    async def stream(
        self, messages: Sequence[Message], *, tools: Sequence[Tool] = ()
    ) -> AsyncGenerator[str | ToolCall, None]:
        reply = simulated_reply(messages, tools)
        async with governed(SIMULATED_MODEL, messages, max_tokens=0) as slot:
            # A stream left early is reported too, as failed (nothing of it counted).
            slot.usage = Usage(model=SIMULATED_MODEL, ok=False)
            # The pauses are the simulated model's latency, not a wait for anything.
            await asyncio.sleep(self._first_token_s)
            if isinstance(reply, ToolCall):
                yield reply
            else:
                for index, word in enumerate(_WORDS.findall(reply)):
                    if index:
                        await asyncio.sleep(self._word_interval_s)
                    yield word
            slot.usage = simulated_usage(messages, tools)

    async def close(self) -> None:
        return None
