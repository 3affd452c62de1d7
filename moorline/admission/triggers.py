"""What admission decides on and answers: a trigger, its admitted run, and the terms it sets.

Shared by the two ways a trigger is decided, one at a time
(:meth:`~moorline.admission.admit.Admission.admit`) and many together
(:mod:`moorline.admission.bulk`), so that both build the same run from a trigger, read the
budget the same way and word the quota's refusal alike.
"""

from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from moorline.admission.ratelimit import RateLimitState
from moorline.concurrency import KeyedLock
from moorline.db.failures import as_unavailable
from moorline.db.repos.quotas import QuotaClaim
from moorline.db.repos.records import Run
from moorline.db.repos.runs import NewRun, hash_input
from moorline.dispatch.budgets import BudgetStore, exhausted
from moorline.dispatch.days import next_reset, quota_day, seconds_until
from moorline.engine.registry import WorkflowDefinition
from moorline.errors import BudgetExhausted, IdempotencyConflict, MoorlineError, QuotaExceeded
from moorline.observability import tracing
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

    def lock_keys(self) -> list[str]:
        """The keys of the per-key locks its lookups are made under (none without lookups)."""
        keys: list[str] = []
        if self.idempotency_key is not None:
            keys.append(f"idempotency:{self.tenant_id}:{self.idempotency_key}")
        if self.conversation_id is not None:
            keys.append(f"conversation:{self.tenant_id}:{self.conversation_id}")
        return keys


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
    """The run ``trigger`` (its input validated) stores, routed by its plan.

    The plan's lane and priority: the plan comes from :class:`moorline.plans.PlansProvider`,
    which has already routed it for the edition (community: every plan to the lane
    ``workflow``). The workflow's attempts and timeout.
    """
    plan, workflow = trigger.plan, trigger.workflow
    return NewRun(
        tenant_id=trigger.tenant_id,
        workflow=workflow.name,
        input=dict(trigger.input),
        lane=plan.lane,
        priority=plan.priority,
        max_attempts=workflow.max_attempts,
        idempotency_key=trigger.idempotency_key,
        conversation_id=trigger.conversation_id,
        timeout_s=workflow.timeout_s,
        delay_s=trigger.delay_s,
        rerun_of=trigger.rerun_of,
        # Built in the trigger's task: the trigger's span (or the submitting attempt's).
        trace_context=tracing.carrier(),
    )


def key_conflict(trigger: Trigger, run: Run) -> IdempotencyConflict | None:
    """The conflict when ``run``, stored under the trigger's idempotency key, is another's.

    Another workflow or another input (``trigger``'s validated, compared by its hash): the
    key was used for something else. None when the trigger repeats the run's.
    """
    if run.workflow == trigger.workflow.name and run.input_hash == hash_input(dict(trigger.input)):
        return None
    return IdempotencyConflict(
        f"idempotency key {trigger.idempotency_key!r} was used by run {run.run_id} with "
        "another workflow or input"
    )


def as_refusal(exc: BaseException) -> MoorlineError | None:
    """The answer a trigger gets for ``exc``; None for a bug.

    A refusal as it is, a database outage as :class:`~moorline.errors.BackendUnavailable` (as
    the API answers it). What a bulk submission answers item by item, where one item's outage
    must not become the whole call's error, and what ``app.submit`` raises in the place of a
    driver's error.
    """
    if isinstance(exc, MoorlineError):
        return exc
    return as_unavailable(exc)


def refusal_or_raise(exc: BaseException) -> MoorlineError:
    """``exc`` as a trigger's answer (:func:`as_refusal`); raised when it is a bug."""
    refusal = as_refusal(exc)
    if refusal is None:
        raise exc
    return refusal


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


@asynccontextmanager
async def holding(locks: KeyedLock[str], keys: Iterable[str]) -> AsyncIterator[None]:
    """Hold the lock of every key in ``keys`` (seed 002's per-key locks).

    Taken in sorted order, by one trigger or by a whole bulk submission at once, so two
    holders can never hold one each and wait for the other's.
    """
    async with AsyncExitStack() as stack:
        for key in sorted(set(keys)):
            await stack.enter_async_context(locks.hold(key))
        yield
