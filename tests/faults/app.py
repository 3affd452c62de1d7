"""Workflows the fault tests run in real worker processes (``--app tests.faults.app:app``)."""

import asyncio
import os

from moorline.engine.context import Context
from moorline.engine.registry import Moorline

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


@app.workflow("kills_its_worker", max_attempts=3)
async def kills_its_worker(ctx: Context) -> None:
    """Takes its whole worker process down, every time."""
    os._exit(17)
