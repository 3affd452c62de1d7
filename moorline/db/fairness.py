"""Dispatch policy: which queued runs a claim takes, in which order; where a lapsed lease goes.

Pure functions over plain values (no SQL, no I/O), so the product's fairness promise is stated,
and tested, without a database. ``moorline.db.repos.claims`` reads the rows and calls
:func:`allot` and :func:`take_in_claim_order`; ``moorline.db.repos.reaping`` calls
:func:`expired_lease_outcome`.

**Claim order.** Between the queued, eligible runs of one lane:

1. *Priority first*: a run of higher priority is claimed before any run of lower priority,
   whatever its tenant. Fairness applies between equal priorities.
2. *Round-robin between tenants*: a tenant's n-th run ranks as its ``busy + n``-th, where
   ``busy`` counts its runs already in flight. Every tenant's next run comes before any
   tenant's second, and a tenant with fewer runs in flight goes first, also when workers
   claim one run at a time. One tenant's backlog thus delays another tenant of the same lane
   and priority by at most one run per slot.
3. *FIFO within a tenant*: among its runs of one priority, the one eligible longest
   (``not_before``) goes first, then the lowest id.
4. *Caps never exceeded*: a tenant at its concurrency cap gets nothing, one with ``k`` free
   slots at most ``k`` runs; a claim never takes more than it asked for, nor a run twice.
"""

import heapq
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from moorline.types import RunStatus


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitingTenant:
    """A tenant with eligible queued runs in the lane being claimed from.

    Attributes:
        tenant_id: The tenant.
        plan: Its plan's name, which sets its cap.
        busy: Its ``running`` runs, in every lane.
        priority: The priority of its next run in claim order.
        not_before: The eligibility time of that run.
    """

    tenant_id: str
    plan: str
    busy: int
    priority: int
    not_before: datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class QueuedRun:
    """An eligible queued run as the claim order sees it."""

    run_id: str
    tenant_id: str
    priority: int
    not_before: datetime


def tenant_cap(caps: Mapping[str, int], default_cap: int, plan: str) -> int:
    """The most ``running`` runs a tenant on ``plan`` may have: its plan's cap, else the default."""
    return caps.get(plan, default_cap)


def allot(
    waiting: Sequence[WaitingTenant], caps: Mapping[str, int], default_cap: int, limit: int
) -> Counter[str]:
    """How many of the next ``limit`` claims each waiting tenant gets (tenant id → count).

    Each tenant is ranked by its next run, as if all its runs had that run's priority and
    eligibility time: the exact runs are read afterwards, per tenant, and put in order by
    :func:`take_in_claim_order`.

    Promises: priority first; between equal priorities round-robin over live load (a tenant's
    n-th run ranks as its ``busy + n``-th), then the tenant whose next run is oldest, then the
    lowest tenant id; a tenant gets at most its free slots (cap - busy), so one at its cap
    gets nothing; the counts add up to at most ``limit``; no tenant outside ``waiting``
    appears.
    """
    heap: list[tuple[int, int, datetime, str, int]] = []
    for tenant in waiting:
        free = tenant_cap(caps, default_cap, tenant.plan) - tenant.busy
        if free > 0:
            key = (-tenant.priority, tenant.busy + 1, tenant.not_before, tenant.tenant_id)
            heap.append((*key, free))
    heapq.heapify(heap)
    allotted: Counter[str] = Counter()
    for _ in range(limit):
        if not heap:
            break
        priority, rank, not_before, tenant_id, free = heapq.heappop(heap)
        allotted[tenant_id] += 1
        if free > 1:
            heapq.heappush(heap, (priority, rank + 1, not_before, tenant_id, free - 1))
    return allotted


def take_in_claim_order(
    queued: Sequence[QueuedRun],
    busy: Mapping[str, int],
    free: Mapping[str, int],
    limit: int,
) -> list[str]:
    """The ids of the first ``limit`` of ``queued`` in claim order, at most ``free[t]`` of tenant t.

    Each tenant's runs are numbered by their turn in FIFO order (priority, then
    ``not_before``, then id); the claim order is then priority first, round-robin over live
    load (``busy[t] + turn``), oldest eligible first, lowest id last. ``queued`` may come in
    any order (a ``UNION ALL`` keeps none).

    Promises: never more than ``limit`` ids, never an id twice (given distinct run ids), never
    more than ``free[t]`` runs of tenant ``t`` (none of a tenant missing from ``free``), and
    every id one of ``queued``.
    """
    by_tenant = sorted(queued, key=lambda r: (r.tenant_id, -r.priority, r.not_before, r.run_id))
    turn: Counter[str] = Counter()
    ranked: list[tuple[int, int, datetime, str, str]] = []
    for run in by_tenant:
        turn[run.tenant_id] += 1
        rank = busy.get(run.tenant_id, 0) + turn[run.tenant_id]
        ranked.append((-run.priority, rank, run.not_before, run.run_id, run.tenant_id))
    ranked.sort()
    taken: Counter[str] = Counter()
    chosen: list[str] = []
    for *_, run_id, tenant_id in ranked:
        if len(chosen) == limit:
            break
        if taken[tenant_id] < free.get(tenant_id, 0):
            taken[tenant_id] += 1
            chosen.append(run_id)
    return chosen


def expired_lease_outcome(*, attempt: int, max_attempts: int, cancel_requested: bool) -> RunStatus:
    """Where a run whose lease expired goes: the reaper's decision, from the row as it read it.

    A recorded cancel wins (``cancelled``: a cancelled run is never resurrected); else a run
    out of attempts (``attempt >= max_attempts``) is ``failed``; else it is ``queued`` again,
    its attempt unchanged (the next claim increments it).
    """
    if cancel_requested:
        return RunStatus.CANCELLED
    if attempt >= max_attempts:
        return RunStatus.FAILED
    return RunStatus.QUEUED
