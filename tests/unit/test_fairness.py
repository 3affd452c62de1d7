"""The claim-order policy's promises, without a database (``moorline.db.fairness``).

Priority first, round-robin between tenants over live load, FIFO within a tenant, caps never
exceeded, never more than asked for, nothing claimed twice; and where an expired lease goes.
The contract suite (``tests/contract/test_claim.py``) checks the same promises through every
database; these check them over arbitrary inputs.
"""

import ast
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

import moorline.db.fairness
from moorline.db.fairness import (
    QueuedRun,
    WaitingTenant,
    allot,
    expired_lease_outcome,
    take_in_claim_order,
    tenant_cap,
)
from moorline.types import RunStatus

T0 = datetime(2026, 1, 1, tzinfo=UTC)
PLANS = ("free", "pro", "unlisted")

tenant_ids = st.sampled_from(["t1", "t2", "t3", "t4", "t5"])
priorities = st.integers(min_value=0, max_value=2)
# Few distinct times, so ties between tenants and runs are common.
times = st.integers(min_value=0, max_value=3).map(lambda s: T0 + timedelta(seconds=s))
caps_by_plan = st.fixed_dictionaries(
    {"free": st.integers(min_value=0, max_value=3), "pro": st.integers(min_value=0, max_value=6)}
)
default_caps = st.integers(min_value=0, max_value=2)
limits = st.integers(min_value=0, max_value=12)


@st.composite
def waiting_tenants(draw: st.DrawFn) -> list[WaitingTenant]:
    return [
        WaitingTenant(
            tenant_id=tenant_id,
            plan=draw(st.sampled_from(PLANS)),
            busy=draw(st.integers(min_value=0, max_value=4)),
            priority=draw(priorities),
            not_before=draw(times),
        )
        for tenant_id in draw(st.lists(tenant_ids, unique=True, max_size=5))
    ]


@st.composite
def queued_runs(draw: st.DrawFn) -> list[QueuedRun]:
    drawn = draw(st.lists(st.tuples(tenant_ids, priorities, times), max_size=25))
    runs = [
        QueuedRun(run_id=f"r{index:02d}", tenant_id=t, priority=p, not_before=nb)
        for index, (t, p, nb) in enumerate(drawn)
    ]
    return draw(st.permutations(runs))  # a UNION ALL keeps no order


loads = st.dictionaries(tenant_ids, st.integers(min_value=0, max_value=4))
free_slots = st.dictionaries(tenant_ids, st.integers(min_value=0, max_value=5))


def free_of(tenant: WaitingTenant, caps: Mapping[str, int], default_cap: int) -> int:
    return max(0, tenant_cap(caps, default_cap, tenant.plan) - tenant.busy)


def fifo(runs: Sequence[QueuedRun], tenant_id: str) -> list[QueuedRun]:
    """A tenant's runs in its own order: priority, then oldest eligible, then id."""
    mine = [run for run in runs if run.tenant_id == tenant_id]
    return sorted(mine, key=lambda run: (-run.priority, run.not_before, run.run_id))


# --- allot ---------------------------------------------------------------------------------


@given(waiting=waiting_tenants(), caps=caps_by_plan, default_cap=default_caps, limit=limits)
def test_allot_never_exceeds_a_cap_nor_the_batch(
    waiting: list[WaitingTenant], caps: dict[str, int], default_cap: int, limit: int
) -> None:
    allotted = allot(waiting, caps, default_cap, limit)
    by_id = {tenant.tenant_id: tenant for tenant in waiting}
    assert set(allotted) <= set(by_id)
    for tenant_id, count in allotted.items():
        assert 0 < count <= free_of(by_id[tenant_id], caps, default_cap)
    # Never more than asked for, and no free slot left idle while the batch has room.
    total_free = sum(free_of(tenant, caps, default_cap) for tenant in waiting)
    assert sum(allotted.values()) == min(limit, total_free)


@given(waiting=waiting_tenants(), caps=caps_by_plan, default_cap=default_caps, limit=limits)
def test_allot_serves_higher_priority_first(
    waiting: list[WaitingTenant], caps: dict[str, int], default_cap: int, limit: int
) -> None:
    allotted = allot(waiting, caps, default_cap, limit)
    for high in waiting:
        short = allotted[high.tenant_id] < free_of(high, caps, default_cap)
        for low in waiting:
            if short and low.priority < high.priority:
                assert allotted[low.tenant_id] == 0, (high, low, allotted)


@given(waiting=waiting_tenants(), caps=caps_by_plan, default_cap=default_caps, limit=limits)
def test_allot_is_round_robin_over_live_load_between_equal_priorities(
    waiting: list[WaitingTenant], caps: dict[str, int], default_cap: int, limit: int
) -> None:
    # A tenant's n-th run ranks as its busy + n-th: no tenant gets a run ranked after the
    # next run of a tenant of the same priority that was left short (ties: oldest, then id).
    allotted = allot(waiting, caps, default_cap, limit)
    for short in waiting:
        if allotted[short.tenant_id] >= free_of(short, caps, default_cap):
            continue
        next_rank = (short.busy + allotted[short.tenant_id] + 1, short.not_before, short.tenant_id)
        for served in waiting:
            if served.priority == short.priority and allotted[served.tenant_id] > 0:
                last = (served.busy + allotted[served.tenant_id], served.not_before)
                assert (*last, served.tenant_id) < next_rank, (served, short, allotted)


def test_allot_alternates_between_tenants_claiming_one_run_at_a_time() -> None:
    # Workers that claim one run at a time still alternate: the claimed run counts as busy.
    busy = {"t1": 0, "t2": 0}
    order: list[str] = []
    for _ in range(6):
        waiting = [
            WaitingTenant(tenant_id=t, plan="pro", busy=b, priority=0, not_before=T0)
            for t, b in busy.items()
        ]
        [(tenant_id, _count)] = allot(waiting, {"pro": 10}, 1, 1).items()
        busy[tenant_id] += 1
        order.append(tenant_id)
    assert order == ["t1", "t2"] * 3


# --- take_in_claim_order -------------------------------------------------------------------


@given(queued=queued_runs(), busy=loads, free=free_slots, limit=limits)
def test_take_never_exceeds_free_slots_nor_the_batch_nor_takes_twice(
    queued: list[QueuedRun], busy: dict[str, int], free: dict[str, int], limit: int
) -> None:
    chosen = take_in_claim_order(queued, busy, free, limit)
    by_id = {run.run_id: run for run in queued}
    assert len(chosen) == len(set(chosen))
    assert set(chosen) <= set(by_id)
    taken = Counter(by_id[run_id].tenant_id for run_id in chosen)
    for tenant_id, count in taken.items():
        assert count <= free.get(tenant_id, 0)
    available = Counter(run.tenant_id for run in queued)
    claimable = sum(min(count, free.get(t, 0)) for t, count in available.items())
    assert len(chosen) == min(limit, claimable)


@given(queued=queued_runs(), busy=loads, free=free_slots, limit=limits)
def test_take_is_fifo_within_a_tenant(
    queued: list[QueuedRun], busy: dict[str, int], free: dict[str, int], limit: int
) -> None:
    chosen = take_in_claim_order(queued, busy, free, limit)
    for tenant_id in {run.tenant_id for run in queued}:
        mine = [run.run_id for run in fifo(queued, tenant_id)]
        taken = [run_id for run_id in chosen if run_id in set(mine)]
        # A prefix of the tenant's own order, taken in that order.
        assert taken == mine[: len(taken)]


@given(queued=queued_runs(), busy=loads, free=free_slots, limit=limits)
def test_take_orders_by_priority_then_round_robin_then_age(
    queued: list[QueuedRun], busy: dict[str, int], free: dict[str, int], limit: int
) -> None:
    chosen = take_in_claim_order(queued, busy, free, limit)
    by_id = {run.run_id: run for run in queued}
    turn = {
        run.run_id: index
        for tenant_id in {run.tenant_id for run in queued}
        for index, run in enumerate(fifo(queued, tenant_id), start=1)
    }

    def rank(run: QueuedRun) -> tuple[int, int, datetime]:
        # Between tenants of equal priority and rank, the run eligible longest goes first.
        return (-run.priority, busy.get(run.tenant_id, 0) + turn[run.run_id], run.not_before)

    ranks = [rank(by_id[run_id]) for run_id in chosen]
    assert ranks == sorted(ranks)
    # A run left behind although its tenant had a free slot ranks no better than any taken.
    taken = Counter(by_id[run_id].tenant_id for run_id in chosen)
    for run in queued:
        if run.run_id not in chosen and taken[run.tenant_id] < free.get(run.tenant_id, 0):
            assert all(r <= rank(run) for r in ranks), (run, chosen)


# --- both, as a claimer uses them ----------------------------------------------------------


@settings(max_examples=50)
@given(
    queued=queued_runs(),
    plans=st.dictionaries(tenant_ids, st.sampled_from(PLANS)),
    caps=caps_by_plan,
    default_cap=default_caps,
    limits=st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=6),
)
def test_repeated_claims_keep_caps_and_never_take_a_run_twice(
    queued: list[QueuedRun],
    plans: dict[str, str],
    caps: dict[str, int],
    default_cap: int,
    limits: list[int],
) -> None:
    # As the serialised claim does: allot between the waiting tenants, read each one's next
    # allotted runs, put them in claim order. Claimed runs stay busy (no run finishes).
    busy: Counter[str] = Counter()
    left = list(queued)
    claimed: list[str] = []
    for limit in limits:
        waiting = []
        for tenant_id in sorted({run.tenant_id for run in left}):
            head = fifo(left, tenant_id)[0]
            plan = plans.get(tenant_id, "unlisted")
            waiting.append(
                WaitingTenant(
                    tenant_id=tenant_id,
                    plan=plan,
                    busy=busy[tenant_id],
                    priority=head.priority,
                    not_before=head.not_before,
                )
            )
        allotted = allot(waiting, caps, default_cap, limit)
        read = [run for t, count in allotted.items() for run in fifo(left, t)[:count]]
        free = {w.tenant_id: tenant_cap(caps, default_cap, w.plan) - w.busy for w in waiting}
        chosen = take_in_claim_order(read, busy, free, limit)
        assert len(chosen) <= limit
        claimed += chosen
        left = [run for run in left if run.run_id not in set(chosen)]
        for run_id in chosen:
            busy[next(r.tenant_id for r in queued if r.run_id == run_id)] += 1
    assert len(claimed) == len(set(claimed))
    for tenant_id, count in busy.items():
        assert count <= tenant_cap(caps, default_cap, plans.get(tenant_id, "unlisted"))


# --- expired leases ------------------------------------------------------------------------


@given(
    attempt=st.integers(min_value=1, max_value=5),
    max_attempts=st.integers(min_value=1, max_value=5),
    cancel_requested=st.booleans(),
)
def test_an_expired_lease_is_cancelled_failed_or_requeued(
    attempt: int, max_attempts: int, cancel_requested: bool
) -> None:
    outcome = expired_lease_outcome(
        attempt=attempt, max_attempts=max_attempts, cancel_requested=cancel_requested
    )
    if cancel_requested:
        assert outcome is RunStatus.CANCELLED  # a cancelled run is never resurrected
    elif attempt >= max_attempts:
        assert outcome is RunStatus.FAILED
    else:
        assert outcome is RunStatus.QUEUED


# --- purity --------------------------------------------------------------------------------


def test_the_policy_module_imports_only_the_standard_library_and_moorline_types() -> None:
    # No SQL and no I/O: backends may import it, and it can be read and tested on its own.
    source = Path(moorline.db.fairness.__file__).read_text()
    imported: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            imported.add(node.module)
    outside = {
        name
        for name in imported
        if name.split(".")[0] not in sys.stdlib_module_names and name != "moorline.types"
    }
    assert not outside
