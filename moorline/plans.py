"""Plans: the policy a tenant's plan gives its runs (lane, priority, quota, limits, caps).

The defaults are docs/design.md's table. A YAML plans file (``MOORLINE_PLANS_FILE``) can replace any
of them and add new ones::

    plans:
      team:
        lane: workflow_team
        priority: 50
        daily_quota: 800
        rate_limit: "10/second"
        tenant_concurrency: 4
        lane_slots: 4
        retention_days: 90     # optional: MOORLINE_RETENTION_DAYS when absent, 0 = for ever
        daily_tokens: 2000000  # optional: model tokens its tenants may spend per UTC day
        daily_cost: 25.0       # optional: model cost (the models file's prices) per UTC day

A plan named in the file replaces the default of that name as a whole (no field-by-field merge:
what the file says is what runs). The community edition routes every plan to the single lane
``workflow``; its worker slots are the sum of the plans' ``lane_slots`` (see
:func:`default_lane_slots`).

:class:`PlansProvider` re-reads the file through a TTL cache (seed 002 §4.1), so request paths
never parse YAML, the loop never waits on the file, and an edited file takes effect within the
TTL without a restart.
"""

import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from moorline.concurrency import TTLCache, run_in_thread
from moorline.errors import ConfigError
from moorline.settings import Edition, Settings, read_settings_file

COMMUNITY_LANE = "workflow"
"""The one lane of the community edition."""

DEFAULT_PLANS_TTL_S = 5.0
"""How long a read of the plans file is trusted before the file is read again (seed 002)."""

RATE_LIMIT_PERIODS_S: Mapping[str, float] = MappingProxyType(
    {"second": 1.0, "minute": 60.0, "hour": 3600.0, "day": 86400.0}
)
_RATE_LIMIT = re.compile(r"^\s*(\d+)\s*/\s*(second|minute|hour|day)\s*$")
_NAME = r"^[A-Za-z0-9_.-]+$"
_PLANS_KEY = "plans"


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A named policy shared by the tenants on it.

    Attributes:
        name: The plan's name, as stored on the tenant.
        lane: The queue its runs go to; each lane has its own worker slots.
        priority: Higher is claimed first within a lane.
        daily_quota: Runs a tenant may start per UTC day.
        rate_limit: API requests allowed per key, ``"<count>/<second|minute|hour|day>"``.
        tenant_concurrency: Runs of one tenant that may be ``running`` at the same time.
        lane_slots: Worker slots this plan brings to its lane (see :func:`default_lane_slots`).
        retention_days: Days its tenants' finished runs are kept (0: for ever); None keeps
            them ``MOORLINE_RETENTION_DAYS``.
        daily_tokens: Model tokens (prompt + completion) a tenant may spend per UTC day;
            None: no token budget (:mod:`moorline.admission.budgets`).
        daily_cost: Model cost, in the unit of the models file's prices, a tenant may spend
            per UTC day; None: no cost budget.
    """

    name: str
    lane: str
    priority: int
    daily_quota: int
    rate_limit: str
    tenant_concurrency: int
    lane_slots: int
    retention_days: float | None = None
    daily_tokens: int | None = None
    daily_cost: float | None = None

    @property
    def has_budget(self) -> bool:
        """Whether the plan limits its tenants' daily model spend at all."""
        return self.daily_tokens is not None or self.daily_cost is not None


def parse_rate_limit(value: str) -> tuple[int, float]:
    """Split ``"20/second"`` into ``(20, 1.0)``: a count and its period in seconds.

    Raises:
        ValueError: the text is not ``<count>/<second|minute|hour|day>`` with a count above 0.
    """
    match = _RATE_LIMIT.match(value)
    if match is None:
        raise ValueError(f"rate limit {value!r} is not '<count>/<second|minute|hour|day>'")
    count = int(match.group(1))
    if count < 1:
        raise ValueError(f"rate limit {value!r} must allow at least 1 request")
    return count, RATE_LIMIT_PERIODS_S[match.group(2)]


DEFAULT_PLANS: Mapping[str, Plan] = MappingProxyType(
    {
        "professional": Plan(
            name="professional",
            lane="workflow_professional",
            priority=100,
            daily_quota=1000,
            rate_limit="20/second",
            tenant_concurrency=8,
            lane_slots=8,
        ),
        "team": Plan(
            name="team",
            lane="workflow_team",
            priority=50,
            daily_quota=500,
            rate_limit="10/second",
            tenant_concurrency=4,
            lane_slots=4,
        ),
        "sandbox": Plan(
            name="sandbox",
            lane="workflow_sandbox",
            priority=10,
            daily_quota=50,
            rate_limit="2/second",
            tenant_concurrency=2,
            lane_slots=2,
        ),
    }
)
"""docs/design.md's plans, cloud edition (one lane per plan)."""


class PlanSpec(BaseModel):
    """One plan as written in the plans file; ``retention_days`` and the budgets are optional."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lane: Annotated[str, Field(min_length=1, max_length=64, pattern=_NAME)]
    priority: int
    daily_quota: Annotated[int, Field(ge=0)]
    rate_limit: str
    tenant_concurrency: Annotated[int, Field(ge=1)]
    lane_slots: Annotated[int, Field(ge=1)]
    retention_days: Annotated[float, Field(ge=0)] | None = None
    daily_tokens: Annotated[int, Field(ge=0)] | None = None
    daily_cost: Annotated[float, Field(ge=0)] | None = None

    @field_validator("rate_limit")
    @classmethod
    def _check_rate_limit(cls, value: str) -> str:
        parse_rate_limit(value)
        return value.strip()


class PlansFile(BaseModel):
    """The whole plans file: ``plans:`` mapping names to :class:`PlanSpec`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    plans: dict[Annotated[str, Field(min_length=1, max_length=64, pattern=_NAME)], PlanSpec] = (
        Field(default_factory=dict)
    )


def load_plans_file(path: Path) -> dict[str, Plan]:
    """Read and validate a plans file; returns only the plans it names.

    Raises:
        ConfigError: the file is missing, is not YAML, or breaks the schema; the message names
            the file and the offending key.
    """
    parsed = read_settings_file(path, PlansFile, kind="plans file", setting="MOORLINE_PLANS_FILE")
    return {
        name: Plan(name=name, **spec.model_dump()) for name, spec in sorted(parsed.plans.items())
    }


def for_edition(plans: Mapping[str, Plan], edition: Edition) -> dict[str, Plan]:
    """The plans as the edition routes them: community sends every plan to ``workflow``."""
    if edition is Edition.COMMUNITY:
        return {name: replace(plan, lane=COMMUNITY_LANE) for name, plan in plans.items()}
    return dict(plans)


def resolve_plans(settings: Settings) -> dict[str, Plan]:
    """Defaults, replaced and extended by the plans file, routed for the edition.

    Raises:
        ConfigError: the plans file is unreadable or invalid.
    """
    plans = dict(DEFAULT_PLANS)
    if settings.plans_file is not None:
        plans.update(load_plans_file(settings.plans_file))
    return for_edition(plans, settings.edition)


def default_lane_slots(plans: Mapping[str, Plan]) -> dict[str, int]:
    """Worker slots per lane: the plans' ``lane_slots``, and one more than any cap routed there.

    Each plan brings its ``lane_slots`` to its lane. Where plans share a lane (the community
    edition's ``workflow``) their slots add up, 14 by default: a community worker keeps the
    capacity of a cloud worker serving all three lanes instead of shrinking to the largest
    lane's. A lane also has at least one slot more than the largest tenant cap of the plans
    routed to it, the fairness floor: with slots equal to a cap (the cloud plans' 8/4/2 alone),
    one tenant running long runs at its cap would hold the whole lane, and every other tenant
    of the plan would wait for them; so the cloud lanes get 9/5/3.
    """
    slots: dict[str, int] = {}
    largest_cap: dict[str, int] = {}
    for plan in plans.values():
        slots[plan.lane] = slots.get(plan.lane, 0) + plan.lane_slots
        largest_cap[plan.lane] = max(largest_cap.get(plan.lane, 0), plan.tenant_concurrency)
    return {lane: max(count, largest_cap[lane] + 1) for lane, count in slots.items()}


def retention_days(plans: Mapping[str, Plan], settings: Settings) -> dict[str, float]:
    """Plan name → days its tenants' finished runs are kept (0: for ever).

    A plan without ``retention_days`` keeps them ``MOORLINE_RETENTION_DAYS``; so do tenants
    whose plan the configuration lacks.
    """
    return {
        name: settings.retention_days if plan.retention_days is None else plan.retention_days
        for name, plan in plans.items()
    }


def tenant_caps(plans: Mapping[str, Plan]) -> dict[str, int]:
    """Plan name → tenant concurrency cap, the shape the claim statement takes."""
    return {name: plan.tenant_concurrency for name, plan in plans.items()}


class PlansProvider:
    """The current plans, re-read from the plans file through a :class:`TTLCache`.

    The first read happens at construction, so a broken file fails at start. Later reads run
    in a thread (:func:`run_in_thread`), at most one at a time and once per TTL, while callers
    keep getting the plans already read. A file that breaks later is logged and the last good
    plans stay in force for another TTL: a typo in a live edit must not stop workers that are
    already running.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        ttl_s: float = DEFAULT_PLANS_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Read the plans once.

        Args:
            settings: Supplies ``plans_file`` and ``edition``.
            ttl_s: Seconds a read stays trusted.
            clock: Monotonic clock, replaceable in tests.

        Raises:
            ConfigError: the plans file is unreadable or invalid.
        """
        self._settings = settings
        self._cache: TTLCache[str, Mapping[str, Plan]] = TTLCache(
            self._read, ttl_s=ttl_s, name="plans", max_entries=1, clock=clock
        )
        self._cache.put(_PLANS_KEY, MappingProxyType(resolve_plans(settings)))

    async def _read(self, _key: str) -> Mapping[str, Plan]:
        return MappingProxyType(await run_in_thread(resolve_plans, self._settings))

    async def plans(self) -> Mapping[str, Plan]:
        """All plans by name (read-only), re-reading the file when the TTL has passed."""
        return await self._cache.get(_PLANS_KEY)

    async def get(self, name: str) -> Plan:
        """The plan called ``name``.

        Raises:
            ConfigError: no such plan (a tenant refers to a plan the configuration lacks).
        """
        plans = await self.plans()
        try:
            return plans[name]
        except KeyError:
            known = ", ".join(sorted(plans))
            raise ConfigError(f"unknown plan {name!r} (known plans: {known})") from None

    async def lane_slots(self) -> dict[str, int]:
        """Worker slots per lane for the current plans (see :func:`default_lane_slots`)."""
        return default_lane_slots(await self.plans())

    async def tenant_caps(self) -> dict[str, int]:
        """Plan name → tenant concurrency cap for the current plans."""
        return tenant_caps(await self.plans())

    async def retention_days(self) -> dict[str, float]:
        """Plan name → days finished runs are kept, for the current plans."""
        return retention_days(await self.plans(), self._settings)
