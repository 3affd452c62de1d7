"""Build the model the settings ask for, and build it no earlier than its first use."""

from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing

from moorline.llm.base import LLM, Message, Tool, ToolCall
from moorline.llm.simulated import SimulatedLLM
from moorline.settings import Settings


def make_llm(settings: Settings) -> LLM:
    """The OpenAI-compatible endpoint of ``MOORLINE_LLM_BASE_URL``, else the simulated model.

    The endpoint is asked for ``MOORLINE_LLM_MODEL`` with ``MOORLINE_LLM_API_KEY``, with the
    client's default timeout and retries. The caller owns the model and closes it
    (:meth:`LLM.close`).
    """
    if settings.llm_base_url:
        # Imported here so that the simulated default works without the openai package.
        from moorline.llm.openai_compat import OpenAICompatibleLLM

        key = settings.llm_api_key
        return OpenAICompatibleLLM(
            base_url=settings.llm_base_url,
            model=settings.llm_model,
            api_key=None if key is None else key.get_secret_value(),
        )
    return SimulatedLLM()


class LazyLLM(LLM):
    """A model built by ``build`` on first use, then kept.

    An app's workflows are imported by processes that never ask a model (the API imports them
    to validate inputs), and an app reads its settings on first use: building the model only
    when a workflow first needs it keeps both true.

    Args:
        build: Makes the model, e.g. ``lambda: make_llm(app.settings)``.
    """

    def __init__(self, build: Callable[[], LLM]) -> None:
        self._build = build
        self._llm: LLM | None = None

    @property
    def built(self) -> LLM:
        """The model, built now if it was not yet."""
        if self._llm is None:
            self._llm = self._build()
        return self._llm

    @property
    def model(self) -> str:
        return self.built.model

    @property
    def simulated(self) -> bool:
        return self.built.simulated

    async def stream(
        self, messages: Sequence[Message], *, tools: Sequence[Tool] = ()
    ) -> AsyncGenerator[str | ToolCall, None]:
        async with aclosing(self.built.stream(messages, tools=tools)) as inner:
            async for item in inner:
                yield item

    async def close(self) -> None:
        """Close the model if it was built; a later use builds a new one."""
        llm, self._llm = self._llm, None
        if llm is not None:
            await llm.close()
