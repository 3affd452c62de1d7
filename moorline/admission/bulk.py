"""Admitting many triggers together: most of a bulk submission.

``app.submit_many`` and the HTTP batch hand admission up to a thousand triggers at once
(:meth:`~moorline.admission.admit.Admission.admit_many`). A trigger with a conversation, or
whose idempotency key another trigger of the batch shares, is decided on its own, in the
order of the batch. The rest, a bulk submission's triggers with no key or with a key of their
own, take :meth:`~moorline.admission.admit.Admission.admit`'s steps here, each step once for
all of them:

- the locks of their idempotency keys taken together, in one order (:func:`holding`), and held
  until their runs are stored, as one trigger holds its key's;
- the budget read once per tenant;
- the inputs validated;
- the rate-limit hits counted in one call (:meth:`RateLimiter.hit_many`), or, with a gate,
  by the gate with the Submitter's batch as a single trigger's would be (a keyed trigger's is
  counted before its lookup, as alone);
- the runs already stored under their keys read in one query: a repeat is answered with the
  earlier run (or ``idempotency_conflict``) and takes no unit;
- every other run handed to the Submitter with its quota claim, a Submitter batch at a time:
  the units go to the runs in the order given, each run is stored with its unit or neither
  is, and one part is written while the next is decided.

Decided one by one, each trigger of a thousand was a task, a shielded decision, a quota
message, and with a key a lock and a query of its own, which cost more than storing its run.
Only deployments whose units are taken with the runs (in the batch's transaction, or by the
Submitter's gate) decide this way; with units consumed one at a time, admission decides each
trigger on its own.
"""

import asyncio
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime

from moorline.admission.ratelimit import RateLimiter, RateLimitState
from moorline.admission.triggers import (
    Admitted,
    QuotaTerms,
    Trigger,
    holding,
    key_conflict,
    new_run_of,
    over_budget,
    quota_terms,
    refusal_or_raise,
)
from moorline.concurrency import KeyedLock
from moorline.db.repos.records import Run
from moorline.db.repos.runs import RunsRepo
from moorline.dispatch.budgets import BudgetStore
from moorline.dispatch.submit import ClaimedRun, RateClaim, Submitter
from moorline.errors import (
    BudgetExhausted,
    IdempotencyConflict,
    InvalidInput,
    MoorlineError,
    QuotaExceeded,
    RateLimited,
)
from moorline.observability.metrics import Metrics
from moorline.types import RunStatus, TenantId

Answers = list[Admitted | MoorlineError | None]
"""Each trigger's answer so far, by its index: None while undecided."""

Window = RateClaim | RateLimitState | RateLimited | None
"""Where a trigger's rate-limit hit was counted: the gate's claim, or the window admission
counted it in (None: not counted, or the storage did not answer)."""

_Claimed = tuple[int, Trigger, Window, ClaimedRun]
"""A trigger's run for the Submitter: its index, the trigger with its input validated, its
hit, and the run with its claims."""


class BulkAdmission:
    """Decides a bulk submission's triggers together (see the module docstring)."""

    def __init__(
        self,
        *,
        runs: RunsRepo,
        locks: KeyedLock[str],
        submitter: Submitter,
        rate_limiter: RateLimiter,
        budgets: BudgetStore | None,
        clock: Callable[[], datetime],
        metrics: Metrics,
    ) -> None:
        self._runs = runs
        self._locks = locks
        self._submitter = submitter
        self._rate_limiter = rate_limiter
        self._budgets = budgets
        self._clock = clock
        self._rejections = metrics.rejections

    @staticmethod
    def decides(triggers: Sequence[Trigger]) -> list[int]:
        """The indexes of the triggers decided here.

        Those with no conversation, and no idempotency key that another of ``triggers`` shares.
        """
        keys: Counter[tuple[TenantId, str | None]] = Counter(
            (trigger.tenant_id, trigger.idempotency_key)
            for trigger in triggers
            if trigger.idempotency_key is not None
        )
        return [
            index
            for index, trigger in enumerate(triggers)
            if trigger.conversation_id is None
            and keys[trigger.tenant_id, trigger.idempotency_key] <= 1
        ]

    async def admit(self, triggers: Sequence[Trigger]) -> list[Admitted | MoorlineError]:
        """Decide ``triggers`` (as :meth:`decides` picks them); each one's run or refusal.

        Raises:
            Exception: an error that is not a refusal (a bug).
        """
        answers: Answers = [None] * len(triggers)
        keys = [key for trigger in triggers for key in trigger.lock_keys()]
        async with holding(self._locks, keys):
            if self._budgets is not None:
                await self._refuse_over_budget(triggers, answers, self._budgets)
            terms: dict[str, QuotaTerms] = {}
            queued = await self._queue_parts(triggers, answers, terms)
            conflicts: list[tuple[int, Trigger]] = []
            for claimed, outcomes in queued:
                for (index, checked, window, _), outcome in zip(
                    claimed, await outcomes, strict=True
                ):
                    answers[index] = self._answer(outcome, window, terms[checked.plan.name])
                    if isinstance(outcome, IdempotencyConflict):
                        conflicts.append((index, checked))
            for index, checked in conflicts:
                await self._repeat_or_conflict(checked, index, answers)
        return answers  # type: ignore[return-value]  # every index was answered above

    async def _queue_parts(
        self, triggers: Sequence[Trigger], answers: Answers, terms: dict[str, QuotaTerms]
    ) -> list[tuple[list[_Claimed], "asyncio.Future[list[Run | BaseException]]"]]:
        """Decide the triggers a Submitter batch at a time, queueing each part's runs.

        Each part is queued as soon as it is decided, so that the Submitter writes it while
        the next one is decided (the database's time of one overlaps this process's time of
        the other).

        Returns:
            Per part, its runs and the future of their outcomes; ``terms`` gets each plan's
            quota terms.
        """
        now = self._clock()
        queued: list[tuple[list[_Claimed], asyncio.Future[list[Run | BaseException]]]] = []
        size = self._submitter.max_batch
        for first in range(0, len(triggers), size):
            part = range(first, min(first + size, len(triggers)))
            checked = self._checked(triggers, part, answers)
            try:
                windows = await self._hit(triggers, part, answers)
                await self._repeats(checked, windows, answers)
            except Exception as exc:
                # A store that did not answer (BackendUnavailable) refuses this part's triggers
                # still undecided, as it would refuse each alone; nothing of theirs is stored.
                _refuse_undecided(answers, part, refusal_or_raise(exc))
                continue
            claimed = self._claimed(checked, windows, answers, terms, now)
            outcomes = await self._submitter.queue_all([run for *_, run in claimed])
            queued.append((claimed, outcomes))
            # Lets the Submitter's writer take this part before the next is decided.
            await asyncio.sleep(0)
        return queued

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
        windows: dict[int, Window],
        answers: Answers,
        terms: dict[str, QuotaTerms],
        now: datetime,
    ) -> list[_Claimed]:
        """The runs of the checked triggers still undecided, with their claims.

        With a gate, a trigger whose hit admission did not count gets a claim of it for the
        gate to count with the batch.
        """
        claimed: list[_Claimed] = []
        for index, trigger in checked.items():
            if answers[index] is not None:
                continue  # over the rate limit, or a repeat
            plan = trigger.plan
            if plan.name not in terms:
                terms[plan.name] = quota_terms(plan, now)
            window = windows.get(index)
            rate = None
            if index not in windows and self._submitter.is_gated:
                window = rate = RateClaim(identity=trigger.rate_identity, rate=plan.rate_limit)
            run = (new_run_of(trigger), terms[plan.name].claim, rate)
            claimed.append((index, trigger, window, run))
        return claimed

    async def _repeats(
        self, checked: dict[int, Trigger], windows: dict[int, Window], answers: Answers
    ) -> None:
        """Answer the keyed triggers whose key has a run already, read in one query a tenant."""
        keyed: dict[TenantId, dict[str, int]] = {}
        for index, trigger in checked.items():
            if answers[index] is None and trigger.idempotency_key is not None:
                keyed.setdefault(trigger.tenant_id, {})[trigger.idempotency_key] = index
        for tenant_id, indexes in keyed.items():
            found = await self._runs.find_by_idempotency_keys(tenant_id, list(indexes))
            for key, run in found.items():
                index = indexes[key]
                answers[index] = key_conflict(checked[index], run) or Admitted(
                    run=run, created=False, rate=_state(windows.get(index))
                )

    async def _repeat_or_conflict(self, trigger: Trigger, index: int, answers: Answers) -> None:
        """After the database refused a keyed run: another process stored its key meanwhile.

        The run stored under the key is the answer when it is the same trigger's (``trigger``
        has its input validated), as for one trigger; the conflict stays otherwise.
        """
        key = trigger.idempotency_key
        if key is None:
            return
        try:
            earlier = await self._runs.find_by_idempotency_key(trigger.tenant_id, key)
        except Exception as exc:
            refusal_or_raise(exc)  # unread: the conflict stays the answer
            return
        if earlier is not None and key_conflict(trigger, earlier) is None:
            answers[index] = Admitted(run=earlier, created=False, rate=None)

    def _answer(
        self, outcome: Run | BaseException, window: Window, terms: QuotaTerms
    ) -> Admitted | MoorlineError:
        """A trigger's answer from what the Submitter made of its run.

        Raises:
            BaseException: ``outcome``, an error that is not a refusal.
        """
        if isinstance(outcome, BaseException):
            refusal = refusal_or_raise(outcome)
            if isinstance(refusal, RateLimited):
                self._rejections.labels(reason=RateLimited.code).inc()
            return refusal
        if outcome.status is RunStatus.RATE_LIMITED:
            self._rejections.labels(reason=QuotaExceeded.code).inc()
            return terms.refused(outcome)
        return Admitted(run=outcome, created=True, rate=_state(window))

    async def _refuse_over_budget(
        self, triggers: Sequence[Trigger], answers: Answers, budgets: BudgetStore
    ) -> None:
        """Answer each trigger of a tenant over its budget with the refusal (one read each)."""
        now = self._clock()
        refusals: dict[tuple[TenantId, str], MoorlineError | None] = {}
        for index, trigger in enumerate(triggers):
            if not trigger.plan.has_budget:
                continue
            tenant = (trigger.tenant_id, trigger.plan.name)
            if tenant not in refusals:
                try:
                    refusals[tenant] = await over_budget(trigger, budgets, now)
                except Exception as exc:
                    # The budget store did not answer: refused, as each would be alone.
                    refusals[tenant] = refusal_or_raise(exc)
            refusal = refusals[tenant]
            if isinstance(refusal, BudgetExhausted):
                self._rejections.labels(reason=BudgetExhausted.code).inc()
            if refusal is not None:
                answers[index] = refusal

    async def _hit(
        self, triggers: Sequence[Trigger], part: range, answers: Answers
    ) -> dict[int, Window]:
        """Count the hits of ``part`` admission counts itself, in one call; refuse those over it.

        Every trigger without a gate; with one, the invalid ones and the keyed ones (counted
        before their lookup, as alone), the gate counting the rest with their batch. Over the
        limit is 429 before an invalid input's 422, as for one trigger.

        Returns:
            The window after each counted trigger's hit, by index.
        """
        gated = self._submitter.is_gated
        counted = [
            index
            for index in part
            if isinstance(answers[index], InvalidInput)
            or (
                answers[index] is None
                and (not gated or triggers[index].idempotency_key is not None)
            )
        ]
        if not counted:
            return {}
        hits = [(triggers[i].rate_identity, triggers[i].plan.rate_limit) for i in counted]
        windows: dict[int, Window] = {}
        for index, state in zip(counted, await self._rate_limiter.hit_many(hits), strict=True):
            windows[index] = state
            if isinstance(state, RateLimited):
                self._rejections.labels(reason=RateLimited.code).inc()
                answers[index] = state
        return windows


def _refuse_undecided(answers: Answers, part: range, error: MoorlineError) -> None:
    """Answer every trigger of ``part`` not answered yet with ``error``."""
    for index in part:
        if answers[index] is None:
            answers[index] = error


def _state(window: Window) -> RateLimitState | None:
    """The window after a trigger's hit, where it is known."""
    state = window.state if isinstance(window, RateClaim) else window
    return state if isinstance(state, RateLimitState) else None
