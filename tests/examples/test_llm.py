"""``moorline.llm``: the simulated model, delta streaming, and the OpenAI-compatible client.

The client is tested against a real local HTTP server speaking the OpenAI streaming protocol
(:mod:`tests.examples.openai_server`): it must stream (text arrives before the stream ends),
retry a 500, turn a hung endpoint into a clear :class:`LLMTimeout`, and a refused key into
:class:`LLMMisconfigured`.
"""

import asyncio
import json
import time
from contextlib import aclosing

import pytest

from moorline.dispatch.retry import RetryPolicy
from moorline.errors import ConfigError
from moorline.llm import (
    SIMULATED_MODEL,
    LazyLLM,
    LLMError,
    LLMMisconfigured,
    LLMRejected,
    LLMTimeout,
    LLMUnavailable,
    Message,
    Reply,
    SimulatedLLM,
    Tool,
    ToolCall,
    complete,
    make_llm,
)
from moorline.llm.base import parse_arguments
from moorline.llm.openai_compat import OpenAICompatibleLLM
from moorline.settings import Settings
from moorline.types import JSONObject, JSONValue
from tests.examples.openai_server import Answer, OpenAIServer

FAST = SimulatedLLM(first_token_s=0, word_interval_s=0)

TICKET = Tool(
    name="create_ticket",
    description="File a ticket.",
    parameters={
        "type": "object",
        "properties": {"title": {"type": "string"}},
        "required": ["title"],
    },
)


class Events:
    """An ``emit`` that records, like ``ctx.emit`` without a run."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, JSONObject]] = []

    async def __call__(self, event_type: str, data: JSONObject) -> None:
        self.seen.append((event_type, data))

    @property
    def texts(self) -> list[str]:
        return [str(data["text"]) for kind, data in self.seen if kind == "delta"]


# --- the simulated model ---------------------------------------------------------------------


async def test_the_simulated_model_says_so_and_answers_the_same_chat_the_same_way() -> None:
    chat = [Message.system("be brief"), Message.user("What does the reaper do?")]
    first = await complete(FAST, chat, min_interval_s=0)
    again = await complete(FAST, chat, min_interval_s=0)
    other = await complete(FAST, [Message.user("Something else entirely")], min_interval_s=0)
    assert first == again
    assert first.model == SIMULATED_MODEL and first.simulated
    assert first.text.startswith(f"[Simulated reply from {SIMULATED_MODEL}")
    assert "MOORLINE_LLM_BASE_URL" in first.text
    assert "What does the reaper do?" in first.text
    assert other.text != first.text
    assert first.tool_calls == ()


async def test_the_simulated_model_streams_word_by_word_with_its_latency() -> None:
    llm = SimulatedLLM(first_token_s=0.2, word_interval_s=0.01)
    started = time.monotonic()
    pieces: list[str] = []
    async with aclosing(llm.stream([Message.user("hello there")])) as stream:
        async for piece in stream:
            assert isinstance(piece, str)
            pieces.append(piece)
    took_s = time.monotonic() - started
    assert len(pieces) > 10 and all(piece.strip() for piece in pieces)
    assert took_s >= 0.2 + 0.01 * (len(pieces) - 1) * 0.9


async def test_the_simulated_model_calls_a_tool_the_user_names_then_reports_its_result() -> None:
    asked = [Message.user("Please create a ticket: the login page is slow")]
    call = (await complete(FAST, asked, tools=[TICKET])).tool_calls
    assert [(c.name, c.arguments) for c in call] == [
        ("create_ticket", {"title": "Please create a ticket: the login page is slow"})
    ]
    # Not offered, or not named: no call.
    assert (await complete(FAST, asked)).tool_calls == ()
    unnamed = [Message.user("Please file something")]
    assert (await complete(FAST, unnamed, tools=[TICKET])).tool_calls == ()
    answered = [*asked, Reply(text="", model="m", simulated=True, tool_calls=call).to_message()]
    answered.append(Message.tool_result(call[0], '{"ticket": "T-1"}'))
    reply = await complete(FAST, answered, tools=[TICKET])
    assert reply.tool_calls == () and '{"ticket": "T-1"}' in reply.text


async def test_complete_emits_every_piece_and_coalesces_within_the_interval() -> None:
    chat = [Message.user("count the words of this sentence please")]
    each = Events()
    reply = await complete(FAST, chat, emit=each, extra={"turn": 3}, min_interval_s=0)
    assert "".join(each.texts) == reply.text
    assert len(each.texts) == len(reply.text.split())
    assert all(data["turn"] == 3 for _, data in each.seen)
    held = Events()
    # Everything arrives at once: the first piece goes out, the rest waits for the end.
    assert (await complete(FAST, chat, emit=held, min_interval_s=60)).text == reply.text
    assert len(held.texts) == 2 and "".join(held.texts) == reply.text
    with pytest.raises(ValueError, match="min_interval_s"):
        await complete(FAST, chat, min_interval_s=-1)


def test_messages_and_replies_survive_a_json_round_trip() -> None:
    call = ToolCall(id="c1", name="create_ticket", arguments={"title": "x"})
    reply = Reply(text="t", model="m", simulated=False, tool_calls=(call,))
    assert Reply.from_json(json.loads(json.dumps(reply.to_json()))) == reply
    for message in (reply.to_message(), Message.tool_result(call, "ok"), Message.user("u")):
        assert Message.from_json(json.loads(json.dumps(message.to_json()))) == message
    bad_replies: list[JSONValue] = [{"text": 1}, [], {**reply.to_json(), "simulated": "no"}]
    for bad in bad_replies:
        with pytest.raises(ValueError, match="not a model reply"):
            Reply.from_json(bad)
    bad_messages: list[JSONValue] = [[], {"content": 1}, {"content": "x", "tool_calls": "no"}]
    for bad in bad_messages:
        with pytest.raises(ValueError, match="not a chat message"):
            Message.from_json(bad)
    with pytest.raises(ValueError, match="robot"):
        Message.from_json({"content": "x", "role": "robot"})
    assert parse_arguments("t", " ") == {}
    for text, problem in (("{", "not JSON"), ("[1]", "not an object")):
        with pytest.raises(LLMError, match=problem):
            parse_arguments("t", text)


async def test_make_llm_follows_the_settings_and_lazy_llm_builds_on_first_use() -> None:
    simulated = make_llm(Settings(llm_base_url=None))
    assert isinstance(simulated, SimulatedLLM)
    endpoint = make_llm(
        Settings(llm_base_url="http://127.0.0.1:9/v1", llm_model="local-model", llm_api_key="k")
    )
    assert isinstance(endpoint, OpenAICompatibleLLM)
    assert (endpoint.model, endpoint.simulated) == ("local-model", False)
    await endpoint.close()

    built: list[int] = []

    def build() -> SimulatedLLM:
        built.append(1)
        return FAST

    lazy = LazyLLM(build)
    assert built == []
    assert lazy.model == SIMULATED_MODEL and lazy.simulated
    reply = await complete(lazy, [Message.user("hi")])
    assert reply == await complete(FAST, [Message.user("hi")])
    assert built == [1]
    await lazy.close()
    assert lazy.model == SIMULATED_MODEL and built == [1, 1]


def test_bad_model_options_are_refused() -> None:
    with pytest.raises(ValueError, match="latencies"):
        SimulatedLLM(first_token_s=-1)
    with pytest.raises(ValueError, match="base URL"):
        OpenAICompatibleLLM(base_url="", model="m")
    with pytest.raises(ValueError, match="timeout_s"):
        OpenAICompatibleLLM(base_url="http://x/v1", model="m", timeout_s=0)


# --- the OpenAI-compatible client against a local server ------------------------------------


async def test_the_client_streams_text_before_the_endpoint_finishes() -> None:
    gate = asyncio.Event()
    async with OpenAIServer() as server:
        server.script.append(Answer(chunks=["The ", "diff ", "is ", "fine."], gate=gate))
        llm = OpenAICompatibleLLM(base_url=server.base_url, model="test-model", api_key="sk-t")
        pieces: list[str | ToolCall] = []
        try:
            async with aclosing(llm.stream([Message.user("review")])) as stream:
                # The server holds the rest of its answer until the first piece got here.
                pieces.append(await asyncio.wait_for(anext(stream), 10))
                gate.set()
                pieces += [piece async for piece in stream]
        finally:
            await llm.close()
    assert pieces == ["The ", "diff ", "is ", "fine."]
    [request] = server.requests
    assert request["model"] == "test-model" and request["stream"] is True
    assert request["messages"] == [{"role": "user", "content": "review"}]
    assert "tools" not in request
    assert server.headers[0]["authorization"] == "Bearer sk-t"


async def test_the_client_assembles_streamed_tool_calls_and_sends_them_back() -> None:
    async with OpenAIServer() as server:
        server.script.append(
            Answer(
                chunks=["Filing it."],
                tool_calls=[("call_9", "create_ticket", '{"title": "Slow login"}')],
            )
        )
        llm = OpenAICompatibleLLM(base_url=server.base_url, model="m")
        try:
            reply = await complete(llm, [Message.user("file a ticket")], tools=[TICKET])
            follow_up = [
                Message.user("file a ticket"),
                reply.to_message(),
                Message.tool_result(reply.tool_calls[0], '{"ticket": "T-1"}'),
            ]
            await complete(llm, follow_up, tools=[TICKET])
        finally:
            await llm.close()
    assert reply.text == "Filing it." and not reply.simulated
    assert reply.tool_calls == (
        ToolCall(id="call_9", name="create_ticket", arguments={"title": "Slow login"}),
    )
    first, second = server.requests
    assert first["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "create_ticket",
                "description": "File a ticket.",
                "parameters": TICKET.parameters,
            },
        }
    ]
    assert second["messages"][1:] == [
        {
            "role": "assistant",
            "content": "Filing it.",
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "create_ticket", "arguments": '{"title": "Slow login"}'},
                }
            ],
        },
        {"role": "tool", "content": '{"ticket": "T-1"}', "tool_call_id": "call_9"},
    ]
    assert server.headers[0]["authorization"] == "Bearer not-set"  # no key configured


async def test_the_client_retries_a_500_and_gives_up_with_a_clear_error() -> None:
    async with OpenAIServer() as server:
        llm = OpenAICompatibleLLM(base_url=server.base_url, model="m", max_retries=2)
        try:
            server.script.extend([Answer(status=500), Answer(chunks=["recovered"])])
            reply = await complete(llm, [Message.user("hi")])
            assert reply.text == "recovered" and len(server.requests) == 2

            server.script.extend(Answer(status=503) for _ in range(3))
            with pytest.raises(LLMUnavailable) as failed:
                await complete(llm, [Message.user("hi")])
        finally:
            await llm.close()
    assert len(server.requests) == 2 + 3
    message = str(failed.value)
    assert server.base_url in message and "HTTP 503" in message and "3 tries" in message
    assert "model 'm'" in message


async def test_a_hung_endpoint_times_out_with_a_clear_error_after_its_retries() -> None:
    async with OpenAIServer() as server:
        server.script.extend([Answer(stall=True), Answer(stall=True)])
        llm = OpenAICompatibleLLM(base_url=server.base_url, model="m", timeout_s=0.3, max_retries=1)
        started = time.monotonic()
        try:
            with pytest.raises(LLMTimeout) as failed:
                await complete(llm, [Message.user("hi")])
        finally:
            await llm.close()
        took_s = time.monotonic() - started
    assert len(server.requests) == 2
    assert 0.6 <= took_s < 5
    assert str(failed.value) == (
        f"the LLM endpoint {server.base_url} (model 'm') sent nothing for 0.3s (2 tries)"
    )


async def test_refusals_are_translated_and_a_bad_key_is_not_worth_a_retry() -> None:
    async with OpenAIServer() as server:
        llm = OpenAICompatibleLLM(base_url=server.base_url, model="m", max_retries=2)
        try:
            server.script.append(Answer(status=401))
            with pytest.raises(LLMMisconfigured, match="MOORLINE_LLM_API_KEY") as refused:
                await complete(llm, [Message.user("hi")])
            server.script.append(Answer(status=404))
            with pytest.raises(LLMMisconfigured, match="MOORLINE_LLM_MODEL"):
                await complete(llm, [Message.user("hi")])
            server.script.append(Answer(status=400))
            with pytest.raises(LLMRejected, match="HTTP 400"):
                await complete(llm, [Message.user("hi")])
        finally:
            await llm.close()
    assert len(server.requests) == 3  # none of them retried
    # A wrong key fails the run at once: the worker does not retry configuration errors.
    assert isinstance(refused.value, ConfigError)
    assert not RetryPolicy().is_retryable(refused.value)


async def test_an_unreachable_endpoint_is_unavailable() -> None:
    llm = OpenAICompatibleLLM(base_url="http://127.0.0.1:9/v1", model="m", max_retries=0)
    try:
        with pytest.raises(LLMUnavailable, match="cannot be reached"):
            await complete(llm, [Message.user("hi")])
    finally:
        await llm.close()
