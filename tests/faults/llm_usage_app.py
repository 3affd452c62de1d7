"""The bundled example app plus a chain of model calls, for tests/faults/test_llm_usage.py.

``--app tests.faults.llm_usage_app:app``: the examples (their model is the one
``MOORLINE_LLM_BASE_URL`` names), and ``llm_chain``, several checkpointed model calls one
after another, for a kill -9 to land between.
"""

from moorline.engine.context import Context
from moorline.examples.app import build_app
from moorline.llm import LazyLLM, Message, complete, make_llm
from moorline.types import JSONObject

app = build_app()
llm = LazyLLM(lambda: make_llm(app.settings))


async def ask(prompt: str) -> JSONObject:
    """One model call through ``moorline.llm``."""
    reply = await complete(llm, [Message.system("Answer briefly."), Message.user(prompt)])
    return reply.to_json()


@app.workflow("llm_chain", max_attempts=50)
async def llm_chain(ctx: Context, steps: int = 5, topic: str = "usage") -> dict[str, int]:
    """``steps`` model calls one after another, each a checkpointed step."""
    for n in range(steps):
        await ctx.step(f"llm:{n}", ask, f"{topic}: part {n} of {steps}")
    return {"steps": steps, "attempt": ctx.attempt}
