"""Workflows that park, for the suspension fault tests (``--app tests.faults.suspension_app:app``).

Every step writes one line to an effects file outside the database (``effects``) before it
returns: what a real side effect (a posted comment, a sent mail) would leave behind. The tests
compare those lines with the steps' checkpoints to prove that no step ran again after its
checkpoint, whatever process was killed when.
"""

import asyncio
import json
import os

from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.types import JSONObject, JSONValue

app = Moorline()

MAX_ATTEMPTS = 20
"""Kills cost attempts (a reclaim counts, a resumption does not): room for every kill."""


def write_effect(path: str, line: JSONObject) -> None:
    """Append ``line`` with one ``write`` on an ``O_APPEND`` descriptor: whole lines only."""
    data = (json.dumps(line) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


@app.workflow("parks", max_attempts=MAX_ATTEMPTS)
async def parks(
    ctx: Context,
    effects: str,
    ask: bool = True,
    timeout_s: float = 300.0,
    sleep_s: float = 0.0,
    act_s: float = 0.0,
) -> JSONObject:
    """A step, a permission (parks), a step acting on it, a durable sleep (parks), a step.

    Args:
        effects: The effects file.
        ask: Whether to ask for a permission.
        timeout_s: The permission's timeout in seconds.
        sleep_s: The durable sleep after the decision; 0 sleeps not at all.
        act_s: How long the step acting on the decision takes, so a kill can land in it.
    """

    async def effect(key: str, value: JSONValue) -> JSONValue:
        write_effect(
            effects, {"run": ctx.run_id, "attempt": ctx.attempt, "key": key, "value": value}
        )
        if key == "act" and act_s:
            await asyncio.sleep(act_s)
        return value

    await ctx.step("prepare", effect, "prepare", None)
    output: JSONObject = {"approved": None, "reason": None, "data": None}
    if ask:
        decision = await ctx.request_permission("ship", {"run": ctx.run_id}, timeout=timeout_s)
        await ctx.step("act", effect, "act", decision.approved)
        output = {"approved": decision.approved, "reason": decision.reason, "data": decision.data}
    if sleep_s:
        await ctx.sleep(sleep_s)
    await ctx.step("finish", effect, "finish", None)
    return output
