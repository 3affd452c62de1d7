"""``GET /v1/usage``: the caller's daily quota and LLM usage today; the run page's usage.

The quota comes straight from the counters admission uses; the LLM usage from ``llm_usage``,
which the workers add to in the transactions of the step checkpoints that count it.
"""

from collections.abc import Iterable

from fastapi import APIRouter

from moorline.api.deps import CallerDep, ServicesDep
from moorline.api.errors import responses
from moorline.api.schemas import ModelUsageOut, RunUsageOut, UsageOut, UsageTotalsOut
from moorline.db.repos.records import Run, Step
from moorline.db.repos.usage import UsageRow, utc_day
from moorline.errors import RateLimited, Unauthorized
from moorline.usage import ModelTotals, StepUsage


def model_usage_out(totals: ModelTotals) -> ModelUsageOut:
    """One model's totals as the API shows them."""
    return ModelUsageOut(**totals.to_json())


def step_usage_out(usage: StepUsage) -> dict[str, ModelUsageOut] | None:
    """A step's usage by model; None for a step that made no model call."""
    return {model: model_usage_out(totals) for model, totals in usage.items()} or None


def run_usage_out(run: Run, steps: Iterable[Step]) -> RunUsageOut:
    """A run's totals (its counters) and their split by model (the sum of its steps')."""
    by_model: StepUsage = {}
    for step in steps:
        for model, totals in step.usage.items():
            by_model.setdefault(model, ModelTotals()).add(totals)
    return RunUsageOut(
        prompt_tokens=run.prompt_tokens,
        completion_tokens=run.completion_tokens,
        cached_tokens=run.cached_tokens,
        cost=run.cost,
        saved_tokens=run.saved_tokens,
        saved_cost=run.saved_cost,
        by_model={model: model_usage_out(by_model[model]) for model in sorted(by_model)},
    )


def _grouped(rows: Iterable[UsageRow], by_model: bool) -> dict[str, UsageTotalsOut]:
    totals: dict[str, tuple[ModelTotals, list[float]]] = {}
    for row in rows:
        name = row.model if by_model else row.workflow
        entry, saved = totals.setdefault(name, (ModelTotals(), [0, 0.0]))
        entry.add(row.totals)
        saved[0] += row.saved_tokens
        saved[1] += row.saved_cost
    return {
        name: UsageTotalsOut(
            **entry.to_json(),
            saved_tokens=int(saved[0]),
            saved_cost=saved[1],
        )
        for name, (entry, saved) in sorted(totals.items())
    }


async def usage(caller: CallerDep, services: ServicesDep) -> UsageOut:
    """The tenant's quota today, and its model calls' tokens and cost today (UTC)."""
    tenant_id = caller.tenant.tenant_id
    current = await services.admission.usage(tenant_id, caller.plan)
    rows = await services.usage.tenant_day(tenant_id, utc_day())
    return UsageOut(
        tenant_id=tenant_id,
        tenant_name=caller.tenant.name,
        plan=caller.plan.name,
        daily_quota=current.daily_quota,
        used_today=current.used_today,
        remaining=current.remaining,
        resets_at=current.resets_at,
        tokens_today=sum(row.totals.tokens for row in rows),
        cost_today=sum(row.totals.cost for row in rows),
        saved_tokens_today=sum(row.saved_tokens for row in rows),
        saved_cost_today=sum(row.saved_cost for row in rows),
        by_model=_grouped(rows, by_model=True),
        by_workflow=_grouped(rows, by_model=False),
    )


def build_router() -> APIRouter:
    """A new router with the usage route."""
    router = APIRouter(prefix="/v1", tags=["usage"])
    router.add_api_route(
        "/usage",
        usage,
        methods=["GET"],
        responses=responses(Unauthorized, RateLimited),
        summary="The tenant's daily quota, and its LLM tokens and cost today",
    )
    return router
