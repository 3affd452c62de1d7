"""A local OpenAI-compatible endpoint for tests: ``POST /v1/chat/completions``, scripted.

A real HTTP server (uvicorn, on a free port of 127.0.0.1) that the ``openai`` SDK talks to
exactly as to a hosted model: server-sent ``chat.completion.chunk`` events ending in
``[DONE]``. Each request takes the next :class:`Answer` of the script (or the default one) and
is recorded, so a test can assert what the client sent and how often.
"""

import asyncio
import json
import socket
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
    """

    chunks: list[str] = field(default_factory=list)
    tool_calls: list[tuple[str, str, str]] = field(default_factory=list)
    status: int | None = None
    gate: asyncio.Event | None = None
    stall: bool = False


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
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def _complete(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        answer = self._answer_for(body)
        if answer.status is not None:
            error = {"error": {"message": f"scripted {answer.status}", "type": "test"}}
            return JSONResponse(error, status_code=answer.status, headers={"retry-after-ms": "10"})
        if answer.stall:
            await self.stopping.wait()
            return JSONResponse({"error": {"message": "stopping"}}, status_code=503)
        return StreamingResponse(
            self._events(str(body.get("model")), answer), media_type="text/event-stream"
        )

    def _answer_for(self, body: dict[str, Any]) -> Answer:
        messages = body.get("messages") or [{}]
        last = str(messages[-1].get("content", ""))
        for key, answers in self.by_prompt.items():
            if key in last and answers:
                return answers.popleft()
        return self.script.popleft() if self.script else self.default

    async def _events(self, model: str, answer: Answer) -> AsyncIterator[str]:
        for index, text in enumerate(answer.chunks):
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
        yield _chunk(model, {}, "tool_calls" if answer.tool_calls else "stop")
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
