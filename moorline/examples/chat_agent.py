"""``chat_agent``: a conversation with a model that may call a tool, each call approved first.

Seed 000's agent loop. The run starts with the user's first message; every turn then

1. takes the messages injected into the run (``POST /v1/runs/{id}/messages``): after the
   first turn it waits up to ``idle_timeout`` seconds for one with ``ctx.wait_for_message``
   (parked, holding no worker slot, once the wait passes ``MOORLINE_PARK_AFTER``), then
   drains the others with ``ctx.drain_messages()``. Every wait and drain is a checkpoint of
   its own (the n-th of a replay returns what the n-th returned), so neither may be wrapped
   in a step: a replay would skip the ones inside the step and renumber the later ones;
2. ends the run when a message says "bye" (or "goodbye");
3. asks the model for a reply in the step ``llm:<turn>``, streaming it as ``delta`` events
   tagged with the turn. When the reply calls a tool, the agent asks permission (the action is
   the tool's name, the data its arguments), runs the tool in a step of its own if approved,
   and gives the model the result, or the refusal, for another reply
   (``llm:<turn>.<round>``), at most :data:`MAX_TOOL_ROUNDS` times a turn.

The run ends after ``max_turns`` replies, on "bye", or when no message came within
``idle_timeout``, and returns the transcript.

The one tool, ``create_ticket``, is simulated: it files nothing, but shows how a side effect
uses ``ctx.idempotency_key()`` — the ticket's id derives from it, so a step repeated after a
crash refers to the same ticket — and emits ``ticket_created``.
"""

import hashlib
import json
import re
from collections.abc import Awaitable, Callable
from typing import Annotated

from pydantic import Field, StringConstraints

from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.llm import LLM, Message, Reply, Tool, ToolCall, complete
from moorline.types import JSONObject, JSONValue

MAX_TOOL_ROUNDS = 3
"""Replies with tool calls one turn may have; the reply after the last round offers no tools."""

SYSTEM_PROMPT = (
    "You are a helpful assistant in a team chat. Answer briefly. When the user asks for a "
    "ticket to be filed, call the create_ticket tool with a short title; a person approves "
    "every call, so tell the user when one was refused."
)

CREATE_TICKET = Tool(
    name="create_ticket",
    description="File a ticket in the team's tracker (simulated: nothing leaves Moorline).",
    parameters={
        "type": "object",
        "properties": {"title": {"type": "string", "description": "The ticket's title."}},
        "required": ["title"],
    },
)

_GOODBYE = re.compile(r"\b(good)?bye\b", re.IGNORECASE)

Text = Annotated[str, StringConstraints(min_length=1, max_length=10_000)]


def says_goodbye(text: str) -> bool:
    """Whether ``text`` ends the conversation: it says "bye" or "goodbye"."""
    return _GOODBYE.search(text) is not None


class Chat:
    """One attempt of a ``chat_agent`` run: the conversation so far and how to continue it."""

    def __init__(self, ctx: Context, llm: LLM, first_message: str) -> None:
        self.ctx = ctx
        self.llm = llm
        self.history = [Message.system(SYSTEM_PROMPT), Message.user(first_message)]
        self.transcript: list[JSONValue] = [{"role": "user", "content": first_message}]
        self.tool_calls: list[JSONValue] = []
        self.model = llm.model
        self.simulated = llm.simulated
        self.tools: dict[str, Callable[[JSONObject], Awaitable[JSONObject]]] = {
            CREATE_TICKET.name: self.create_ticket
        }

    # --- steps (their arguments and results are JSON, as checkpoints are) ---------------------

    async def collect_messages(self, wait_s: float) -> list[str]:
        """The injected messages; with ``wait_s``, wait that long for the first one.

        The wait is ``ctx.wait_for_message``: a user who takes minutes to answer costs no
        worker slot (the run parks), and a message posted meanwhile resumes it.
        """
        if wait_s <= 0:
            return await self.ctx.drain_messages()
        first = await self.ctx.wait_for_message(timeout=wait_s)
        if first is None:
            return []
        return [first, *await self.ctx.drain_messages()]

    async def ask(self, messages: list[JSONValue], offer_tools: bool, turn: int) -> JSONObject:
        """The model's reply to ``messages``, streamed as ``delta`` events of ``turn``."""
        reply = await complete(
            self.llm,
            [Message.from_json(message) for message in messages],
            tools=[CREATE_TICKET] if offer_tools else [],
            emit=self.ctx.emit,
            extra={"turn": turn},
        )
        return reply.to_json()

    async def run_tool(self, call: JSONObject) -> JSONObject:
        """Run an approved tool call; a call the tool cannot take answers with an error."""
        parsed = ToolCall.from_json(call)
        return await self.tools[parsed.name](parsed.arguments)

    async def create_ticket(self, arguments: JSONObject) -> JSONObject:
        title = arguments.get("title")
        if not isinstance(title, str) or not title.strip():
            return {"error": "create_ticket needs a non-empty string 'title'"}
        key = self.ctx.idempotency_key()
        ticket = "TICKET-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:8].upper()
        created: JSONObject = {"ticket": ticket, "title": title.strip(), "idempotency_key": key}
        await self.ctx.emit("ticket_created", created)
        return created

    # --- the loop -------------------------------------------------------------------------------

    async def converse(self, max_turns: int, idle_timeout_s: float) -> JSONObject:
        """Reply turn after turn until "bye", ``max_turns`` replies, or an idle timeout."""
        if says_goodbye(self.history[-1].content):
            return self.ended("bye", 0)
        for turn in range(1, max_turns + 1):
            waiting = turn > 1  # the first message is there already; later ones may take time
            messages = await self.collect_messages(idle_timeout_s if waiting else 0.0)
            if waiting and not messages:
                return self.ended("idle_timeout", turn - 1)
            for text in messages:
                self.history.append(Message.user(text))
                self.transcript.append({"role": "user", "content": text})
            if any(says_goodbye(text) for text in messages):
                return self.ended("bye", turn - 1)
            await self.reply(turn)
        return self.ended("max_turns", max_turns)

    async def reply(self, turn: int) -> None:
        """Answer the last messages; run the tools the model calls, each one approved first."""
        for round_ in range(MAX_TOOL_ROUNDS + 1):
            key = f"llm:{turn}" if round_ == 0 else f"llm:{turn}.{round_}"
            history = [message.to_json() for message in self.history]
            offer_tools = round_ < MAX_TOOL_ROUNDS
            reply = Reply.from_json(await self.ctx.step(key, self.ask, history, offer_tools, turn))
            self.model, self.simulated = reply.model, reply.simulated
            self.history.append(reply.to_message())
            if reply.text:
                self.transcript.append({"role": "assistant", "content": reply.text})
            if not reply.tool_calls:
                return
            for index, call in enumerate(reply.tool_calls):
                result = await self.call_tool(f"tool:{turn}.{round_}.{index}", call)
                self.history.append(Message.tool_result(call, json.dumps(result)))

    async def call_tool(self, key: str, call: ToolCall) -> JSONObject:
        """Ask permission for ``call``, then run it in step ``key``; the result, or why not."""
        record: JSONObject = {"tool": call.name, "arguments": call.arguments}
        if call.name not in self.tools:
            result: JSONObject = {"error": f"there is no tool named {call.name!r}"}
        else:
            decision = await self.ctx.request_permission(call.name, record)
            record.update(approved=decision.approved, decision=decision.reason)
            if decision.approved:
                stored = await self.ctx.step(key, self.run_tool, call.to_json())
                result = stored if isinstance(stored, dict) else {"result": stored}
            else:
                result = {"error": f"the user did not allow this call ({decision.reason})"}
        self.tool_calls.append({**record, "result": result})
        return result

    def ended(self, reason: str, turns: int) -> JSONObject:
        return {
            "ended": reason,
            "turns": turns,
            "transcript": self.transcript,
            "tool_calls": self.tool_calls,
            "model": self.model,
            "simulated": self.simulated,
        }


def register(app: Moorline, llm: LLM) -> None:
    """Register ``chat_agent`` on ``app``, asking ``llm``."""

    @app.workflow("chat_agent", timeout=3600)
    async def chat_agent(
        ctx: Context,
        message: Text,
        max_turns: Annotated[int, Field(ge=1, le=50)] = 10,
        idle_timeout: Annotated[float, Field(gt=0, le=1800)] = 300.0,
    ) -> JSONObject:
        """Chat with the user, from ``message`` on, through messages injected into the run."""
        return await Chat(ctx, llm, message).converse(max_turns, idle_timeout)
