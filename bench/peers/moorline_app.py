"""The Moorline side of the peer workload: a no-op workflow, and one with one checkpointed step.

``moorline serve`` and ``moorline worker`` load it as ``MOORLINE_APP=moorline_app:app`` (the
driver puts this folder on ``PYTHONPATH``); the driver's ``app.submit`` calls go through the same
app object, its settings read from the ``MOORLINE_*`` variables the driver sets.
"""

from moorline import Context, Moorline

app = Moorline()


@app.workflow("noop")
async def noop(ctx: Context) -> None:
    """Does nothing: the run's ``succeeded`` status is its record."""


async def nothing() -> None:
    """The step's function: nothing to compute, so the step costs only its checkpoint."""


@app.workflow("one_step")
async def one_step(ctx: Context) -> None:
    """One checkpointed step (its result committed before the workflow goes on), then done."""
    await ctx.step("nothing", nothing)
