"""A local OpenAI-compatible endpoint for tests: ``POST /v1/chat/completions``, scripted.

A real HTTP server (uvicorn, on a free port of 127.0.0.1) that the ``openai`` SDK talks to
exactly as to a hosted model: server-sent ``chat.completion.chunk`` events ending in
``[DONE]`` (or one ``chat.completion`` object when ``stream`` is false). Each request takes the
next :class:`Answer` of the script (or the default one) and is recorded, so a test can assert
what the client sent and how often.

Like a provider, it counts tokens and reports them: a prompt token per 4 characters of each
message (1 at least), a completion token per streamed text piece and per 4 characters of tool
call arguments; a system message seen before is served "from the prompt cache" (its tokens
are ``cached_tokens``). The usage comes in a final chunk when the request asks for it
(``stream_options.include_usage``). What it served is counted per model (:attr:`served`) once
the whole reply was sent, so a test compares Moorline's accounting with the provider's own.

Per-minute limits (:class:`Limits`, ``rpm``/``tpm`` per model) are enforced over a fixed
window: a request over either gets 429 with ``Retry-After`` (whole seconds to the window's
end) and is counted in :attr:`Served.rejected`.
"""

import asyncio
import json
import math
import socket
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.helpers import wait_for


@dataclass(kw_only=True)
class Answer:
    """What the server does with one request.

    Attributes:
        chunks: Text pieces streamed, one event each.
        tool_calls: ``(id, name, arguments JSON)`` streamed after the text, the arguments
            split in two fragments as hosted models do.
        status: An HTTP error status to answer instead of a stream (with ``retry-after-ms: 10``
            so that the SDK retries at once).
        gate: Set by the test to let the stream go on after its first chunk.
        stall: Send nothing until the server stops (a hung endpoint).
        pause_s: Seconds between two streamed pieces (a model that takes its time).
    """

    chunks: list[str] = field(default_factory=list)
    tool_calls: list[tuple[str, str, str]] = field(default_factory=list)
    status: int | None = None
    gate: asyncio.Event | None = None
    stall: bool = False
    pause_s: float = 0.0


@dataclass(kw_only=True)
class Served:
    """What the server served one model: whole replies, their tokens, and refusals."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    rejected: int = 0
    """Requests answered 429 by the per-minute limits."""

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(kw_only=True)
class Limits:
    """Per-minute limits of one model (None: unlimited), over windows of ``window_s``."""

    rpm: int | None = None
    tpm: int | None = None
    window_s: float = 60.0


def prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """The server's count of a chat's tokens: 1 per 4 characters of each message, 1 at least."""
    return sum(max(1, math.ceil(len(str(m.get("content") or "")) / 4)) for m in messages)


def completion_tokens(answer: "Answer") -> int:
    """The server's count of an answer's tokens: 1 a text piece, 1 per 4 characters of calls."""
    calls = sum(max(1, math.ceil(len(arguments) / 4)) for _, _, arguments in answer.tool_calls)
    return len(answer.chunks) + calls


def _chunk(model: str, delta: dict[str, Any], finish: str | None = None) -> str:
    body = {
        "id": "chatcmpl-test",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return f"data: {json.dumps(body)}\n\n"


class OpenAIServer:
    """The scripted endpoint; ``base_url`` is what ``OpenAICompatibleLLM`` takes."""

    def __init__(self, default: Answer | None = None) -> None:
        self.default = default or Answer(chunks=["Looks ", "good ", "to me."])
        self.script: deque[Answer] = deque()
        self.by_prompt: dict[str, deque[Answer]] = {}
        """Answers for requests whose last message contains the key, in order: requests made
        concurrently (child runs) get theirs whatever order they arrive in."""
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.stopping = asyncio.Event()
        self.limits: dict[str, Limits] = {}
        """Per-minute limits by model; a model not named here is unlimited."""
        self.served: dict[str, Served] = {}
        """What was served, by the model the request named."""
        self.last_retry_after: str | None = None
        """The ``Retry-After`` of the last 429 the limits answered."""
        self._seen_system: set[str] = set()
        self._windows: dict[str, tuple[float, int, int]] = {}
        """Model → (window start, requests, tokens) of the current limit window."""
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def total(self) -> Served:
        """What was served, all models together."""
        total = Served()
        for one in self.served.values():
            total.requests += one.requests
            total.prompt_tokens += one.prompt_tokens
            total.completion_tokens += one.completion_tokens
            total.cached_tokens += one.cached_tokens
            total.rejected += one.rejected
        return total

    def _over_limit(self, model: str, tokens: int) -> float | None:
        """Seconds to wait when this request would pass the model's limits, else None."""
        limits = self.limits.get(model)
        if limits is None:
            return None
        now = time.monotonic()
        start, requests, used = self._windows.get(model, (now, 0, 0))
        if now - start >= limits.window_s:
            start, requests, used = now, 0, 0
        if (limits.rpm is not None and requests + 1 > limits.rpm) or (
            limits.tpm is not None and used + tokens > limits.tpm
        ):
            self._windows[model] = (start, requests, used)
            return start + limits.window_s - now
        self._windows[model] = (start, requests + 1, used + tokens)
        return None

    async def _complete(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        model = str(body.get("model"))
        messages = list(body.get("messages") or [])
        answer = self._answer_for(body)
        served = self.served.setdefault(model, Served())
        wait_s = self._over_limit(model, prompt_tokens(messages) + completion_tokens(answer))
        if wait_s is not None:
            served.rejected += 1
            error = {"error": {"message": "rate limit reached", "type": "rate_limit"}}
            seconds = str(max(1, math.ceil(wait_s)))
            self.last_retry_after = seconds
            return JSONResponse(error, status_code=429, headers={"retry-after": seconds})
        if answer.status is not None:
            error = {"error": {"message": f"scripted {answer.status}", "type": "test"}}
            return JSONResponse(error, status_code=answer.status, headers={"retry-after-ms": "10"})
        if answer.stall:
            await self.stopping.wait()
            return JSONResponse({"error": {"message": "stopping"}}, status_code=503)
        usage = self._usage(messages, answer)
        if not body.get("stream"):
            self._count(served, usage)
            return JSONResponse(self._completion(model, answer, usage))
        options = body.get("stream_options") or {}
        include = bool(options.get("include_usage"))
        return StreamingResponse(
            self._events(model, answer, usage, include, served), media_type="text/event-stream"
        )

    def _usage(self, messages: list[dict[str, Any]], answer: "Answer") -> dict[str, Any]:
        system = "\n".join(str(m.get("content")) for m in messages if m.get("role") == "system")
        cached = prompt_tokens([{"content": system}]) if system in self._seen_system else 0
        if system:
            self._seen_system.add(system)
        prompt = prompt_tokens(messages)
        completion = completion_tokens(answer)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    @staticmethod
    def _count(served: Served, usage: dict[str, Any]) -> None:
        served.requests += 1
        served.prompt_tokens += usage["prompt_tokens"]
        served.completion_tokens += usage["completion_tokens"]
        served.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]

    @staticmethod
    def _completion(model: str, answer: "Answer", usage: dict[str, Any]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(answer.chunks)}
        if answer.tool_calls:
            message["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                for i, n, a in answer.tool_calls
            ]
        return {
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": "tool_calls" if answer.tool_calls else "stop",
                }
            ],
            "usage": usage,
        }

    def _answer_for(self, body: dict[str, Any]) -> Answer:
        messages = body.get("messages") or [{}]
        last = str(messages[-1].get("content", ""))
        for key, answers in self.by_prompt.items():
            if key in last and answers:
                return answers.popleft()
        return self.script.popleft() if self.script else self.default

    async def _events(
        self, model: str, answer: Answer, usage: dict[str, Any], include: bool, served: Served
    ) -> AsyncIterator[str]:
        for index, text in enumerate(answer.chunks):
            if index and answer.pause_s:
                await asyncio.sleep(answer.pause_s)  # the model's pace, not a synchronisation
            yield _chunk(model, {"role": "assistant", "content": text})
            if index == 0 and answer.gate is not None:
                await answer.gate.wait()
        for index, (call_id, name, arguments) in enumerate(answer.tool_calls):
            half = len(arguments) // 2
            function = {"name": name, "arguments": arguments[:half]}
            first = {"index": index, "id": call_id, "type": "function", "function": function}
            yield _chunk(model, {"tool_calls": [first]})
            rest = {"index": index, "function": {"arguments": arguments[half:]}}
            yield _chunk(model, {"tool_calls": [rest]})
        # Counted once the whole reply is out, before the client can read its usage.
        self._count(served, usage)
        yield _chunk(model, {}, "tool_calls" if answer.tool_calls else "stop")
        if include:
            # As OpenAI sends it: a last chunk with no choices, only the usage.
            final = {
                "id": "chatcmpl-test",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": model,
                "choices": [],
                "usage": usage,
            }
            yield f"data: {json.dumps(final)}\n\n"
        yield "data: [DONE]\n\n"

    async def __aenter__(self) -> "OpenAIServer":
        app = Starlette(routes=[Route("/v1/chat/completions", self._complete, methods=["POST"])])
        config = uvicorn.Config(
            app, lifespan="off", ws="none", log_level="warning", timeout_graceful_shutdown=2
        )
        self._server = uvicorn.Server(config)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        server = self._server

        async def started() -> bool:
            return server.started

        await wait_for(started, message="the OpenAI-compatible test server to start")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stopping.set()
        assert self._server is not None and self._task is not None
        self._server.should_exit = True
        await asyncio.wait_for(self._task, 10)
