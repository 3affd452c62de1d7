"""The LLM seam: one Protocol, the values that cross it, and the errors it raises.

A model is anything that streams a chat completion: :meth:`LLM.stream` takes the conversation
so far (and the tools the model may call) and yields the reply as it is produced, text pieces
as they arrive and complete tool calls at the end. Two implementations exist, chosen from the
settings by :func:`~moorline.llm.factory.make_llm`: an OpenAI-compatible endpoint reached
through the ``openai`` SDK, and a simulated model that needs no network.

Every value here is JSON-ready (``to_json``/``from_json``), because workflows pass
conversations to checkpointed steps and store replies as step outputs: a replayed run rebuilds
the same conversation from its stored steps without asking the model again.

Errors: every failure of a model call is an :class:`LLMError`, translated at the seam so that
no SDK or transport exception reaches workflow code::

    LLMError               the reply could not be had or read (the base)
    ├── LLMTimeout         the endpoint sent nothing for the timeout, after the retries
    ├── LLMUnavailable     unreachable, or 429/5xx after the retries
    ├── LLMRejected        a 4xx for this request (too long, malformed)
    └── LLMMisconfigured   401/403/404: the key, model or URL is wrong (also a ConfigError,
                           so the worker fails the run at once instead of retrying)
"""

import json
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from moorline.errors import ConfigError, MoorlineError
from moorline.types import JSONObject, JSONValue

SIMULATED_MODEL = "moorline-simulated"
"""The model name the simulated model answers with, and reports in every reply."""


class LLMError(MoorlineError):
    """A model call failed; the message names the endpoint and what went wrong."""

    code = "llm_error"


class LLMTimeout(LLMError):
    """The endpoint sent nothing for the client's timeout, on every try."""

    code = "llm_timeout"


class LLMUnavailable(LLMError):
    """The endpoint could not be reached, or kept answering 429 or 5xx."""

    code = "llm_unavailable"


class LLMRejected(LLMError):
    """The endpoint refused this request with a 4xx (too long, malformed, filtered)."""

    code = "llm_rejected"


class LLMMisconfigured(LLMError, ConfigError):
    """The endpoint refused the key, or does not know the model or the path.

    Also a :class:`~moorline.errors.ConfigError`: another attempt would fail the same way, so
    the worker's retry policy fails the run at once.
    """

    code = "llm_misconfigured"


class Role(StrEnum):
    """Who said a message of a chat."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


@dataclass(frozen=True, slots=True, kw_only=True)
class Tool:
    """A function the model may ask to call.

    Attributes:
        name: The tool's name, as the model writes it in a call.
        description: What the tool does, for the model.
        parameters: JSON Schema of the call's arguments (an ``object`` schema).
    """

    name: str
    description: str
    parameters: JSONObject


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    """The model's request to call ``name`` with ``arguments``; ``id`` pairs it with its result."""

    id: str
    name: str
    arguments: JSONObject

    def to_json(self) -> JSONObject:
        return {"id": self.id, "name": self.name, "arguments": self.arguments}

    @classmethod
    def from_json(cls, data: JSONValue) -> "ToolCall":
        """Read a tool call written by :meth:`to_json`.

        Raises:
            ValueError: ``data`` is not such a tool call.
        """
        match data:
            case {"id": str(id_), "name": str(name), "arguments": dict(arguments)}:
                return cls(id=id_, name=name, arguments=arguments)
        raise ValueError(f"not a tool call: {data!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """One message of a chat.

    Attributes:
        role: Who said it.
        content: Its text (empty for an assistant message that only calls tools).
        tool_calls: The tools an assistant message calls.
        tool_call_id: For a ``tool`` message, the call whose result it is.
    """

    role: Role
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    @classmethod
    def system(cls, content: str) -> "Message":
        return cls(role=Role.SYSTEM, content=content)

    @classmethod
    def user(cls, content: str) -> "Message":
        return cls(role=Role.USER, content=content)

    @classmethod
    def tool_result(cls, call: ToolCall, content: str) -> "Message":
        """The answer to ``call``, as the model reads it."""
        return cls(role=Role.TOOL, content=content, tool_call_id=call.id)

    def to_json(self) -> JSONObject:
        data: JSONObject = {"role": self.role.value, "content": self.content}
        if self.tool_calls:
            data["tool_calls"] = [call.to_json() for call in self.tool_calls]
        if self.tool_call_id is not None:
            data["tool_call_id"] = self.tool_call_id
        return data

    @classmethod
    def from_json(cls, data: JSONValue) -> "Message":
        """Read a message written by :meth:`to_json`.

        Raises:
            ValueError: ``data`` is not such a message.
        """
        if not isinstance(data, dict) or not isinstance(data.get("content"), str):
            raise ValueError(f"not a chat message: {data!r}")
        calls = data.get("tool_calls", [])
        call_id = data.get("tool_call_id")
        if not isinstance(calls, list) or not (call_id is None or isinstance(call_id, str)):
            raise ValueError(f"not a chat message: {data!r}")
        return cls(
            role=Role(str(data.get("role"))),
            content=str(data["content"]),
            tool_calls=tuple(ToolCall.from_json(call) for call in calls),
            tool_call_id=call_id,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    """A complete answer of a model: its text, the tools it calls, and who answered.

    Attributes:
        text: The reply's text, as streamed.
        tool_calls: Tools the model asks to call, in its order.
        model: The model that answered (``moorline-simulated`` for the simulated one).
        simulated: Whether the simulated model answered.
    """

    text: str
    model: str
    simulated: bool
    tool_calls: tuple[ToolCall, ...] = field(default=())

    def to_message(self) -> Message:
        """The reply as the assistant's message of the chat."""
        return Message(role=Role.ASSISTANT, content=self.text, tool_calls=self.tool_calls)

    def to_json(self) -> JSONObject:
        return {
            "text": self.text,
            "tool_calls": [call.to_json() for call in self.tool_calls],
            "model": self.model,
            "simulated": self.simulated,
        }

    @classmethod
    def from_json(cls, data: JSONValue) -> "Reply":
        """Read a reply written by :meth:`to_json` (a step's stored output).

        Raises:
            ValueError: ``data`` is not such a reply.
        """
        match data:
            case {
                "text": str(text),
                "tool_calls": list(calls),
                "model": str(model),
                "simulated": bool(simulated),
            }:
                return cls(
                    text=text,
                    model=model,
                    simulated=simulated,
                    tool_calls=tuple(ToolCall.from_json(call) for call in calls),
                )
        raise ValueError(f"not a model reply: {data!r}")


def parse_arguments(name: str, text: str) -> JSONObject:
    """The JSON object of a tool call's ``arguments`` text (empty text is no arguments).

    Raises:
        LLMError: The model wrote arguments that are not a JSON object.
    """
    if not text.strip():
        return {}
    try:
        arguments = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LLMError(
            f"the model called tool {name!r} with arguments that are not JSON: {exc}"
        ) from None
    if not isinstance(arguments, dict):
        raise LLMError(f"the model called tool {name!r} with arguments that are not an object")
    return arguments


class LLM(Protocol):
    """A chat model that streams its replies."""

    @property
    def model(self) -> str:
        """The model's name, as replies report it."""
        ...

    @property
    def simulated(self) -> bool:
        """Whether this is the simulated model (no endpoint is asked)."""
        ...

    def stream(
        self, messages: Sequence[Message], *, tools: Sequence[Tool] = ()
    ) -> AsyncGenerator[str | ToolCall, None]:
        """Ask for the next message of the chat and yield it as it is produced.

        Text comes as it arrives (one piece per streamed chunk, never empty); the tool calls
        come complete, after the text, once the model has finished writing them.

        Args:
            messages: The chat so far, oldest first.
            tools: Tools the model may call; none by default.

        Raises:
            LLMError: The call failed (see the subclasses); pieces already yielded stand.

        Close the generator (``contextlib.aclosing``) when leaving it early, so the
        connection is released at once.
        """
        ...

    async def close(self) -> None:
        """Release the model's connections; it is not used afterwards."""
        ...
