"""Admission's Redis counters, decided a batch at a time by the Submitter (its :class:`Gate`).

With Redis, a trigger's rate-limit hit and its quota unit are two scripts in Redis. Run per
trigger they are two round trips, which cost the API process more CPU than anything else a
trigger does, so the Submitter hands this gate the claims of every run of its batch (the batch
that one transaction will store) and the gate settles them all in two pipelined round trips:

1. the rate-limit hits (:meth:`RateLimiter.hit_many`): a hit over its limit refuses its run
   (429 ``rate_limited``, nothing stored); when Redis does not answer every hit is let through,
   as a single hit is;
2. then, for the runs still in, the quota units, one script per tenant and day taking as many
   units as the batch wants and the quota leaves (:meth:`RedisQuotaStore.take`). The runs after
   the last unit, in the batch's order, are stored ``rate_limited`` with the quota's refusal;
   when Redis does not answer, no run of the batch is stored (the quota fails closed).

The hits come first so that a refused hit never takes a unit. A run whose unit was taken but
that was not stored after all (the batch's transaction failed) gives it back
(:meth:`give_back`).
"""

from collections import Counter
from collections.abc import Sequence

from moorline.admission.quotas import QuotaStore, RedisQuotaStore
from moorline.admission.ratelimit import RateLimiter
from moorline.dispatch.submit import Claims, Gate, RateClaim, Verdict
from moorline.errors import RateLimited
from moorline.types import TenantId


class RedisGate(Gate):
    """Counts a batch's rate-limit hits, then takes its quota units, in Redis."""

    def __init__(self, rate_limiter: RateLimiter, quotas: RedisQuotaStore) -> None:
        self._rate_limiter = rate_limiter
        self._quotas = quotas

    async def enter(self, claims: Sequence[Claims]) -> list[Verdict]:
        verdicts: list[Verdict] = [None] * len(claims)
        hits: list[tuple[int, RateClaim]] = [
            (index, claim.rate) for index, claim in enumerate(claims) if claim.rate is not None
        ]
        if hits:
            states = await self._rate_limiter.hit_many(
                [(rate.identity, rate.rate) for _, rate in hits]
            )
            for (index, rate), state in zip(hits, states, strict=True):
                if isinstance(state, RateLimited):
                    verdicts[index] = state
                else:
                    rate.state = state
        # One counter per tenant and day (and limit: a plan changed mid-batch is its own group),
        # its runs in the batch's order: the first ones get the units.
        groups: dict[tuple[TenantId, str, int], list[int]] = {}
        for index, claim in enumerate(claims):
            if verdicts[index] is None and claim.quota is not None:
                key = (claim.tenant_id, claim.quota.day, claim.quota.limit)
                groups.setdefault(key, []).append(index)
        if not groups:
            return verdicts
        taken = await self._quotas.take(
            [
                (tenant_id, quota, len(indexes))
                for (tenant_id, _, _), indexes in groups.items()
                if (quota := claims[indexes[0]].quota) is not None
            ]
        )
        for indexes, units in zip(groups.values(), taken, strict=True):
            for index in indexes[units:]:
                quota = claims[index].quota
                if quota is not None:
                    verdicts[index] = quota.refusal
        return verdicts

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
