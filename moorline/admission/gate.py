"""Admission's Redis counters, decided a batch at a time by the Submitter (its :class:`Gate`).

With Redis, a trigger's rate-limit hit and its quota unit are two scripts in Redis. Run per
trigger they are two round trips, which cost the API process more CPU than anything else a
trigger did, so the Submitter hands this gate the claims of every run of its batch and the
gate settles them all in one pipelined round trip: the rate-limit hits
(:meth:`RateLimiter.script_calls`), and one quota script per tenant and day taking as many
units as the batch has claims and the quota leaves (:meth:`RedisQuotaStore.take_calls`).

- A hit over its limit refuses its run: 429 ``rate_limited``, nothing stored.
- The units go to the runs the rate limit let through, in the batch's order; the runs after
  the last unit are stored ``rate_limited`` with the quota's refusal (429 ``quota_exceeded``).
- A hit refused in the same round trip took a unit it must not keep: the gate gives those
  back at once (a second round trip, paid only by a batch with a refused hit). Until then,
  for that one round trip, another API process can find the counter higher by those units and
  refuse a trigger near the end of the quota: never one unit more than the quota, at worst
  one less, and only while some caller is over its rate limit. Taking the units after the hits
  would cost every batch a second round trip instead.
- When Redis does not answer, no run of the batch is stored (the quota fails closed; 503).

A run whose unit was taken but that was not stored after all (the batch's transaction failed,
or its idempotency key was taken meanwhile) gives it back (:meth:`give_back`).
"""

import logging
from collections import Counter
from collections.abc import Sequence

from moorline.admission.quotas import QuotaStore, RedisQuotaStore
from moorline.admission.ratelimit import RateLimiter
from moorline.dispatch.submit import Claims, Gate, RateClaim, Verdict
from moorline.errors import BackendUnavailable, RateLimited
from moorline.types import TenantId

logger = logging.getLogger(__name__)


class RedisGate(Gate):
    """Counts a batch's rate-limit hits and takes its quota units in one Redis round trip."""

    def __init__(self, rate_limiter: RateLimiter, quotas: RedisQuotaStore) -> None:
        """Settle batches with ``rate_limiter``'s windows and ``quotas``' counters.

        Raises:
            ValueError: the rate limiter keeps its windows in memory, not in Redis.
        """
        if not rate_limiter.is_shared:
            raise ValueError("the gate needs the rate limits in Redis, as the quota counters")
        self._rate_limiter = rate_limiter
        self._quotas = quotas

    async def enter(self, claims: Sequence[Claims]) -> list[Verdict]:
        verdicts: list[Verdict] = [None] * len(claims)
        rates: list[tuple[int, RateClaim]] = [
            (index, claim.rate) for index, claim in enumerate(claims) if claim.rate is not None
        ]
        # One counter per tenant and day (and limit: a plan changed mid-batch is its own group),
        # its runs in the batch's order: the first ones get the units.
        groups: dict[tuple[TenantId, str, int], list[int]] = {}
        for index, claim in enumerate(claims):
            if claim.quota is not None:
                key = (claim.tenant_id, claim.quota.day, claim.quota.limit)
                groups.setdefault(key, []).append(index)
        hits = [(rate.identity, rate.rate) for _, rate in rates]
        wants = [
            (tenant_id, quota, len(indexes))
            for (tenant_id, _, _), indexes in groups.items()
            if (quota := claims[indexes[0]].quota) is not None
        ]
        calls = self._rate_limiter.script_calls(hits)
        replies = await self._quotas.run([*calls, *self._quotas.take_calls(wants)])
        states = self._rate_limiter.read_replies(hits, replies[: len(calls)])
        for (index, rate), state in zip(rates, states, strict=True):
            if isinstance(state, RateLimited):
                verdicts[index] = state
            else:
                rate.state = state
        surplus: list[tuple[TenantId, str, int]] = []
        for (tenant_id, day, _), indexes, (taken, _) in zip(
            groups, groups.values(), replies[len(calls) :], strict=True
        ):
            # Units were taken for every claim of the group, hits refused included: those go
            # back, and the claims the rate limit let through get the units in their order.
            admitted = [index for index in indexes if verdicts[index] is None]
            units = min(int(taken), len(admitted))
            for index in admitted[units:]:
                quota = claims[index].quota
                if quota is not None:
                    verdicts[index] = quota.refusal
            if int(taken) > units:
                surplus.append((tenant_id, day, int(taken) - units))
        if surplus:
            await self._return_surplus(surplus)
        return verdicts

    async def _return_surplus(self, surplus: list[tuple[TenantId, str, int]]) -> None:
        """Give back the units taken for hits the rate limit refused."""
        try:
            await self._quotas.give_back(surplus)
        except BackendUnavailable as exc:
            # The batch's verdicts stand (its units are taken); the refused hits' units stay
            # taken too, so the tenant is refused early rather than let past its quota.
            logger.warning("giving back the units of refused hits failed: %s", exc)

    async def give_back(self, claims: Sequence[Claims]) -> None:
        units = Counter(
            (claim.tenant_id, claim.quota.day) for claim in claims if claim.quota is not None
        )
        if units:
            await self._quotas.give_back(
                [(tenant_id, day, count) for (tenant_id, day), count in units.items()]
            )


def make_gate(rate_limiter: RateLimiter, quotas: QuotaStore) -> Gate | None:
    """The Submitter's gate when the quota is counted in Redis; None when in the database."""
    if isinstance(quotas, RedisQuotaStore):
        return RedisGate(rate_limiter, quotas)
    return None
