"""The bundled example app: what ``moorline serve`` and ``moorline worker`` run by default.

Besides ``echo`` and ``sleep`` (smoke tests and benchmarks) it holds the seeds' three
scenarios, each in a module of its own: ``code_review`` (a webhook-triggered pull request
review), ``doc_check`` (a document checked section by section, in child runs) and
``chat_agent`` (a chat that asks permission before a tool call and takes injected
messages). They ask the model of :func:`~moorline.llm.make_llm`: the OpenAI-compatible
endpoint of ``MOORLINE_LLM_BASE_URL``,
or without one the simulated model, built when a workflow first asks it.

Use :func:`build_app` for an app with other settings or another model (tests pass a fast
simulated one); ``app`` is the one ``--app`` names by default.
"""

import asyncio

from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.examples import chat_agent, code_review, doc_check
from moorline.llm import LLM, LazyLLM, make_llm
from moorline.settings import Settings
from moorline.types import JSONObject


def build_app(settings: Settings | None = None, *, llm: LLM | None = None) -> Moorline:
    """A new example app.

    Args:
        settings: The app's settings; None reads ``MOORLINE_*`` variables on first use.
        llm: The model its workflows ask; None for the one the settings name, built on first
            use. The caller of a given model closes it.
    """
    app = Moorline(settings)
    model = llm if llm is not None else LazyLLM(lambda: make_llm(app.settings))

    @app.workflow("echo")
    async def echo(ctx: Context, message: str = "") -> JSONObject:
        """Return the message: the smallest workflow, for smoke tests and benchmarks."""
        return {"message": message, "run_id": ctx.run_id, "attempt": ctx.attempt}

    @app.workflow("sleep", max_attempts=3)
    async def sleep(ctx: Context, seconds: float = 1.0) -> JSONObject:
        """Wait ``seconds`` and return: a stand-in for a slow LLM call."""
        await asyncio.sleep(seconds)
        return {"slept": seconds}

    code_review.register(app, model)
    doc_check.register(app, model)
    chat_agent.register(app, model)
    return app


app = build_app()
