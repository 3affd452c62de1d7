"""The workflows the end-to-end tests run in a real ``moorline worker`` process.

Small and deterministic: each one exercises one path a client drives (events, a permission,
a cancel, injected messages, a failure), without the example app's simulated model latency.
"""

import asyncio

from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.settings import Settings
from moorline.types import JSONObject, JSONValue

POLL_S = 0.05
"""How often a waiting workflow looks for messages (each look is a cancel check too)."""

app = Moorline(Settings())


@app.workflow("greet")
async def greet(ctx: Context, name: str) -> JSONObject:
    """Stream a greeting as two deltas, in a step, and return it."""

    async def say() -> str:
        for part in ("hello, ", name):
            await ctx.emit("delta", {"text": part})
        return f"hello, {name}"

    return {"greeting": await ctx.step("say", say)}


@app.workflow("deploy")
async def deploy(ctx: Context, target: str) -> JSONObject:
    """Ask permission to deploy; return whether it was given."""
    decision = await ctx.request_permission("deploy", {"target": target}, timeout=60)
    return {"deployed": decision.approved, "reason": decision.reason}


@app.workflow("wait")
async def wait(ctx: Context) -> JSONObject:
    """Wait for any message (a cancel ends the wait at the next drain)."""
    # Messages come only by draining (no wake-up to wait on): poll, as chat_agent does.
    while not (messages := await ctx.drain_messages()):  # noqa: ASYNC110
        await asyncio.sleep(POLL_S)
    received: list[JSONValue] = [*messages]
    return {"messages": received}


@app.workflow("chat")
async def chat(ctx: Context) -> JSONObject:
    """Answer each injected message with a delta until one says "bye"."""
    transcript: list[JSONValue] = []
    await ctx.emit("ready", {})
    while True:
        for message in await ctx.drain_messages():
            transcript.append(message)
            await ctx.emit("delta", {"text": f"you said: {message}\n"})
            if message == "bye":
                return {"transcript": transcript}
        await asyncio.sleep(POLL_S)


@app.workflow("fan")
async def fan(ctx: Context, children: int) -> JSONObject:
    """Greet ``children`` names, each in a child run, and join them."""
    greetings = await ctx.map("greet", [{"name": f"c{n}"} for n in range(children)], key="g")
    return {"greeted": len(greetings)}


@app.workflow("explode", max_attempts=1)
async def explode(ctx: Context) -> JSONObject:
    """Fail at once, and for good."""
    raise RuntimeError("boom")


@app.workflow("publish")
async def publish(ctx: Context, draft: str) -> JSONObject:
    """Ask to publish ``draft``; return what the approver sent back (an edited draft, say)."""
    decision = await ctx.request_permission("publish", {"draft": draft}, timeout=60)
    return {"approved": decision.approved, "data": decision.data}
