"""Admitting many triggers together: the part of a bulk submission with nothing to look up.

``app.submit_many`` and the HTTP batch hand admission up to a thousand triggers at once
(:meth:`~moorline.admission.admit.Admission.admit_many`). Those with an idempotency key or a
conversation are decided one by one, since each needs its lookups under its key's lock. The
rest, most of a bulk submission, take :meth:`~moorline.admission.admit.Admission.admit`'s
steps here, each step once for all of them:

- the budget read once per tenant;
- the inputs validated;
- the rate-limit hits counted in one call (:meth:`RateLimiter.hit_many`), or, with a gate,
  by the gate with the Submitter's batch as a single trigger's would be;
- every run handed to the Submitter at once (:meth:`Submitter.submit_all`) with its quota
  claim, so that the units go to the runs in the order given and each run is stored with its
  unit, or neither is.

Decided one by one, each trigger of a thousand was a task, a shielded decision and a quota
message of its own, which cost more than storing its run. Only deployments whose units are
taken with the runs (in the batch's transaction, or by the Submitter's gate) decide this way;
with units consumed one at a time, admission decides each trigger on its own.
"""

from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime

from moorline.admission.ratelimit import RateLimiter, RateLimitState
from moorline.admission.triggers import (
    Admitted,
    QuotaTerms,
    Trigger,
    new_run_of,
    over_budget,
    quota_terms,
)
from moorline.dispatch.budgets import BudgetStore
from moorline.dispatch.submit import ClaimedRun, RateClaim, Submitter
from moorline.errors import (
    BudgetExhausted,
    InvalidInput,
    MoorlineError,
    QuotaExceeded,
    RateLimited,
)
from moorline.observability.metrics import Metrics
from moorline.types import RunStatus, TenantId

Answers = list[Admitted | MoorlineError | None]
"""Each trigger's answer so far, by its index: None while undecided."""


class BulkAdmission:
    """Decides triggers without lookups together (see the module docstring)."""

    def __init__(
        self,
        *,
        submitter: Submitter,
        rate_limiter: RateLimiter,
        budgets: BudgetStore | None,
        clock: Callable[[], datetime],
        metrics: Metrics,
    ) -> None:
        self._submitter = submitter
        self._rate_limiter = rate_limiter
        self._budgets = budgets
        self._clock = clock
        self._rejections = metrics.rejections

    async def admit(self, triggers: Sequence[Trigger]) -> list[Admitted | MoorlineError]:
        """Decide ``triggers`` (none with lookups); each one's run or refusal, in order.

        Raises:
            Exception: an error that is not a refusal (a bug).
        """
        answers: Answers = [None] * len(triggers)
        if self._budgets is not None:
            await self._refuse_over_budget(triggers, answers, self._budgets)
        checked: dict[int, Trigger] = {}
        for index, trigger in enumerate(triggers):
            if answers[index] is None:
                try:
                    checked[index] = replace(
                        trigger, input=trigger.workflow.validate_input(trigger.input)
                    )
                except InvalidInput as exc:
                    answers[index] = exc
        states = await self._hit(triggers, answers)
        for index in states:
            if isinstance(answers[index], RateLimited):
                checked.pop(index, None)
        await self._store(triggers, checked, states, answers)
        return answers  # type: ignore[return-value]  # _store answered the last ones

    async def _refuse_over_budget(
        self, triggers: Sequence[Trigger], answers: Answers, budgets: BudgetStore
    ) -> None:
        """Answer each trigger of a tenant over its budget with the refusal (one read each)."""
        now = self._clock()
        refusals: dict[tuple[TenantId, str], BudgetExhausted | None] = {}
        for index, trigger in enumerate(triggers):
            if not trigger.plan.has_budget:
                continue
            tenant = (trigger.tenant_id, trigger.plan.name)
            if tenant not in refusals:
                refusals[tenant] = await over_budget(trigger, budgets, now)
            refusal = refusals[tenant]
            if refusal is not None:
                self._rejections.labels(reason=BudgetExhausted.code).inc()
                answers[index] = refusal

    async def _hit(
        self, triggers: Sequence[Trigger], answers: Answers
    ) -> dict[int, RateLimitState | RateLimited | None]:
        """Count the hits admission counts itself, in one call; refuse those over the limit.

        Every trigger without a gate; with one, only the invalid ones (the gate counts the rest
        with their batch). Over the limit is 429 before an invalid input's 422, as one trigger.

        Returns:
            The window after each counted trigger's hit, by index.
        """
        gated = self._submitter.is_gated
        counted = [
            index
            for index, answer in enumerate(answers)
            if (answer is None and not gated) or isinstance(answer, InvalidInput)
        ]
        if not counted:
            return {}
        hits = [(triggers[i].rate_identity, triggers[i].plan.rate_limit) for i in counted]
        states = dict(zip(counted, await self._rate_limiter.hit_many(hits), strict=True))
        for index, state in states.items():
            if isinstance(state, RateLimited):
                self._rejections.labels(reason=RateLimited.code).inc()
                answers[index] = state
        return states

    async def _store(
        self,
        triggers: Sequence[Trigger],
        checked: dict[int, Trigger],
        states: dict[int, RateLimitState | RateLimited | None],
        answers: Answers,
    ) -> None:
        """Hand the admitted runs to the Submitter at once; answer each with its outcome."""
        now = self._clock()
        terms: dict[str, QuotaTerms] = {}
        claimed: list[tuple[int, RateClaim | None, ClaimedRun]] = []
        gated = self._submitter.is_gated
        for index, trigger in checked.items():
            plan = trigger.plan
            plan_terms = terms.get(plan.name) or terms.setdefault(plan.name, quota_terms(plan, now))
            rate = (
                RateClaim(identity=trigger.rate_identity, rate=plan.rate_limit) if gated else None
            )
            claimed.append((index, rate, (new_run_of(trigger), plan_terms.claim, rate)))
        outcomes = await self._submitter.submit_all([run for _, _, run in claimed])
        for (index, rate, _), outcome in zip(claimed, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, MoorlineError):
                    raise outcome
                if isinstance(outcome, RateLimited):
                    self._rejections.labels(reason=RateLimited.code).inc()
                answers[index] = outcome
            elif outcome.status is RunStatus.RATE_LIMITED:
                self._rejections.labels(reason=QuotaExceeded.code).inc()
                answers[index] = terms[triggers[index].plan.name].refused(outcome)
            else:
                state = rate.state if rate is not None else states.get(index)
                answers[index] = Admitted(
                    run=outcome,
                    created=True,
                    rate=state if isinstance(state, RateLimitState) else None,
                )
