"""Workflows with child runs, for the child fault tests (``--app tests.faults.children_app:app``).

``fan`` starts ``count`` ``leaf`` children one by one, checkpointing a slow ``mark`` step after
each start (so a kill lands between a child's start and the parent's next checkpoint), then
gathers them. A ``leaf`` runs ``steps`` short steps, each writing one line to the effects file
before it returns (the side effect a real step leaves), so a cancel is seen at a boundary
every ``step_s`` and the tests can tell which attempt of which child did what.
"""

import asyncio

from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.types import JSONObject, JSONValue
from tests.faults.suspension_app import write_effect

app = Moorline()

MAX_ATTEMPTS = 20
"""Kills cost attempts (a reclaim counts): room for every kill."""


@app.workflow("leaf", max_attempts=MAX_ATTEMPTS)
async def leaf(
    ctx: Context, effects: str, index: int, steps: int = 1, step_s: float = 0.2
) -> JSONObject:
    """``steps`` steps of ``step_s`` seconds each; returns its index and the attempt that ended."""

    async def work(key: str) -> None:
        write_effect(effects, {"run": ctx.run_id, "attempt": ctx.attempt, "key": key})
        await asyncio.sleep(step_s)

    for number in range(steps):
        await ctx.step(f"work:{number}", work, f"work:{number}")
    return {"index": index}


@app.workflow("fan", max_attempts=MAX_ATTEMPTS)
async def fan(
    ctx: Context,
    effects: str,
    count: int,
    steps: int = 1,
    step_s: float = 0.2,
    mark_s: float = 0.0,
) -> list[JSONValue]:
    """Start ``count`` leaves (a ``mark`` checkpoint after each), then join them all."""

    async def mark(key: str) -> None:
        write_effect(effects, {"run": ctx.run_id, "attempt": ctx.attempt, "key": key})
        await asyncio.sleep(mark_s)

    handles = []
    for index in range(count):
        child: JSONObject = {"effects": effects, "index": index, "steps": steps, "step_s": step_s}
        handles.append(await ctx.start_child("leaf", child, key=f"leaf:{index}"))
        if mark_s:
            await ctx.step(f"mark:{index}", mark, f"mark:{index}")
    return await ctx.gather(*handles)
