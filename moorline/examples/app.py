"""The bundled example app: what ``moorline serve`` and ``moorline worker`` run by default."""

import asyncio

from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.types import JSONObject

app = Moorline()


@app.workflow("echo")
async def echo(ctx: Context, message: str = "") -> JSONObject:
    """Return the message: the smallest workflow, for smoke tests and benchmarks."""
    return {"message": message, "run_id": ctx.run_id, "attempt": ctx.attempt}


@app.workflow("sleep", max_attempts=3)
async def sleep(ctx: Context, seconds: float = 1.0) -> JSONObject:
    """Wait ``seconds`` and return: a stand-in for a slow LLM call."""
    await asyncio.sleep(seconds)
    return {"slept": seconds}
