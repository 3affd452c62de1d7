"""What admission decides on and answers: a trigger, its admitted run, and the terms it sets.

Shared by the two ways a trigger is decided, one at a time
(:meth:`~moorline.admission.admit.Admission.admit`) and many together
(:mod:`moorline.admission.bulk`), so that both build the same run from a trigger, read the
budget the same way and word the quota's refusal alike.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from moorline.admission.ratelimit import RateLimitState
from moorline.db.repos.quotas import QuotaClaim
from moorline.db.repos.records import Run
from moorline.db.repos.runs import NewRun
from moorline.dispatch.budgets import BudgetStore, exhausted
from moorline.dispatch.days import next_reset, quota_day, seconds_until
from moorline.dispatch.submit import new_run_for_plan
from moorline.engine.registry import WorkflowDefinition
from moorline.errors import BudgetExhausted, QuotaExceeded
from moorline.plans import Plan
from moorline.types import RunId, TenantId


@dataclass(frozen=True, slots=True, kw_only=True)
class Trigger:
    """A request to start a workflow, as admission sees it.

    Attributes:
        tenant_id: Who asks; the run will be theirs.
        plan: The tenant's plan (lane, priority, quota, rate).
        rate_identity: The credential whose rate limit the request counts against (an API
            key's digest, a webhook's id); never a secret.
        workflow: The registered workflow to run.
        input: The workflow's arguments as sent (validated by admission).
        idempotency_key: Makes a repeated trigger return the first one's run.
        conversation_id: The conversation the run joins; one active run per conversation.
        delay_s: Seconds before the run may be claimed.
        rerun_of: The run this one re-runs (``POST …/rerun``), recorded on the new run.
    """

    tenant_id: TenantId
    plan: Plan
    rate_identity: str
    workflow: WorkflowDefinition
    input: Mapping[str, Any]
    idempotency_key: str | None = None
    conversation_id: str | None = None
    delay_s: float = 0.0
    rerun_of: RunId | None = None

    @property
    def has_lookups(self) -> bool:
        """Whether an idempotency key or a conversation must be looked up before storing."""
        return self.idempotency_key is not None or self.conversation_id is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class Admitted:
    """A trigger's run.

    Attributes:
        run: The run as stored.
        created: False when the trigger repeated an earlier one (same idempotency key).
        rate: The credential's rate-limit window after this request; None when unknown.
    """

    run: Run
    created: bool
    rate: RateLimitState | None


@dataclass(frozen=True, slots=True, kw_only=True)
class QuotaTerms:
    """A plan's daily quota as a trigger made at one moment meets it.

    Attributes:
        claim: The unit a run needs, with the refusal it is stored with when there is none.
        message: The refusal's sentence (it names the reset).
        retry_after_s: Seconds until the quota resets (the ``Retry-After``).
    """

    claim: QuotaClaim
    message: str
    retry_after_s: int

    def refused(self, run: Run) -> QuotaExceeded:
        """The error of a trigger whose run the quota refused (stored ``rate_limited``)."""
        return QuotaExceeded(self.message, run_id=run.run_id, retry_after_s=self.retry_after_s)


def quota_terms(plan: Plan, now: datetime) -> QuotaTerms:
    """``plan``'s daily quota for a trigger made at ``now`` (aware UTC)."""
    retry_after_s = seconds_until(now, next_reset(now))
    message = (
        f"daily quota of {plan.daily_quota} runs used up; it resets at 00:00 UTC, "
        f"in {retry_after_s}s"
    )
    claim = QuotaClaim(
        day=quota_day(now),
        limit=plan.daily_quota,
        refusal={"code": QuotaExceeded.code, "message": message},
    )
    return QuotaTerms(claim=claim, message=message, retry_after_s=retry_after_s)


def new_run_of(trigger: Trigger) -> NewRun:
    """The run ``trigger`` (its input validated) stores, routed by its plan."""
    return new_run_for_plan(
        trigger.plan,
        tenant_id=trigger.tenant_id,
        workflow=trigger.workflow.name,
        input=dict(trigger.input),
        max_attempts=trigger.workflow.max_attempts,
        idempotency_key=trigger.idempotency_key,
        conversation_id=trigger.conversation_id,
        timeout_s=trigger.workflow.timeout_s,
        delay_s=trigger.delay_s,
        rerun_of=trigger.rerun_of,
    )


async def over_budget(
    trigger: Trigger, budgets: BudgetStore, now: datetime
) -> BudgetExhausted | None:
    """The refusal of a trigger whose tenant's model spend today has reached its budget.

    A read only: spend is charged by the model calls themselves, so the check needs no unit to
    give back and a refused trigger leaves nothing behind. The caller counts the refusal.
    """
    spend = await budgets.spent(trigger.tenant_id, quota_day(now))
    why = exhausted(trigger.plan, spend)
    if why is None:
        return None
    retry_after_s = seconds_until(now, next_reset(now))
    return BudgetExhausted(
        f"{why}; it resets at 00:00 UTC, in {retry_after_s}s", retry_after_s=retry_after_s
    )
