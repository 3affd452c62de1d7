"""Claims on every backend: disjoint batches, priority and FIFO, tenant caps, fairness.

docs/reliability.md C3 asks for 1,000 rounds of two pollers over 1,000 runs: that is
``MOORLINE_FULL=1`` (``make test-full``). CI runs 250 rounds, 10-30 s per backend on a 2-core
machine (a round is two claims of 20 with their events, serialised on SQLite's write lock or
the tenant row lock). Every round is a real race (both
claims start together on separate pooled connections), and the queue is refilled whenever the
pollers drain it, so rounds keep contending for the head of the same 1,000 runs.
"""

import asyncio
import random
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select, update

from moorline.db.manager import DatabaseManager
from moorline.db.repos.claim_statements import lock_tenants_statement
from moorline.db.repos.queue import Claim, QueueRepo
from moorline.db.repos.records import run_from_row
from moorline.db.schema import events, runs
from moorline.types import RunStatus
from tests.contract.queue_helpers import (
    NO_CAP,
    Tenants,
    add_runs,
    finish,
    requeue_all,
    running_per_tenant,
    statuses,
    unique,
    waits_for_a_lock,
)
from tests.helpers import FULL_SIZE, wait_for

DISJOINT_RUNS = 1_000
DISJOINT_ROUNDS = 1_000 if FULL_SIZE else 250
BATCH = 20

CAPPED = "capped"
CAP = 2
CAP_TENANTS = 3
CAP_RUNS_PER_TENANT = 30
CAP_CLAIMERS = 8

TTL_S = 30.0


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


def ids(claims: list[Claim]) -> list[str]:
    return [claim.run.run_id for claim in claims]


# Untraced by coverage: its trials repeat paths other tests cover, and tracing would double
# their cost (and slow one side of the race more than the other).
@pytest.mark.no_cover
async def test_two_pollers_claim_disjoint_batches(db: DatabaseManager, tenants: Tenants) -> None:
    queue = QueueRepo(db)
    tenant = await tenants.new()
    lane = unique("lane")
    run_ids = set(await add_runs(db, tenant, lane, DISJOINT_RUNS))
    claimed_since_refill = 0
    for round_no in range(DISJOINT_ROUNDS):
        first, second = await asyncio.gather(
            queue.claim_batch(lane, "poller-1", limit=BATCH, lease_ttl_s=TTL_S, tenant_caps=NO_CAP),
            queue.claim_batch(lane, "poller-2", limit=BATCH, lease_ttl_s=TTL_S, tenant_caps=NO_CAP),
        )
        a, b = set(ids(first)), set(ids(second))
        assert len(a) == len(first) and len(b) == len(second)
        assert not a & b, f"round {round_no}: both pollers claimed {sorted(a & b)[:3]}"
        assert a | b <= run_ids
        claimed_since_refill += len(a) + len(b)
        assert claimed_since_refill <= DISJOINT_RUNS  # nothing claimed twice between refills
        if claimed_since_refill == DISJOINT_RUNS:
            await requeue_all(db, tenant)
            claimed_since_refill = 0
        else:
            # The queue has work, so at least one poller must have got some of it.
            assert a | b, f"round {round_no}: no claim although runs were queued"


async def test_claim_takes_the_lease_and_records_started(
    db: DatabaseManager, tenants: Tenants
) -> None:
    queue = QueueRepo(db)
    tenant = await tenants.new()
    lane = unique("lane")
    [run_id] = await add_runs(db, tenant, lane, 1)
    [claim] = await queue.claim_batch(
        lane, "worker-a", limit=5, lease_ttl_s=TTL_S, tenant_caps=NO_CAP
    )
    async with db.connect() as conn:
        now = (await conn.execute(select(db.backend.now()))).scalar_one()
    run = claim.run
    assert (run.run_id, run.status, run.attempt, run.lease_owner) == (
        run_id,
        RunStatus.RUNNING,
        1,
        "worker-a",
    )
    assert (claim.fence.run_id, claim.fence.attempt, claim.fence.owner) == (run_id, 1, "worker-a")
    assert run.lease_expires_at is not None and run.started_at is not None
    assert timedelta(seconds=TTL_S - 5) < run.lease_expires_at - now <= timedelta(seconds=TTL_S)
    first_start = run.started_at

    # Requeued and claimed again: the attempt (fencing token) grows, started_at stays.
    await requeue_all(db, tenant)
    [again] = await queue.claim_batch(
        lane, "worker-b", limit=5, lease_ttl_s=TTL_S, tenant_caps=NO_CAP
    )
    assert (again.run.attempt, again.fence.owner) == (2, "worker-b")
    assert again.run.started_at == first_start
    async with db.connect() as conn:
        rows = (
            await conn.execute(
                select(events.c.seq, events.c.type, events.c.attempt)
                .where(events.c.run_id == run_id)
                .order_by(events.c.seq)
            )
        ).all()
    assert [tuple(row) for row in rows] == [(1, "started", 1), (2, "started", 2)]


async def test_empty_lane_and_zero_limit_claim_nothing(
    db: DatabaseManager, tenants: Tenants
) -> None:
    queue = QueueRepo(db)
    tenant = await tenants.new()
    lane = unique("lane")
    assert await queue.claim_batch(lane, "w", limit=5, lease_ttl_s=TTL_S, tenant_caps=NO_CAP) == []
    await add_runs(db, tenant, lane, 2)
    assert await queue.claim_batch(lane, "w", limit=0, lease_ttl_s=TTL_S, tenant_caps=NO_CAP) == []
    other = unique("lane")
    assert await queue.claim_batch(other, "w", limit=5, lease_ttl_s=TTL_S, tenant_caps=NO_CAP) == []


async def test_priority_first_then_fifo(db: DatabaseManager, tenants: Tenants) -> None:
    queue = QueueRepo(db)
    tenant = await tenants.new()
    lane = unique("lane")
    base = datetime.now(UTC) - timedelta(hours=1)
    # Inserted oldest-first per priority, interleaved between priorities.
    low = await add_runs(db, tenant, lane, 3, priority=10, not_before=base)
    high = await add_runs(db, tenant, lane, 3, priority=100, not_before=base + timedelta(minutes=1))
    mid = await add_runs(db, tenant, lane, 3, priority=50, not_before=base - timedelta(minutes=1))
    order = []
    for _ in range(9):
        [claim] = await queue.claim_batch(lane, "w", limit=1, lease_ttl_s=TTL_S, tenant_caps=NO_CAP)
        order.append(claim.run.run_id)
    assert order == high + mid + low
    # A batch comes back in the same order.
    await requeue_all(db, tenant)
    batch = await queue.claim_batch(lane, "w", limit=9, lease_ttl_s=TTL_S, tenant_caps=NO_CAP)
    assert ids(batch) == high + mid + low


async def test_future_not_before_is_not_claimed(db: DatabaseManager, tenants: Tenants) -> None:
    queue = QueueRepo(db)
    tenant = await tenants.new()
    lane = unique("lane")
    later = await add_runs(
        db, tenant, lane, 2, priority=100, not_before=datetime.now(UTC) + timedelta(hours=1)
    )
    now = await add_runs(db, tenant, lane, 1)
    batch = await queue.claim_batch(lane, "w", limit=10, lease_ttl_s=TTL_S, tenant_caps=NO_CAP)
    assert ids(batch) == now
    assert await queue.claim_batch(lane, "w", limit=10, lease_ttl_s=TTL_S, tenant_caps=NO_CAP) == []
    assert {status for status, _ in (await statuses(db, later)).values()} == {"queued"}


async def test_tenant_cap_never_exceeded_by_concurrent_claimers(
    db: DatabaseManager, tenants: Tenants
) -> None:
    queue = QueueRepo(db)
    lane = unique("lane")
    capped = [await tenants.new(CAPPED) for _ in range(CAP_TENANTS)]
    all_runs: list[str] = []
    for tenant in capped:
        all_runs += await add_runs(db, tenant, lane, CAP_RUNS_PER_TENANT)
    caps = {CAPPED: CAP}
    finished: Counter[str] = Counter()
    samples = 0
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal samples
        counts = await running_per_tenant(db, capped)
        samples += 1
        over = {tenant: n for tenant, n in counts.items() if n > CAP}
        assert not over, f"tenant cap {CAP} exceeded: {over}"

    async def claimer(index: int) -> None:
        rng = random.Random(index)
        held: list[Claim] = []
        while not done.is_set():
            held += await queue.claim_batch(
                lane, f"claimer-{index}", limit=3, lease_ttl_s=TTL_S, tenant_caps=caps
            )
            await sample()
            # Finish some of what is held, keep the rest a while, so claimers meet full caps
            # and freed slots both.
            rng.shuffle(held)
            keep = rng.randint(0, len(held))
            for claim in held[keep:]:
                assert await finish(db, claim.fence)
                finished[claim.run.tenant_id] += 1
            held = held[:keep]
            if sum(finished.values()) == len(all_runs):
                done.set()
            elif not held:
                await asyncio.sleep(0)  # yield so other claimers run; not a synchronisation

    async def sampler() -> None:
        while not done.is_set():
            await sample()

    async with asyncio.timeout(120):
        await asyncio.gather(sampler(), *(claimer(i) for i in range(CAP_CLAIMERS)))
    # Every slot freed by finishing was reused until the backlog was gone.
    assert finished == Counter({tenant: CAP_RUNS_PER_TENANT for tenant in capped})
    assert {status for status, _ in (await statuses(db, all_runs)).values()} == {"succeeded"}
    assert samples > CAP_TENANTS * CAP_RUNS_PER_TENANT // 3


async def test_cap_counts_running_runs_in_every_lane(db: DatabaseManager, tenants: Tenants) -> None:
    queue = QueueRepo(db)
    tenant = await tenants.new(CAPPED)
    lane_a, lane_b = unique("lane"), unique("lane")
    await add_runs(db, tenant, lane_a, 1)
    await add_runs(db, tenant, lane_b, 5)
    caps = {CAPPED: CAP}
    assert (
        len(await queue.claim_batch(lane_a, "w", limit=5, lease_ttl_s=TTL_S, tenant_caps=caps)) == 1
    )
    assert (
        len(await queue.claim_batch(lane_b, "w", limit=5, lease_ttl_s=TTL_S, tenant_caps=caps)) == 1
    )
    assert await queue.claim_batch(lane_b, "w", limit=5, lease_ttl_s=TTL_S, tenant_caps=caps) == []


async def test_unknown_plan_gets_the_default_cap(db: DatabaseManager, tenants: Tenants) -> None:
    queue = QueueRepo(db)
    tenant = await tenants.new("no_such_plan")
    lane = unique("lane")
    await add_runs(db, tenant, lane, 5)
    batch = await queue.claim_batch(
        lane, "w", limit=5, lease_ttl_s=TTL_S, tenant_caps={CAPPED: 4}, default_cap=1
    )
    assert len(batch) == 1


async def test_a_backlog_does_not_delay_another_tenant(
    db: DatabaseManager, tenants: Tenants
) -> None:
    queue = QueueRepo(db)
    flood, small = await tenants.new(), await tenants.new()
    lane = unique("lane")
    await add_runs(db, flood, lane, 5_000)  # the backlog size
    [late] = await add_runs(db, small, lane, 1)  # created after the whole backlog
    first = await queue.claim_batch(lane, "w", limit=10, lease_ttl_s=TTL_S, tenant_caps=NO_CAP)
    assert late in ids(first)
    # One at a time it is the second claim at the latest: one flood run, then the late one.
    await requeue_all(db, flood)
    await requeue_all(db, small)
    one = await queue.claim_batch(lane, "w", limit=1, lease_ttl_s=TTL_S, tenant_caps=NO_CAP)
    two = await queue.claim_batch(lane, "w", limit=1, lease_ttl_s=TTL_S, tenant_caps=NO_CAP)
    assert late in ids(one) + ids(two)


async def test_a_tenant_at_its_cap_does_not_block_the_lane(
    db: DatabaseManager, tenants: Tenants
) -> None:
    queue = QueueRepo(db)
    busy, idle = await tenants.new(CAPPED), await tenants.new(CAPPED)
    lane = unique("lane")
    caps = {CAPPED: CAP}
    await add_runs(db, busy, lane, 50)
    [idle_run] = await add_runs(db, idle, lane, 1)
    first = await queue.claim_batch(lane, "w", limit=2, lease_ttl_s=TTL_S, tenant_caps=caps)
    # Round-robin: one run of each tenant; the busy tenant then fills its cap.
    assert idle_run in ids(first)
    await queue.claim_batch(lane, "w", limit=5, lease_ttl_s=TTL_S, tenant_caps=caps)
    assert (await running_per_tenant(db, [busy]))[busy] == CAP
    [extra] = await add_runs(db, idle, lane, 1)
    # The busy tenant's 48 older runs are passed over: it has no free slot.
    after = await queue.claim_batch(lane, "w", limit=1, lease_ttl_s=TTL_S, tenant_caps=caps)
    assert ids(after) == [extra]


async def test_claimed_rows_match_the_database(db: DatabaseManager, tenants: Tenants) -> None:
    queue = QueueRepo(db)
    tenant = await tenants.new()
    lane = unique("lane")
    await add_runs(db, tenant, lane, 5)
    batch = await queue.claim_batch(lane, "w", limit=5, lease_ttl_s=TTL_S, tenant_caps=NO_CAP)
    async with db.connect() as conn:
        rows = {
            row.id: row for row in await conn.execute(select(runs).where(runs.c.id.in_(ids(batch))))
        }
    for claim in batch:
        row = rows[claim.run.run_id]
        assert (row.status, row.attempt, row.lease_owner) == ("running", 1, "w")
        assert row.lease_expires_at == claim.run.lease_expires_at


async def test_claimed_runs_are_their_rows_as_stored(db: DatabaseManager, tenants: Tenants) -> None:
    # The servers build the claimed rows from the locked ones instead of reading them back:
    # every column must be what the database holds, on the first claim and on a later one.
    queue = QueueRepo(db)
    tenant = await tenants.new()
    lane = unique("lane")
    await add_runs(db, tenant, lane, 5)
    for owner in ("first", "second"):
        batch = await queue.claim_batch(lane, owner, limit=5, lease_ttl_s=TTL_S, tenant_caps=NO_CAP)
        assert len(batch) == 5
        async with db.connect() as conn:
            stored = await conn.execute(select(runs).where(runs.c.id.in_(ids(batch))))
            rows = {row["id"]: run_from_row(row) for row in stored.mappings()}
        assert [claim.run for claim in batch] == [rows[run_id] for run_id in ids(batch)]
        await requeue_all(db, tenant)


async def test_a_claim_says_whether_a_cap_held_runs_back(
    db: DatabaseManager, tenants: Tenants
) -> None:
    queue = QueueRepo(db)
    caps = {CAPPED: CAP}
    lane = unique("lane")
    await add_runs(db, await tenants.new(CAPPED), lane, CAP + 1)
    first = await queue.claim(lane, "w", limit=5, lease_ttl_s=TTL_S, tenant_caps=caps)
    assert len(first.claims) == CAP and first.is_capped
    again = await queue.claim(lane, "w", limit=5, lease_ttl_s=TTL_S, tenant_caps=caps)
    assert (again.claims, again.is_capped) == ([], True)
    assert again.began_monotonic_s > first.began_monotonic_s
    # Fewer runs than slots and no cap in the way: nothing is held back.
    open_lane = unique("lane")
    await add_runs(db, await tenants.new(), open_lane, 2)
    taken = await queue.claim(open_lane, "w", limit=5, lease_ttl_s=TTL_S, tenant_caps=NO_CAP)
    assert len(taken.claims) == 2 and not taken.is_capped
    empty = await queue.claim(open_lane, "w", limit=5, lease_ttl_s=TTL_S, tenant_caps=NO_CAP)
    assert (empty.claims, empty.is_capped) == ([], False)


@pytest.mark.requires("skip_locked")
async def test_a_run_locked_by_another_transaction_is_skipped_not_waited_for(
    db: DatabaseManager, tenants: Tenants
) -> None:
    # A cancel (or any writer) holding a queued run's row: the claim takes the runs around it
    # at once and leaves that one alone.
    queue = QueueRepo(db)
    tenant = await tenants.new()
    lane = unique("lane")
    held, *free_runs = await add_runs(db, tenant, lane, 4)
    async with db.write_transaction() as conn:
        await conn.execute(db.backend.lock_rows(select(runs.c.id).where(runs.c.id == held)))
        async with asyncio.timeout(10):
            batch = await queue.claim_batch(
                lane, "w", limit=10, lease_ttl_s=TTL_S, tenant_caps=NO_CAP
            )
        assert sorted(ids(batch)) == sorted(free_runs)
    [late] = await queue.claim_batch(lane, "w", limit=10, lease_ttl_s=TTL_S, tenant_caps=NO_CAP)
    assert late.run.run_id == held


async def test_a_run_ending_while_a_claim_waits_for_its_tenant_still_reads_as_capped(
    db: DatabaseManager, tenants: Tenants
) -> None:
    # The claim's first count sizes the tenant's allotment; a run of the tenant that ends
    # before the recount (under the tenant's lock) leaves eligible runs unread. The batch must
    # say "capped" (a freed slot may claim them), not "lane empty": the worker would wait for
    # a wake-up those runs sent before the claim began, and sit out its slow poll.
    if not db.backend.capabilities.row_locks:
        pytest.skip("SQLite claims under one write lock: its first count is the last")
    queue = QueueRepo(db)
    caps = {CAPPED: CAP}
    lane = unique("lane")
    tenant = await tenants.new(CAPPED)
    await add_runs(db, tenant, lane, CAP + 3)
    first = await queue.claim(lane, "w", limit=CAP - 1, lease_ttl_s=TTL_S, tenant_caps=caps)
    assert len(first.claims) == CAP - 1
    async with db.transaction() as conn:
        # A finish of the running run holds the tenant's row, as the completer's would.
        await conn.execute(lock_tenants_statement(db.backend), {"ids": [tenant]})
        ended = [claim.fence.run_id for claim in first.claims]
        await conn.execute(
            update(runs).where(runs.c.id.in_(ended)).values(status=RunStatus.SUCCEEDED.value)
        )
        claiming = asyncio.create_task(
            queue.claim(lane, "w", limit=2, lease_ttl_s=TTL_S, tenant_caps=caps)
        )
        await wait_for(
            lambda: waits_for_a_lock(db, "SELECT tenants.id%FOR%UPDATE%"),
            message="the claim to wait for the tenant",
        )
    batch = await claiming
    assert len(batch.claims) == 1  # allotted by the first count: CAP - 1 running, 1 free
    assert batch.is_capped
