"""LLM usage of a run's steps: ``ctx.record_usage``, pricing, and what replays saved.

Model calls made inside a step are collected by :func:`moorline.llm.usage.metering` (the
context opens it around the step's function); when the step ends they are summed per model,
priced from the models file (:class:`~moorline.llm.models.ModelsProvider`) and written with
the step's checkpoint. A step replayed from its checkpoint calls no model: its recorded usage
is what the replay saved, noted in memory and written once per attempt (before the attempt's
first step that runs, and when the workflow ends), not once per replayed step.

Every replay counts, a parked run's resume included: each is a model call not made again.

``Metering`` is a base class of :class:`~moorline.engine.context.Context`, one concept of it
kept in its own module.
"""

from collections.abc import Coroutine
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

from moorline.db.repos.records import Fence, Run
from moorline.db.repos.usage import Charge, UsageRepo
from moorline.errors import MoorlineError
from moorline.llm.models import ModelsProvider, unpriced
from moorline.llm.usage import Usage, report
from moorline.types import RunId, TenantId
from moorline.usage import ModelTotals, StepUsage, by_model

T = TypeVar("T")


class NotInStep(MoorlineError):
    """``ctx.idempotency_key()`` or ``ctx.record_usage()`` was called outside ``ctx.step``."""

    code = "not_in_step"


# The step running in this task (or in the thread a sync step runs in): (run id, step key).
CURRENT_STEP: ContextVar[tuple[RunId, str] | None] = ContextVar(
    "moorline_current_step", default=None
)


class Metering:
    """``ctx.record_usage`` and the accounting of the context's steps (module docstring)."""

    _fence: Fence
    _run: Run
    _models: ModelsProvider | None
    _usage: UsageRepo | None
    _saved: StepUsage

    if TYPE_CHECKING:
        # Provided by the class this is mixed into; declared for the type checker only.
        @property
        def run_id(self) -> RunId: ...

        @property
        def tenant_id(self) -> TenantId: ...

        async def _fenced(self, write: Coroutine[Any, Any, T]) -> T: ...

    def record_usage(
        self, model: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> None:
        """Count a model call made by other means than :mod:`moorline.llm`.

        Call it inside the step that made the call: the usage is stored with that step's
        checkpoint, so it is counted once and a replay of the step counts it as saved.

        Raises:
            NotInStep: Called outside ``ctx.step`` (the usage would have nowhere durable to go,
                and a replay would count the call again).
            ValueError: A negative count, or more cached tokens than prompt tokens.
        """
        if min(prompt_tokens, completion_tokens, cached_tokens) < 0 or (
            cached_tokens > prompt_tokens
        ):
            raise ValueError(
                "ctx.record_usage: token counts must not be negative, and cached tokens are "
                "part of the prompt tokens"
            )
        current = CURRENT_STEP.get()
        usage = Usage(
            model=model,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached_tokens,
        )
        if current is None or current[0] != self.run_id or not report(usage):
            raise NotInStep(
                "ctx.record_usage() is only available inside a step (ctx.step): call it in "
                "the step that called the model"
            )

    async def flush_saved(self) -> None:
        """Write what this attempt's replays saved, if anything (one fenced write).

        Called before the attempt's first step that runs, and by the runner when the workflow
        ends: an attempt that replays many steps writes once, not once per step.
        """
        saved, self._saved = self._saved, {}
        if saved and self._usage is not None:
            charge = Charge(tenant_id=self.tenant_id, workflow=self._run.workflow, saved=saved)
            await self._fenced(self._usage.add_saved(self._fence, charge))

    def _note_saved(self, usage: StepUsage) -> None:
        for model, totals in usage.items():
            self._saved.setdefault(model, ModelTotals()).add(totals)

    async def _charge(self, calls: list[Usage]) -> Charge | None:
        """The step's calls summed per model and priced by the models file (None: no call)."""
        if not calls:
            return None
        spent = by_model(calls)
        for model, totals in spent.items():
            entry = unpriced(model) if self._models is None else await self._models.get(model)
            totals.cost = entry.cost(
                totals.prompt_tokens, totals.completion_tokens, totals.cached_tokens
            )
        return Charge(tenant_id=self.tenant_id, workflow=self._run.workflow, spent=spent)
