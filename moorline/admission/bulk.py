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

import asyncio
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
from moorline.db.repos.records import Run
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

_Claimed = tuple[int, RateClaim | None, RateLimitState | RateLimited | None, ClaimedRun]
"""A trigger's run for the Submitter: its index, its rate claim (with a gate) or the window
admission counted it in, and the run with its claims."""


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

        A batch of the Submitter's size at a time: each is queued as soon as it is decided, so
        that the Submitter writes it while the next one is decided (the database's time of one
        overlaps this process's time of the other).

        Raises:
            Exception: an error that is not a refusal (a bug).
        """
        answers: Answers = [None] * len(triggers)
        if self._budgets is not None:
            await self._refuse_over_budget(triggers, answers, self._budgets)
        now = self._clock()
        terms: dict[str, QuotaTerms] = {}
        queued: list[tuple[list[_Claimed], asyncio.Future[list[Run | BaseException]]]] = []
        size = self._submitter.max_batch
        for first in range(0, len(triggers), size):
            part = range(first, min(first + size, len(triggers)))
            checked = self._checked(triggers, part, answers)
            states = await self._hit(triggers, part, answers)
            claimed = self._claimed(checked, states, answers, terms, now)
            outcomes = await self._submitter.queue_all([run for _, _, _, run in claimed])
            queued.append((claimed, outcomes))
            # Lets the Submitter's writer take this part before the next is decided.
            await asyncio.sleep(0)
        for claimed, outcomes in queued:
            for (index, rate, state, _), outcome in zip(claimed, await outcomes, strict=True):
                answers[index] = self._answer(
                    outcome, rate or state, terms[triggers[index].plan.name]
                )
        return answers  # type: ignore[return-value]  # every index was answered above

    def _checked(
        self, triggers: Sequence[Trigger], part: range, answers: Answers
    ) -> dict[int, Trigger]:
        """The triggers of ``part`` still undecided, their inputs validated; refuse the rest."""
        checked: dict[int, Trigger] = {}
        for index in part:
            if answers[index] is None:
                trigger = triggers[index]
                try:
                    checked[index] = replace(
                        trigger, input=trigger.workflow.validate_input(trigger.input)
                    )
                except InvalidInput as exc:
                    answers[index] = exc
        return checked

    def _claimed(
        self,
        checked: dict[int, Trigger],
        states: dict[int, RateLimitState | RateLimited | None],
        answers: Answers,
        terms: dict[str, QuotaTerms],
        now: datetime,
    ) -> list["_Claimed"]:
        """The runs of the checked triggers the rate limit let through, with their claims."""
        gated = self._submitter.is_gated
        claimed: list[_Claimed] = []
        for index, trigger in checked.items():
            if answers[index] is not None:
                continue  # over the rate limit
            plan = trigger.plan
            if plan.name not in terms:
                terms[plan.name] = quota_terms(plan, now)
            rate = None
            if gated:
                rate = RateClaim(identity=trigger.rate_identity, rate=plan.rate_limit)
            run = (new_run_of(trigger), terms[plan.name].claim, rate)
            claimed.append((index, rate, states.get(index), run))
        return claimed

    def _answer(
        self,
        outcome: Run | BaseException,
        rate: RateClaim | RateLimitState | RateLimited | None,
        terms: QuotaTerms,
    ) -> Admitted | MoorlineError:
        """A trigger's answer from what the Submitter made of its run.

        Raises:
            BaseException: ``outcome``, an error that is not a refusal.
        """
        if isinstance(outcome, BaseException):
            if not isinstance(outcome, MoorlineError):
                raise outcome
            if isinstance(outcome, RateLimited):
                self._rejections.labels(reason=RateLimited.code).inc()
            return outcome
        if outcome.status is RunStatus.RATE_LIMITED:
            self._rejections.labels(reason=QuotaExceeded.code).inc()
            return terms.refused(outcome)
        state = rate.state if isinstance(rate, RateClaim) else rate
        return Admitted(
            run=outcome,
            created=True,
            rate=state if isinstance(state, RateLimitState) else None,
        )

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
        self, triggers: Sequence[Trigger], part: range, answers: Answers
    ) -> dict[int, RateLimitState | RateLimited | None]:
        """Count the hits of ``part`` admission counts itself, in one call; refuse those over it.

        Every trigger without a gate; with one, only the invalid ones (the gate counts the rest
        with their batch). Over the limit is 429 before an invalid input's 422, as one trigger.

        Returns:
            The window after each counted trigger's hit, by index.
        """
        gated = self._submitter.is_gated
        counted = [
            index
            for index in part
            if (answers[index] is None and not gated) or isinstance(answers[index], InvalidInput)
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
