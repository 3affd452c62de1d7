"""The soak's workflow (``--app tests.soak.app:app``): checkpointed steps that log each execution.

Every time a step's function actually runs (not when its checkpoint is replayed) it appends
``<run id> <step key> <attempt> <pid>`` to the file named by ``MOORLINE_SOAK_LOG``, with one
``write`` on an ``O_APPEND`` descriptor, so lines from concurrent processes never interleave and
a process killed mid-run leaves whole lines. The history checker compares these executions with
the checkpoints in the ``steps`` table: a step that ran again after its checkpoint was written
breaks the exactly-once recording guarantee.
"""

import asyncio
import os
from contextvars import ContextVar

from moorline.engine.context import Context
from moorline.engine.registry import Moorline

app = Moorline()

_CONTEXT: ContextVar[Context] = ContextVar("soak_context")
"""The running attempt's context, for the step function (which gets no ``ctx``).

Passing the attempt as a step argument would change the step's call hash between attempts.
"""


def log_execution(ctx: Context) -> None:
    """Append one line for this execution of the current step (no-op without the setting)."""
    path = os.environ.get("MOORLINE_SOAK_LOG")
    if not path:
        return
    run_id, key = ctx.idempotency_key().split(":", 1)
    line = f"{run_id} {key} {ctx.attempt} {os.getpid()}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


async def work(index: int, seconds: float) -> int:
    """A step's stand-in work (an LLM call): logged, then a short wait."""
    log_execution(_CONTEXT.get())
    await asyncio.sleep(seconds)
    return index


@app.workflow("soak", max_attempts=100)
async def soak(ctx: Context, steps: int = 3, step_s: float = 0.2) -> dict[str, int]:
    """``steps`` checkpointed steps of ``step_s`` seconds each."""
    _CONTEXT.set(ctx)
    total = 0
    for index in range(steps):
        total += int(await ctx.step(f"s{index}", work, index, step_s))  # type: ignore[arg-type]
    return {"total": total, "attempt": ctx.attempt}
