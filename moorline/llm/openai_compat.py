"""A model behind any OpenAI-compatible endpoint, through the ``openai`` SDK's ``AsyncOpenAI``.

OpenAI itself, Azure-style gateways, vLLM, Ollama, LM Studio and llama.cpp's server all speak
``POST /v1/chat/completions`` with server-sent events; ``MOORLINE_LLM_BASE_URL`` names one
(usually ending in ``/v1``). Timeouts and retries are the SDK's own: ``timeout_s`` bounds every
wait for the endpoint (connecting, the first token, the gap between two chunks), and a
connection error, a timeout, a 408, 409, 429 or 5xx is retried ``max_retries`` times with the
SDK's exponential backoff (or the server's ``Retry-After``). Once a stream has started nothing
is retried: the text already streamed could not be taken back.

Each call goes through :func:`~moorline.llm.governance.governed` (budgets, provider limits,
usage): it asks for the usage in the stream's final chunk (``stream_options.include_usage``)
and puts it in the call's slot under the configured model name, the name the models file
prices (a server that sends no usage is a call of 0 tokens); every 429 the SDK sees, retried or
not, is passed on with its ``Retry-After`` from the HTTP client's response hook, so that every
worker pauses that model, not only this one.

Every SDK exception is translated here into an :class:`~moorline.llm.base.LLMError` naming the
endpoint, so workflows handle one family of errors whatever the SDK's version.
"""

import json
import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import replace
from typing import Any, NoReturn, cast

import httpx
import openai
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from moorline.llm.base import (
    LLM,
    LLMError,
    LLMMisconfigured,
    LLMRejected,
    LLMTimeout,
    LLMUnavailable,
    Message,
    Role,
    Tool,
    ToolCall,
    parse_arguments,
)
from moorline.llm.governance import governed, provider_rate_limited
from moorline.usage import Usage

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
"""Seconds to wait for the endpoint at any point of a call before the try fails."""

DEFAULT_MAX_RETRIES = 2
"""Further tries after a failed one (connection errors, timeouts, 429 and 5xx)."""

DEFAULT_RETRY_AFTER_S = 1.0
"""Seconds a 429 without a ``Retry-After`` header pauses its model."""

NO_API_KEY = "not-set"
"""Sent when no key is configured: local servers ignore the header, and a hosted endpoint
then answers 401, which names the missing ``MOORLINE_LLM_API_KEY``."""


def _to_openai(message: Message) -> ChatCompletionMessageParam:
    """The SDK's wire shape of one chat message."""
    data: dict[str, Any] = {"role": message.role.value, "content": message.content}
    if message.role is Role.ASSISTANT and message.tool_calls:
        data["content"] = message.content or None
        data["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        data["tool_call_id"] = message.tool_call_id
    return cast(ChatCompletionMessageParam, data)


def _tool_to_openai(tool: Tool) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters,
        },
    }


_TRANSLATIONS: tuple[tuple[type[openai.OpenAIError], type[LLMError], str], ...] = (
    (openai.APITimeoutError, LLMTimeout, "{where} sent nothing for {timeout}s ({tries})"),
    (openai.APIConnectionError, LLMUnavailable, "{where} cannot be reached ({tries}): {detail}"),
    (
        openai.AuthenticationError,
        LLMMisconfigured,
        "{where} refused the API key (HTTP {status}); check MOORLINE_LLM_API_KEY: {detail}",
    ),
    (
        openai.PermissionDeniedError,
        LLMMisconfigured,
        "{where} refused the API key (HTTP {status}); check MOORLINE_LLM_API_KEY: {detail}",
    ),
    (
        openai.NotFoundError,
        LLMMisconfigured,
        "{where} answered 404; check MOORLINE_LLM_MODEL and MOORLINE_LLM_BASE_URL (which "
        "usually ends in /v1): {detail}",
    ),
    (openai.RateLimitError, LLMUnavailable, "{where} answered HTTP {status} ({tries}): {detail}"),
    (
        openai.InternalServerError,
        LLMUnavailable,
        "{where} answered HTTP {status} ({tries}): {detail}",
    ),
    (openai.APIStatusError, LLMRejected, "{where} refused the request (HTTP {status}): {detail}"),
)
"""SDK exception → the error raised instead, and its message; the first match wins."""


def retry_after_s(headers: httpx.Headers) -> float:
    """The pause a 429 asks for: ``retry-after-ms``, else ``retry-after`` seconds, else 1 s.

    An HTTP date in ``Retry-After`` is not read (the SDK reads it for its own retry); the
    default pause applies then.
    """
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is not None:
            try:
                return max(0.0, float(value) * scale)
            except ValueError:
                continue
    return DEFAULT_RETRY_AFTER_S


async def _on_response(response: httpx.Response) -> None:
    """The HTTP client's response hook: a 429 pauses its model for every worker."""
    if response.status_code == 429:
        await provider_rate_limited(retry_after_s(response.headers))


class _PendingCall:
    """A tool call being streamed in fragments (its id, name, and arguments text)."""

    def __init__(self) -> None:
        self.id = ""
        self.name = ""
        self.arguments: list[str] = []

    def finish(self, index: int) -> ToolCall:
        if not self.name:
            raise LLMError(f"the model streamed tool call #{index} without a name")
        arguments = parse_arguments(self.name, "".join(self.arguments))
        return ToolCall(id=self.id or f"call_{index}", name=self.name, arguments=arguments)


def _usage_of(model: str, chunk: ChatCompletionChunk) -> Usage:
    """The usage a final chunk carries (cached tokens where the server reports them)."""
    usage = chunk.usage
    assert usage is not None
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    return Usage(
        model=model,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=cached,
        ok=False,  # until the stream ends well
    )


class OpenAICompatibleLLM(LLM):
    """Chat completions from an OpenAI-compatible endpoint, streamed.

    Args:
        base_url: The endpoint's base URL (``https://api.openai.com/v1``,
            ``http://localhost:11434/v1``).
        model: The model name sent with every request.
        api_key: The bearer key; None sends a placeholder (see :data:`NO_API_KEY`).
        timeout_s: Seconds to wait for the endpoint at any point of a try.
        max_retries: Further tries after a retryable failure (the SDK's backoff).
        max_tokens: Longest reply asked for (sent as ``max_tokens``); None: the endpoint's
            default. Also what the provider limiter reserves for the reply.

    Raises:
        ValueError: An empty URL or model, a non-positive timeout or negative retries.
    """

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_MAX_RETRIES,
        max_tokens: int | None = None,
    ) -> None:
        if not base_url or not model:
            raise ValueError("an OpenAI-compatible model needs a base URL and a model name")
        if timeout_s <= 0 or max_retries < 0:
            raise ValueError("timeout_s must be positive and max_retries not negative")
        self._base_url = base_url
        self._model = model
        self._timeout_s = timeout_s
        self._max_retries = max_retries
        self._max_tokens = max_tokens
        self._client = openai.AsyncOpenAI(
            base_url=base_url,
            api_key=api_key or NO_API_KEY,
            timeout=timeout_s,
            max_retries=max_retries,
            http_client=openai.DefaultAsyncHttpxClient(
                timeout=timeout_s, event_hooks={"response": [_on_response]}
            ),
        )

    @property
    def model(self) -> str:
        return self._model

    @property
    def simulated(self) -> bool:
        return False

    async def stream(
        self, messages: Sequence[Message], *, tools: Sequence[Tool] = ()
    ) -> AsyncGenerator[str | ToolCall, None]:
        options: dict[str, Any] = {}
        if tools:
            options["tools"] = [_tool_to_openai(tool) for tool in tools]
        if self._max_tokens is not None:
            options["max_tokens"] = self._max_tokens
        pending: dict[int, _PendingCall] = {}
        async with governed(self._model, messages, max_tokens=self._max_tokens) as slot:
            slot.usage = Usage(model=self._model, ok=False)
            try:
                # ``**options`` (tools only when there are some, as older servers refuse an
                # empty list) hides the streaming overload from mypy: a stream all the same.
                with slot.sending():
                    chunks = cast(
                        "openai.AsyncStream[ChatCompletionChunk]",
                        await self._client.chat.completions.create(
                            model=self._model,
                            messages=[_to_openai(message) for message in messages],
                            stream=True,
                            stream_options={"include_usage": True},
                            **options,
                        ),
                    )
                async with chunks:
                    async for chunk in chunks:
                        if chunk.usage is not None:
                            slot.usage = _usage_of(self._model, chunk)
                        for choice in chunk.choices[:1]:
                            if choice.delta.content:
                                yield choice.delta.content
                            for fragment in choice.delta.tool_calls or ():
                                call = pending.setdefault(fragment.index, _PendingCall())
                                call.id = fragment.id or call.id
                                if fragment.function is not None:
                                    call.name = fragment.function.name or call.name
                                    call.arguments.append(fragment.function.arguments or "")
                slot.usage = replace(slot.usage, ok=True)
            except openai.OpenAIError as exc:
                self._raise_translated(exc)
        for index in sorted(pending):
            yield pending[index].finish(index)

    def _raise_translated(self, exc: openai.OpenAIError) -> NoReturn:
        """Raise the :class:`LLMError` that says what ``exc`` means for this endpoint."""
        error_class, template = next(
            ((error, text) for sdk, error, text in _TRANSLATIONS if isinstance(exc, sdk)),
            (LLMError, "{where} failed: {detail}"),
        )
        status = exc.status_code if isinstance(exc, openai.APIStatusError) else None
        retries = self._max_retries
        error = error_class(
            template.format(
                where=f"the LLM endpoint {self._base_url} (model {self._model!r})",
                tries=f"{retries + 1} tr{'y' if retries == 0 else 'ies'}",
                timeout=f"{self._timeout_s:g}",
                status=status,
                detail=f"{type(exc).__name__}: {exc}",
            )
        )
        logger.warning("%s", error.message)
        raise error from exc

    async def close(self) -> None:
        await self._client.close()
