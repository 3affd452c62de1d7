"""The trigger decision: one call decides whether a trigger becomes a run, and stores it.

:meth:`Admission.admit` takes every trigger (HTTP, webhook, client) through the same steps;
the first that refuses ends the decision:

0. **Budget** (:mod:`moorline.dispatch.budgets`), only for plans with ``daily_tokens`` or
   ``daily_cost``: a tenant whose model spend today has reached it is refused 429
   ``budget_exhausted`` with ``Retry-After`` to 00:00 UTC; nothing is stored or counted.
1. **API rate limit** of the credential (:mod:`moorline.admission.ratelimit`): over it is
   429 ``rate_limited`` and nothing is stored or counted.
2. **Input**: the workflow's parameters validate the input (422 ``invalid_input``, nothing
   stored).
3. **Idempotency key**: a run of the tenant already stored under the key is the answer
   (same workflow and input) or a 409 ``idempotency_conflict`` (anything else).
4. **Conversation**: a conversation whose run has not ended refuses another (409
   ``conversation_busy``); a database check.
5. **Daily quota** (:mod:`moorline.admission.quotas`): one unit is taken atomically. Over the
   quota the run is stored ``rate_limited`` and the answer is 429 ``quota_exceeded`` with
   the run's id.
6. **Enqueue** through the :class:`~moorline.dispatch.submit.Submitter` (group commit; its
   hook wakes the lane's workers). A run that fails to be stored gives its unit back.

With counters in the database (no Redis), steps 5 and 6 are one: the run goes to the
Submitter with its :class:`~moorline.db.repos.quotas.QuotaClaim`, and the batch transaction
that stores it takes its unit, or stores it ``rate_limited``. Nothing is given back then: a run
that fails to be stored rolls its unit back with it.

With counters in Redis the Submitter has a gate (:mod:`moorline.admission.gate`) that takes the
units of a whole batch in one round trip before its transaction, and gives back those of runs
the transaction did not store. A trigger with nothing to look up (no idempotency key, no
conversation: most of them) hands the gate its rate-limit hit too, so steps 1, 5 and 6 are
settled by its batch and the trigger pays no Redis round trip of its own; its input is checked
before, and an invalid one is still counted against the rate limit (and refused 429 over it).

Steps 3 and 4 are reads that come before the quota, so a retried request or a refused one
never takes a unit, and ``GET /v1/usage`` shows only units of stored runs. What makes them
safe under concurrency:

- Within a process, triggers that share an idempotency key or a conversation queue on a lock
  of that key: the second sees the first's run.
- Across processes, the unique ``(tenant_id, idempotency_key)`` of the runs table decides: a
  loser gives its unit back and answers with the winner's run.
- A dropped connection can neither lose a unit nor leave a taken one without its run: a unit
  taken with its run (the Submitter's transaction, or its gate) goes with the run the
  Submitter stores once it has taken it, whether or not the client still waits; a unit
  consumed on its own, before the run is queued, has the rest of its decision shielded from
  cancellation.

:meth:`Admission.admit_many` decides a bulk submission's triggers: those with a conversation or
a key another of them shares each as above, the rest together with the same steps, each made
once for all of them (:mod:`moorline.admission.bulk`).

A run refused by the quota is stored without its idempotency key: the key names an accepted
trigger, so the client may retry with it once the quota resets.
"""

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, TypeVar

from moorline.admission.bulk import BulkAdmission
from moorline.admission.quotas import QuotaStore
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
from moorline.db.repos.listing import RunListing
from moorline.db.repos.quotas import QuotaClaim
from moorline.db.repos.records import Run
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.dispatch.budgets import BudgetStore
from moorline.dispatch.days import next_reset, quota_day
from moorline.dispatch.submit import RateClaim, Submitter
from moorline.errors import (
    BudgetExhausted,
    ConversationBusy,
    IdempotencyConflict,
    InvalidInput,
    MoorlineError,
    QuotaExceeded,
    RateLimited,
)
from moorline.observability.metrics import Metrics
from moorline.plans import Plan
from moorline.types import RunStatus, TenantId

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    """A tenant's quota for the current UTC day."""

    daily_quota: int
    used_today: int
    remaining: int
    resets_at: datetime


class Admission:
    """Decides triggers (see the module docstring) and reports quota usage."""

    def __init__(
        self,
        *,
        runs: RunsRepo,
        listing: RunListing,
        submitter: Submitter,
        quotas: QuotaStore,
        rate_limiter: RateLimiter,
        clock: Callable[[], datetime] | None = None,
        metrics: Metrics | None = None,
        budgets: BudgetStore | None = None,
    ) -> None:
        """Wire the decision to its stores.

        Args:
            runs: Stores refused runs and finds runs by idempotency key.
            listing: Finds a conversation's active run.
            submitter: Stores admitted runs (group commit) and wakes their lanes.
            quotas: The daily quota counters.
            rate_limiter: The API rate limits.
            clock: Aware UTC "now" (the quota's day), replaceable in tests.
            metrics: Where refusals are counted; default a private set nobody scrapes.
            budgets: The daily model spend, read for plans with a budget; None: no budgets.
        """
        self._runs = runs
        self._listing = listing
        self._submitter = submitter
        self._quotas = quotas
        self._rate_limiter = rate_limiter
        self._budgets = budgets
        self._clock = clock or (lambda: datetime.now(UTC))
        metrics = metrics or Metrics()
        self._rejections = metrics.rejections
        self._locks: KeyedLock[str] = KeyedLock()
        # Whether a run's unit is taken where it is stored: in the Submitter's transaction
        # (counters in the database) or by its gate (in Redis), not by a consume of its own.
        self._units_with_runs = quotas.taken_with_runs or submitter.is_gated
        self._bulk = BulkAdmission(
            runs=runs,
            locks=self._locks,
            submitter=submitter,
            rate_limiter=rate_limiter,
            budgets=budgets,
            clock=self._clock,
            metrics=metrics,
        )
        self._decisions: set[asyncio.Task[Any]] = set()

    async def admit(self, trigger: Trigger) -> Admitted:
        """Decide ``trigger``: store its run and queue it, or refuse it.

        Returns:
            The admitted run (new, or the earlier run of the same idempotency key).

        Raises:
            RateLimited: over the credential's API rate limit; nothing was stored.
            InvalidInput: the input does not fit the workflow; nothing was stored.
            IdempotencyConflict: the key was used with another workflow or input.
            ConversationBusy: the conversation has an active run; nothing was stored.
            QuotaExceeded: the daily quota is used up; the run was stored ``rate_limited``.
            BudgetExhausted: the plan's daily token or cost budget is spent; nothing was
                stored.
            BackendUnavailable: the quota or budget store did not answer; nothing was stored.
        """
        if trigger.plan.has_budget and self._budgets is not None:
            refusal = await over_budget(trigger, self._budgets, self._clock())
            if refusal is not None:
                self._rejections.labels(reason=BudgetExhausted.code).inc()
                raise refusal
        keys = trigger.lock_keys()
        if not keys and self._submitter.is_gated:
            return await self._admit_with_batch(trigger)
        rate = await self._hit(trigger)
        checked = replace(trigger, input=trigger.workflow.validate_input(trigger.input))
        if not keys:
            # No idempotency key and no conversation (most triggers): nothing to look up first
            # and no lock to hold, so not even the cost of entering an empty set of them.
            run, created = await self._shielded(self._take_and_store(checked))
            return Admitted(run=run, created=created, rate=rate)
        async with holding(self._locks, keys):
            earlier = await self._earlier_run(checked)
            if earlier is not None:
                return Admitted(run=earlier, created=False, rate=rate)
            if checked.conversation_id is not None:
                active = await self._listing.active_in_conversation(
                    checked.tenant_id, checked.conversation_id
                )
                if active is not None:
                    raise ConversationBusy(checked.conversation_id, active)
            run, created = await self._shielded(self._take_and_store(checked))
        return Admitted(run=run, created=created, rate=rate)

    async def admit_many(self, triggers: Sequence[Trigger]) -> list[Admitted | MoorlineError]:
        """Decide each trigger on its own, as :meth:`admit` would; its run or its refusal.

        Most are decided together, by :class:`~moorline.admission.bulk.BulkAdmission`, when
        the units are taken with the runs. A trigger with a conversation, or whose idempotency
        key another trigger of the batch shares, takes :meth:`admit`'s way instead, those
        started in the order given, so that triggers sharing a key are decided in that order.

        Raises:
            Exception: an error that is not a refusal (a bug), once every trigger is decided.
        """
        plain = self._bulk.decides(triggers) if self._units_with_runs else []
        alone = sorted(set(range(len(triggers))).difference(plain))
        together = asyncio.ensure_future(self._bulk.admit([triggers[index] for index in plain]))
        try:
            singles = await asyncio.gather(
                *(self.admit(triggers[index]) for index in alone), return_exceptions=True
            )
        except BaseException:
            together.cancel()
            raise
        answers: dict[int, Admitted | MoorlineError] = dict(zip(plain, await together, strict=True))
        for index, outcome in zip(alone, singles, strict=True):
            answers[index] = (
                refusal_or_raise(outcome) if isinstance(outcome, BaseException) else outcome
            )
        return [answers[index] for index in range(len(triggers))]

    async def _hit(self, trigger: Trigger) -> RateLimitState | None:
        """Count the trigger against its credential's rate limit, on its own."""
        try:
            return await self._rate_limiter.hit(trigger.rate_identity, trigger.plan.rate_limit)
        except RateLimited:
            self._rejections.labels(reason=RateLimited.code).inc()
            raise

    async def _admit_with_batch(self, trigger: Trigger) -> Admitted:
        """Decide a trigger with nothing to look up first, its counters settled by its batch.

        The Submitter's gate counts the rate-limit hit and takes the quota unit together with
        those of the other runs of the batch (see :mod:`moorline.admission.gate`), so the
        decision is steps 1, 5 and 6 in one place and nothing needs shielding: once the batch
        holds the run, the Submitter takes, stores or gives back its unit whether or not the
        caller still waits.
        """
        try:
            checked = replace(trigger, input=trigger.workflow.validate_input(trigger.input))
        except InvalidInput:
            # Counted, and refused over the limit (429 before 422), as on the unbatched path.
            await self._hit(trigger)
            raise
        rate = RateClaim(identity=trigger.rate_identity, rate=trigger.plan.rate_limit)
        try:
            run, created = await self._take_and_store(checked, rate)
        except RateLimited:
            self._rejections.labels(reason=RateLimited.code).inc()
            raise
        state = rate.state if isinstance(rate.state, RateLimitState) else None
        return Admitted(run=run, created=created, rate=state)

    async def usage(self, tenant_id: TenantId, plan: Plan) -> Usage:
        """The tenant's quota today: the plan's quota, units taken, and when it resets."""
        now = self._clock()
        used = await self._quotas.used(tenant_id, quota_day(now))
        return Usage(
            daily_quota=plan.daily_quota,
            used_today=used,
            remaining=max(0, plan.daily_quota - used),
            resets_at=next_reset(now),
        )

    async def usages(self, tenants: Sequence[tuple[TenantId, Plan]]) -> list[Usage]:
        """The quota today of each tenant (with its plan), in one read of the counters."""
        now = self._clock()
        used = await self._quotas.used_by((tenant_id for tenant_id, _ in tenants), quota_day(now))
        return [
            Usage(
                daily_quota=plan.daily_quota,
                used_today=used.get(tenant_id, 0),
                remaining=max(0, plan.daily_quota - used.get(tenant_id, 0)),
                resets_at=next_reset(now),
            )
            for tenant_id, plan in tenants
        ]

    async def close(self) -> None:
        """Let decisions whose clients went away finish (they hold quota units)."""
        while self._decisions:
            await asyncio.gather(*self._decisions, return_exceptions=True)

    async def _earlier_run(self, trigger: Trigger) -> Run | None:
        """The run stored under the trigger's idempotency key, if it is the same trigger.

        Raises:
            IdempotencyConflict: the key's run has another workflow or input.
        """
        key = trigger.idempotency_key
        if key is None:
            return None
        run = await self._runs.find_by_idempotency_key(trigger.tenant_id, key)
        if run is None:
            return None
        conflict = key_conflict(trigger, run)
        if conflict is not None:
            raise conflict
        return run

    async def _take_and_store(
        self, trigger: Trigger, rate: RateClaim | None = None
    ) -> tuple[Run, bool]:
        new = new_run_of(trigger)
        terms = quota_terms(trigger.plan, self._clock())
        claim = terms.claim
        day = claim.day
        if self._units_with_runs:
            run, created = await self._store_with_unit(trigger, new, claim, rate)
            if run.status is RunStatus.RATE_LIMITED:
                raise self._refused(run, terms)
            return run, created
        if await self._quotas.consume(trigger.tenant_id, day, claim.limit) is None:
            refused = await self._runs.insert_rate_limited(
                replace(new, idempotency_key=None), claim.refusal
            )
            raise self._refused(refused, terms)
        try:
            return await self._submitter.submit(new), True
        except IdempotencyConflict:
            # Another process stored a run under this key since the check above.
            await self._quotas.release(trigger.tenant_id, day)
            earlier = await self._earlier_run(trigger)
            if earlier is None:
                raise
            return earlier, False
        except BaseException:
            await self._quotas.release(trigger.tenant_id, day)
            raise

    async def _store_with_unit(
        self, trigger: Trigger, new: NewRun, claim: QuotaClaim, rate: RateClaim | None
    ) -> tuple[Run, bool]:
        """Store the run, its unit taken by the batch that stores it.

        The unit is taken in the batch's transaction (counters in the database) or by the
        Submitter's gate (counters in Redis), and with ``rate`` the gate counts the rate-limit
        hit first.

        Returns:
            The run (``rate_limited`` when the quota refused it), and whether it is new.
        """
        try:
            return await self._submitter.submit(new, quota=claim, rate=rate), True
        except IdempotencyConflict:
            # Another process stored a run under this key since the check above; the failed
            # transaction took no unit, or the Submitter gave the gate's back.
            earlier = await self._earlier_run(trigger)
            if earlier is None:
                raise
            return earlier, False

    def _refused(self, run: Run, terms: QuotaTerms) -> QuotaExceeded:
        """The error of a trigger whose run the quota refused (stored ``rate_limited``)."""
        self._rejections.labels(reason=QuotaExceeded.code).inc()
        return terms.refused(run)

    async def _shielded(self, decision: Coroutine[Any, Any, T]) -> T:
        """Run ``decision`` to its end even if the caller is cancelled meanwhile.

        Only where a unit is consumed before its run is queued: a caller gone in between would
        leave the unit without its run. Where the unit is taken with the run (the Submitter's
        transaction or its gate) there is nothing to shield, and no task to pay for: the
        Submitter takes no run whose caller has gone, and stores one it has taken, with its
        unit, whether or not the caller still waits.
        """
        if self._units_with_runs:
            return await decision
        task = asyncio.ensure_future(decision)
        self._decisions.add(task)
        task.add_done_callback(_forget(self._decisions))
        return await asyncio.shield(task)


def _forget(tasks: set[asyncio.Task[Any]]) -> Callable[[asyncio.Task[Any]], None]:
    def done(task: asyncio.Task[Any]) -> None:
        tasks.discard(task)
        # Retrieved here so an outcome nobody waits for any more (the client went away) is
        # not reported as "never retrieved"; a waiting caller still gets it from the shield.
        if not task.cancelled() and task.exception() is not None:
            logger.debug("a trigger decision ended with %r", task.exception())

    return done
