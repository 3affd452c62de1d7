"""Workflows the fault tests run in real worker processes (``--app tests.faults.app:app``)."""

import asyncio
import os

from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.types import JSONObject

app = Moorline()


@app.workflow("work", max_attempts=50)
async def work(ctx: Context, seconds: float = 1.0) -> dict[str, int]:
    """A multi-second run: a stand-in for an LLM call."""
    await asyncio.sleep(seconds)
    return {"attempt": ctx.attempt}


@app.workflow("first_attempt_hangs", max_attempts=5)
async def first_attempt_hangs(ctx: Context, seconds: float = 30.0) -> dict[str, int]:
    """Slow on its first attempt only, so a successor finishes it quickly."""
    if ctx.attempt == 1:
        await asyncio.sleep(seconds)
    return {"attempt": ctx.attempt}


@app.workflow("chat", max_attempts=50)
async def chat(ctx: Context, expected: int) -> dict[str, list[str]]:
    """Takes injected messages until ``expected`` arrived; returns them in the order drained.

    Every drain is a checkpoint (a write), so an idle chat pauses between drains, as an agent
    does between turns.
    """
    received: list[str] = []
    while len(received) < expected:
        batch = await ctx.drain_messages()
        received += batch
        if not batch:
            await asyncio.sleep(0.1)
    return {"received": received}


@app.workflow("kills_its_worker", max_attempts=3)
async def kills_its_worker(ctx: Context) -> None:
    """Takes its whole worker process down, every time."""
    os._exit(17)


async def pause(seconds: float) -> float:
    """A step's stand-in work."""
    await asyncio.sleep(seconds)
    return seconds


def echo(value: bool) -> bool:
    return value


@app.workflow("cancel_target", max_attempts=50)
async def cancel_target(
    ctx: Context, steps: int = 60, step_s: float = 0.4, ask_at: int = -1
) -> dict[str, int]:
    """Many short checkpointed steps, with a permission wait before step ``ask_at``."""
    for i in range(steps):
        if i == ask_at:
            await ctx.request_permission("go on", {"step": i}, timeout=120)
        await ctx.step(f"s{i}", pause, step_s)
    return {"attempt": ctx.attempt}


@app.workflow("approve_then_act", max_attempts=5)
async def approve_then_act(ctx: Context) -> JSONObject:
    """A step, a permission request, and a step that acts on the decision."""
    await ctx.step("prepare", pause, 0.01)
    decision = await ctx.request_permission("deploy", {"env": "prod"}, timeout=120)
    acted = await ctx.step("act", echo, decision.approved)
    return {
        "approved": decision.approved,
        "reason": decision.reason,
        "data": decision.data,
        "acted": acted,
        "attempt": ctx.attempt,
    }
