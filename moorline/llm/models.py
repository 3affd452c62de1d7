"""The models file: what each model costs, and the limits its provider declares.

A YAML file (``MOORLINE_MODELS_FILE``, beside the plans file) names models by the name replies
report (``MOORLINE_LLM_MODEL``, ``moorline-simulated``)::

    models:
      gpt-4o-mini:
        input_per_million: 0.15         # price of a million prompt tokens
        output_per_million: 0.60        # price of a million completion tokens
        cached_input_per_million: 0.075 # optional: cached prompt tokens (default: input price)
        rpm: 500                        # optional: requests per minute the provider allows
        tpm: 200000                     # optional: tokens per minute the provider allows

A model the file does not name costs 0 and is still counted. Prices are in whatever currency
the file is written in; Moorline only multiplies and adds. ``rpm``/``tpm`` are read and exposed
(:attr:`ModelEntry.rpm`, :attr:`ModelEntry.tpm`) for the provider rate limiter.

:class:`ModelsProvider` re-reads the file through a TTL cache, as the plans file is
(:class:`~moorline.plans.PlansProvider`): the first read is at construction, so a bad file
fails at start; a file that breaks later is logged and the last good table stays in force.
"""

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from moorline.concurrency import TTLCache, run_in_thread
from moorline.settings import Settings, read_settings_file

DEFAULT_MODELS_TTL_S = 5.0
"""How long a read of the models file is trusted before the file is read again."""

PER_MILLION = 1_000_000
_MODELS_KEY = "models"


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelEntry:
    """One model's prices (per million tokens) and its provider's declared limits.

    Attributes:
        name: The model's name, as replies report it.
        input_per_million: Price of a million prompt tokens that were not cached.
        output_per_million: Price of a million completion tokens.
        cached_input_per_million: Price of a million cached prompt tokens; None charges them
            at ``input_per_million``.
        rpm: Requests per minute the provider allows; None: not declared.
        tpm: Tokens (prompt and completion) per minute the provider allows; None: not declared.
    """

    name: str
    input_per_million: float = 0.0
    output_per_million: float = 0.0
    cached_input_per_million: float | None = None
    rpm: int | None = None
    tpm: int | None = None

    def cost(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> float:
        """What one call cost: cached prompt tokens at their price, the rest at the input's.

        ``cached_tokens`` are part of ``prompt_tokens``, as OpenAI's ``usage`` reports them.
        """
        cached = min(cached_tokens, prompt_tokens)
        cached_price = (
            self.input_per_million
            if self.cached_input_per_million is None
            else self.cached_input_per_million
        )
        return (
            (prompt_tokens - cached) * self.input_per_million
            + cached * cached_price
            + completion_tokens * self.output_per_million
        ) / PER_MILLION


def unpriced(name: str) -> ModelEntry:
    """The entry of a model the file does not name: free, no declared limits."""
    return ModelEntry(name=name)


_Price = Annotated[float, Field(ge=0, allow_inf_nan=False)]
_Limit = Annotated[int, Field(ge=1)]
_ModelName = Annotated[str, Field(min_length=1, max_length=200)]


class ModelSpec(BaseModel):
    """One model as written in the models file; the two prices are required."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input_per_million: _Price
    output_per_million: _Price
    cached_input_per_million: _Price | None = None
    rpm: _Limit | None = None
    tpm: _Limit | None = None


class ModelsFile(BaseModel):
    """The whole models file: ``models:`` mapping names to :class:`ModelSpec`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    models: dict[_ModelName, ModelSpec] = Field(default_factory=dict)


def load_models_file(path: Path) -> dict[str, ModelEntry]:
    """Read and validate a models file.

    Raises:
        ConfigError: the file is missing, is not YAML, or breaks the schema; the message names
            the file and the offending key.
    """
    parsed = read_settings_file(
        path, ModelsFile, kind="models file", setting="MOORLINE_MODELS_FILE"
    )
    return {
        name: ModelEntry(name=name, **spec.model_dump()) for name, spec in parsed.models.items()
    }


def resolve_models(settings: Settings) -> dict[str, ModelEntry]:
    """The models file's table, or an empty one when no file is configured.

    Raises:
        ConfigError: the models file is unreadable or invalid.
    """
    if settings.models_file is None:
        return {}
    return load_models_file(settings.models_file)


class ModelsProvider:
    """The current model table, re-read from the models file through a :class:`TTLCache`.

    Args:
        settings: Supplies ``models_file``.
        ttl_s: Seconds a read stays trusted.
        clock: Monotonic clock, replaceable in tests.

    Raises:
        ConfigError: the models file is unreadable or invalid (at construction).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        ttl_s: float = DEFAULT_MODELS_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._cache: TTLCache[str, Mapping[str, ModelEntry]] = TTLCache(
            self._read, ttl_s=ttl_s, name="models", max_entries=1, clock=clock
        )
        self._cache.put(_MODELS_KEY, MappingProxyType(resolve_models(settings)))

    async def _read(self, _key: str) -> Mapping[str, ModelEntry]:
        return MappingProxyType(await run_in_thread(resolve_models, self._settings))

    async def models(self) -> Mapping[str, ModelEntry]:
        """Every model the file names (read-only), re-reading the file when the TTL passed."""
        return await self._cache.get(_MODELS_KEY)

    async def get(self, name: str) -> ModelEntry:
        """Model ``name``'s entry; a model the file does not name is free (:func:`unpriced`)."""
        return (await self.models()).get(name) or unpriced(name)
