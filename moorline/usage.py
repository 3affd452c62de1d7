"""LLM usage as values: one call's tokens, and the per-model totals steps, runs and days keep.

Below every layer that counts (the models report :class:`Usage`, the engine sums and prices
it, the database stores :class:`ModelTotals` as JSON and in counters), so none of them
imports another for it. Collecting a step's calls is :mod:`moorline.llm.usage`.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from moorline.types import JSONObject


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    """One model call's tokens, as the provider reported them.

    Attributes:
        model: The model asked (the name the models file prices).
        prompt_tokens: Input tokens, cached ones included.
        completion_tokens: Output tokens.
        cached_tokens: Input tokens the provider served from its prompt cache.
        ok: Whether the call returned a whole reply (False: it failed or was left early).
    """

    model: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ok: bool = True

    @property
    def tokens(self) -> int:
        """Prompt and completion tokens: what budgets and provider limits count."""
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True, kw_only=True)
class ModelTotals:
    """The sums of one model's calls (a step's, a run's, a tenant's day)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    requests: int = 0
    failed_requests: int = 0
    cost: float = 0.0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def add(self, other: "ModelTotals") -> None:
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.cached_tokens += other.cached_tokens
        self.requests += other.requests
        self.failed_requests += other.failed_requests
        self.cost += other.cost

    def to_json(self) -> JSONObject:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "requests": self.requests,
            "failed_requests": self.failed_requests,
            "cost": self.cost,
        }

    @classmethod
    def from_json(cls, data: object) -> "ModelTotals":
        """Read what :meth:`to_json` wrote; a missing or odd field counts 0."""
        values = data if isinstance(data, dict) else {}

        def number(name: str) -> int:
            value = values.get(name, 0)
            return value if isinstance(value, int) and not isinstance(value, bool) else 0

        cost = values.get("cost", 0.0)
        return cls(
            prompt_tokens=number("prompt_tokens"),
            completion_tokens=number("completion_tokens"),
            cached_tokens=number("cached_tokens"),
            requests=number("requests"),
            failed_requests=number("failed_requests"),
            cost=float(cost) if isinstance(cost, int | float) else 0.0,
        )


StepUsage = dict[str, ModelTotals]
"""Model name → its totals: what a step stores (``steps.usage``)."""


def by_model(calls: Sequence[Usage]) -> StepUsage:
    """The calls summed per model, without cost (the engine prices them)."""
    totals: StepUsage = {}
    for call in calls:
        entry = totals.setdefault(call.model, ModelTotals())
        entry.prompt_tokens += call.prompt_tokens
        entry.completion_tokens += call.completion_tokens
        entry.cached_tokens += call.cached_tokens
        entry.requests += 1
        entry.failed_requests += 0 if call.ok else 1
    return totals


def usage_to_json(usage: StepUsage) -> JSONObject:
    """A step's usage as stored: ``{model: totals}``, models sorted."""
    return {model: totals.to_json() for model, totals in sorted(usage.items())}


def usage_from_json(data: object) -> StepUsage:
    """A step's stored usage; anything but an object of objects is no usage."""
    if not isinstance(data, dict):
        return {}
    return {str(model): ModelTotals.from_json(totals) for model, totals in data.items()}
