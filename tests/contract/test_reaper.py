"""The reaper on every backend: reclaiming, max attempts, leadership, the loop, concurrency.

docs/reliability.md C1 is ``test_concurrent_reapers_requeue_each_expired_run_exactly_once``: 8
reapers that all lead (each holds a leader lease of its own name, the worst case of "two
processes both think they lead") over 1,000 expired runs, while 100 more expire during the test
and 100 live runs keep renewing a lease shorter than the test.
"""

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import func, insert, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from moorline.db.manager import DatabaseManager
from moorline.db.repos.queue import (
    EVENT_CANCELLED,
    EVENT_FAILED,
    EVENT_RECLAIMED,
    MAX_ATTEMPTS_REASON,
    QueueRepo,
)
from moorline.db.repos.records import Fence
from moorline.db.schema import leader_leases, runs
from moorline.dispatch.leader import LeaderElector
from moorline.dispatch.reaper import (
    LEADER_LEASE,
    Reaper,
    is_transient_error,
    leader_ttl_s,
    make_reaper,
)
from moorline.dispatch.wakeups import LocalWakeups
from moorline.errors import BackendUnavailable
from moorline.observability.metrics import Metrics
from moorline.settings import Settings
from moorline.types import Attempt, JSONValue, RunId, RunStatus, TenantId
from tests.contract.queue_helpers import (
    NO_CAP,
    Tenants,
    add_runs,
    event_counts,
    event_types,
    statuses,
    unique,
)
from tests.helpers import sampled, wait_for
from tests.servers import run_sql

INSERT_CHUNK = 500

RACE_EXPIRED = 1_000
RACE_EXPIRING = 100
RACE_LIVE = 100
RACE_REAPERS = 8
RACE_BATCH = 100
RACE_HEARTBEAT_WORKERS = 4
LIVE_TTL_S = 6.0
"""Lease of the live runs; each heartbeat round renews it to database time + this."""
LIVE_FIRST_LEASE_S = 1.0
"""The live runs' leases at the start: shorter than the test, so only heartbeats keep them."""
EXPIRING_IN_S = 1.5
"""The runs that expire mid-test do so this long after the start."""
HEARTBEAT_EVERY_S = LIVE_TTL_S / 3
PASS_EVERY_S = 0.05
"""The racing reapers' interval."""


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


async def add_running(
    db: DatabaseManager,
    tenant_id: TenantId,
    lane: str,
    count: int,
    *,
    lease_s: float,
    owner: str = "gone-worker",
    attempt: int = 1,
    max_attempts: int = 3,
) -> list[Fence]:
    """Insert ``count`` runs held by ``owner``, leases ending at database time + ``lease_s``.

    A negative ``lease_s`` means already expired, as if the worker died that long ago.
    """
    async with db.connect() as conn:
        now: datetime = (await conn.execute(select(db.backend.now()))).scalar_one()
    fences = [
        Fence(run_id=RunId(str(uuid.uuid4())), attempt=Attempt(attempt), owner=owner)
        for _ in range(count)
    ]
    rows: list[dict[str, Any]] = [
        {
            "id": fence.run_id,
            "tenant_id": tenant_id,
            "workflow": "noop",
            "status": RunStatus.RUNNING.value,
            "lane": lane,
            "priority": 0,
            "attempt": attempt,
            "max_attempts": max_attempts,
            "lease_owner": owner,
            "lease_expires_at": now + timedelta(seconds=lease_s),
            "not_before": now - timedelta(hours=1),
            "input_hash": "0" * 64,
            "input": {},
            "created_at": now,
            "updated_at": now,
            "started_at": now,
            "prompt_tokens": 0,
            "completion_tokens": 0,
        }
        for fence in fences
    ]
    for offset in range(0, len(rows), INSERT_CHUNK):
        async with db.transaction() as conn:
            await conn.execute(insert(runs), rows[offset : offset + INSERT_CHUNK])
    return fences


def ids(fences: Sequence[Fence]) -> list[str]:
    return [fence.run_id for fence in fences]


async def run_errors(db: DatabaseManager, run_ids: Sequence[str]) -> dict[str, JSONValue]:
    async with db.connect() as conn:
        rows = await conn.execute(select(runs.c.id, runs.c.error).where(runs.c.id.in_(run_ids)))
        return {row.id: row.error for row in rows}


def new_reaper(
    db: DatabaseManager,
    lease: str,
    holder: str,
    *,
    interval_s: float = 0.05,
    batch_limit: int = 100,
    clock: Callable[[], float] | None = None,
    verify_every: int = 5,
    backoff: Callable[[Attempt], float] | None = None,
    notifier: LocalWakeups | None = None,
    metrics: Metrics | None = None,
) -> Reaper:
    """A reaper; reapers given the same ``lease`` name compete for one leadership."""
    queue = QueueRepo(db)
    if clock is None:
        elector = LeaderElector(
            queue, name=lease, holder=holder, ttl_s=30.0, verify_every=verify_every
        )
    else:
        elector = LeaderElector(
            queue, name=lease, holder=holder, ttl_s=30.0, verify_every=verify_every, clock=clock
        )
    return Reaper(
        queue,
        elector,
        interval_s=interval_s,
        batch_limit=batch_limit,
        backoff=backoff,
        notifier=notifier,
        metrics=metrics,
    )


async def test_expired_runs_are_requeued_and_exhausted_ones_failed(
    db: DatabaseManager, tenants: Tenants
) -> None:
    tenant = await tenants.new()
    lane = unique("lane")
    expired = await add_running(db, tenant, lane, 3, lease_s=-5.0)
    exhausted = await add_running(db, tenant, lane, 2, lease_s=-5.0, attempt=3, max_attempts=3)
    live = await add_running(db, tenant, lane, 2, lease_s=60.0, owner="live-worker")
    metrics = Metrics()
    reaper = new_reaper(db, unique("lease"), "reaper", metrics=metrics)

    reaped = await reaper.tick()

    reclaims = "moorline_reclaims_total"
    assert sampled(metrics.reclaims, reclaims, lane=lane, status="queued") == 3
    assert sampled(metrics.reclaims, reclaims, lane=lane, status="failed") == 2
    assert sorted((r.run_id, r.status, r.attempt, r.lane) for r in reaped) == sorted(
        [(f.run_id, RunStatus.QUEUED, f.attempt, lane) for f in expired]
        + [(f.run_id, RunStatus.FAILED, f.attempt, lane) for f in exhausted]
    )
    states = await statuses(db, ids(expired + exhausted + live))
    assert {states[i] for i in ids(expired)} == {("queued", 1)}  # the next claim counts
    assert {states[i] for i in ids(exhausted)} == {("failed", 3)}
    assert {states[i] for i in ids(live)} == {("running", 1)}
    errors = await run_errors(db, ids(exhausted))
    for run_id in ids(exhausted):
        error = errors[run_id]
        assert isinstance(error, dict) and error["reason"] == MAX_ATTEMPTS_REASON
        assert await event_types(db, run_id) == [EVENT_FAILED]
    for run_id in ids(expired):
        assert await event_types(db, run_id) == [EVENT_RECLAIMED]
    assert await reaper.tick() == []  # nothing left to take


async def request_cancel(db: DatabaseManager, run_ids: Sequence[str]) -> None:
    async with db.transaction() as conn:
        await conn.execute(
            update(runs).where(runs.c.id.in_(run_ids)).values(cancel_requested_at=db.backend.now())
        )


async def test_one_call_moves_a_mixed_batch_to_each_outcome(
    db: DatabaseManager, tenants: Tenants
) -> None:
    # Every outcome, several attempts and attempt budgets, per-attempt backoff: one batch.
    queue = QueueRepo(db)
    tenant = await tenants.new()
    lane = unique("lane")
    first = await add_running(db, tenant, lane, 2, lease_s=-9.0, attempt=1, max_attempts=3)
    second = await add_running(db, tenant, lane, 2, lease_s=-8.0, attempt=2, max_attempts=3)
    used_up = await add_running(db, tenant, lane, 2, lease_s=-7.0, attempt=3, max_attempts=3)
    tight = await add_running(db, tenant, lane, 1, lease_s=-6.0, attempt=2, max_attempts=2)
    cancelled = await add_running(db, tenant, lane, 2, lease_s=-5.0, attempt=1, max_attempts=3)
    cancelled_used_up = await add_running(
        db, tenant, lane, 1, lease_s=-5.0, attempt=3, max_attempts=3
    )
    cancelling_live = await add_running(db, tenant, lane, 1, lease_s=60.0, owner="live-worker")
    await request_cancel(db, ids(cancelled + cancelled_used_up + cancelling_live))
    requeued, failed = first + second, used_up + tight
    stopped = cancelled + cancelled_used_up

    reaped = await queue.reap_expired(limit=100, backoff=lambda attempt: 60.0 * attempt)

    assert sorted((r.run_id, r.status, r.attempt, r.lane) for r in reaped) == sorted(
        [(f.run_id, RunStatus.QUEUED, f.attempt, lane) for f in requeued]
        + [(f.run_id, RunStatus.FAILED, f.attempt, lane) for f in failed]
        + [(f.run_id, RunStatus.CANCELLED, f.attempt, lane) for f in stopped]
    )
    # Oldest lease first (the runs of one add_running share theirs).
    order = [r.run_id for r in reaped]
    assert (set(order[:2]), set(order[2:4])) == (set(ids(first)), set(ids(second)))
    states = await statuses(db, ids(requeued + failed + stopped + cancelling_live))
    assert {run_id: states[run_id] for run_id in ids(requeued + failed + stopped)} == {
        **{f.run_id: ("queued", f.attempt) for f in requeued},
        **{f.run_id: ("failed", f.attempt) for f in failed},
        **{f.run_id: ("cancelled", f.attempt) for f in stopped},
    }
    assert states[cancelling_live[0].run_id] == ("running", 1)  # live: the worker stops it
    errors = await run_errors(db, ids(failed))
    for fence, budget in [(used_up[0], 3), (used_up[1], 3), (tight[0], 2)]:
        assert errors[fence.run_id] == {
            "reason": MAX_ATTEMPTS_REASON,
            "message": f"lease expired on attempt {fence.attempt} of {budget}",
        }
        assert await event_types(db, fence.run_id) == [EVENT_FAILED]
    for fence in stopped:
        assert await event_types(db, fence.run_id) == [EVENT_CANCELLED]
    async with db.connect() as conn:
        rows = (
            await conn.execute(
                select(
                    runs.c.id,
                    runs.c.not_before,
                    runs.c.finished_at,
                    runs.c.lease_owner,
                    runs.c.lease_expires_at,
                    db.backend.now().label("now"),
                ).where(runs.c.id.in_(ids(requeued + failed + stopped)))
            )
        ).all()
    for row in rows:
        assert (row.lease_owner, row.lease_expires_at) == (None, None)
        assert (row.finished_at is None) == (row.id in ids(requeued))
    for fence in requeued:
        [row] = [row for row in rows if row.id == fence.run_id]
        delay_s = (row.not_before - row.now).total_seconds()
        assert 60.0 * fence.attempt - 5 < delay_s <= 60.0 * fence.attempt
        assert await event_types(db, fence.run_id) == [EVENT_RECLAIMED]
    assert await queue.reap_expired() == []


async def test_a_call_takes_at_most_limit_runs_oldest_lease_first(
    db: DatabaseManager, tenants: Tenants
) -> None:
    queue = QueueRepo(db)
    tenant = await tenants.new()
    lane = unique("lane")
    oldest = await add_running(db, tenant, lane, 2, lease_s=-30.0)
    newer = await add_running(db, tenant, lane, 3, lease_s=-10.0)
    assert sorted(r.run_id for r in await queue.reap_expired(limit=2)) == sorted(ids(oldest))
    assert sorted(r.run_id for r in await queue.reap_expired(limit=10)) == sorted(ids(newer))
    assert await queue.reap_expired(limit=0) == []


async def test_only_the_leader_reaps(db: DatabaseManager, tenants: Tenants) -> None:
    lease = unique("lease")
    leader = new_reaper(db, lease, "leader")
    follower = new_reaper(db, lease, "follower")
    assert await leader.tick() == []  # takes the leadership; nothing expired yet
    tenant = await tenants.new()
    [fence] = await add_running(db, tenant, unique("lane"), 1, lease_s=-5.0)
    assert await follower.tick() == []
    assert await statuses(db, [fence.run_id]) == {fence.run_id: ("running", 1)}
    assert [r.run_id for r in await leader.tick()] == [fence.run_id]


async def test_two_reapers_that_both_believe_they_lead_move_each_run_once(
    db: DatabaseManager, tenants: Tenants
) -> None:
    lease = unique("lease")
    clock = FakeClock()  # stands still: the paused leader trusts its cache
    paused = new_reaper(db, lease, "paused", batch_limit=10, clock=clock, verify_every=1_000)
    successor = new_reaper(db, lease, "successor", batch_limit=10)
    assert await paused.tick() == []
    # The paused leader's lease runs out; the successor takes over. The paused one does not
    # know yet, so both act.
    assert await successor.elector.tick() is False
    await expire_leader_lease(db, lease)
    assert await successor.elector.tick()
    tenant = await tenants.new()
    fences = await add_running(db, tenant, unique("lane"), 300, lease_s=-5.0)
    taken: Counter[str] = Counter()
    while True:
        first, second = await asyncio.gather(paused.tick(), successor.tick())
        assert paused.elector.is_leader and successor.elector.is_leader
        taken.update(r.run_id for r in first + second)
        if not first and not second:
            break
    assert taken == Counter(ids(fences))
    assert await event_counts(db, ids(fences), EVENT_RECLAIMED) == Counter(ids(fences))


async def expire_leader_lease(db: DatabaseManager, name: str) -> None:
    async with db.transaction() as conn:
        await conn.execute(
            update(leader_leases)
            .where(leader_leases.c.name == name)
            .values(expires_at=db.backend.now(plus_s=-1.0))
        )


async def test_reaper_notifies_the_lanes_that_got_runs_back(
    db: DatabaseManager, tenants: Tenants
) -> None:
    wakeups = LocalWakeups()
    reaper = new_reaper(db, unique("lease"), "reaper", notifier=wakeups)
    tenant = await tenants.new()
    requeued_lane, failed_lane = unique("lane"), unique("lane")
    await add_running(db, tenant, requeued_lane, 2, lease_s=-5.0)
    await add_running(db, tenant, failed_lane, 1, lease_s=-5.0, attempt=3, max_attempts=3)
    woken = asyncio.create_task(wakeups.wait(requeued_lane, 30.0))
    assert len(await reaper.tick()) == 3
    assert await woken
    # A lane whose run only failed has nothing new to claim.
    assert not await wakeups.wait(failed_lane, 0)


async def test_a_reclaimed_run_keeps_its_place_ahead_of_the_backlog(
    db: DatabaseManager, tenants: Tenants
) -> None:
    """Recovery takes the lease and a reaper pass, not the time to drain the whole backlog."""
    tenant = await tenants.new()
    lane = unique("lane")
    # Claimed an hour ago (add_running's not_before); the backlog was queued after it.
    [crashed] = await add_running(db, tenant, lane, 1, lease_s=-5.0)
    await add_runs(db, tenant, lane, 20, not_before=datetime.now(UTC) - timedelta(minutes=30))
    reaper = new_reaper(db, unique("lease"), "reaper")
    assert [r.run_id for r in await reaper.tick()] == [crashed.run_id]
    [first] = await QueueRepo(db).claim_batch(
        lane, "next-worker", limit=1, lease_ttl_s=30.0, tenant_caps=NO_CAP
    )
    assert first.fence.run_id == crashed.run_id, "the reclaimed run went behind the backlog"
    assert first.fence.attempt == 2


async def test_reclaimed_runs_wait_out_the_backoff(db: DatabaseManager, tenants: Tenants) -> None:
    reaper = new_reaper(db, unique("lease"), "reaper", backoff=lambda attempt: 60.0 * attempt)
    tenant = await tenants.new()
    [fence] = await add_running(db, tenant, unique("lane"), 1, lease_s=-5.0)
    assert [r.run_id for r in await reaper.tick()] == [fence.run_id]
    async with db.connect() as conn:
        delay = (
            await conn.execute(
                select(runs.c.not_before, db.backend.now()).where(runs.c.id == fence.run_id)
            )
        ).one()
    assert 55 < (delay[0] - delay[1]).total_seconds() <= 60


async def test_the_loop_reaps_until_stopped_then_resigns(
    db: DatabaseManager, tenants: Tenants
) -> None:
    lease = unique("lease")
    reaper = new_reaper(db, lease, "looping")
    stop = asyncio.Event()
    loop = asyncio.create_task(reaper.run(stop))
    tenant = await tenants.new()
    for _ in range(3):  # runs that expire while the loop runs are taken on a later pass
        [fence] = await add_running(db, tenant, unique("lane"), 1, lease_s=-1.0)

        async def requeued(run_id: str = fence.run_id) -> bool:
            return (await statuses(db, [run_id]))[run_id] == ("queued", 1)

        await wait_for(requeued, message="the loop to reap the run")
    stop.set()
    await asyncio.wait_for(loop, timeout=10)
    queue = QueueRepo(db)
    assert not await queue.is_leader(lease, "looping")
    # Resigned: another process leads on its very first tick, with no TTL to wait out.
    assert await LeaderElector(queue, name=lease, holder="next", ttl_s=30.0).tick()


async def test_a_programming_error_ends_the_loop_after_resigning(
    db: DatabaseManager, tenants: Tenants
) -> None:
    def broken_backoff(attempt: Attempt) -> float:
        return 1 / (attempt - attempt)

    lease = unique("lease")
    reaper = new_reaper(db, lease, "buggy", backoff=broken_backoff)
    assert await reaper.tick() == []  # leads
    await add_running(db, await tenants.new(), unique("lane"), 1, lease_s=-5.0)
    with pytest.raises(ZeroDivisionError):
        await asyncio.wait_for(reaper.run(asyncio.Event()), timeout=10)
    assert not await QueueRepo(db).is_leader(lease, "buggy")


def test_transient_errors_are_told_from_bugs() -> None:
    from sqlalchemy.exc import OperationalError, ProgrammingError

    from moorline.db.dsn import DatabaseUnreachable

    assert is_transient_error(OperationalError("SELECT 1", {}, Exception("gone")))
    assert is_transient_error(DatabaseUnreachable([("db", "refused")]))
    assert is_transient_error(ConnectionResetError())
    assert not is_transient_error(ProgrammingError("SELECT x", {}, Exception("no column")))
    assert not is_transient_error(ZeroDivisionError())


def test_leader_ttl_fits_five_cached_ticks_inside_the_recovery_bound() -> None:
    assert leader_ttl_s(5.0, 90.0) == 50.0  # the defaults: five cached ticks fit
    assert leader_ttl_s(2.0, 10.0) == pytest.approx(20 / 3)  # bounded by the run lease
    assert leader_ttl_s(2.0, 1.0) == 6.0  # never under three intervals


async def test_make_reaper_uses_the_settings(db: DatabaseManager, settings: Settings) -> None:
    reaper = make_reaper(settings, db)
    assert reaper.interval_s == settings.reaper_interval
    assert reaper.elector.name == LEADER_LEASE
    assert reaper.elector.ttl_s == leader_ttl_s(settings.reaper_interval, settings.lease_ttl)
    other = make_reaper(settings, db)
    assert other.elector.holder != reaper.elector.holder


@pytest.mark.faults
@pytest.mark.requires("terminate_backend")
async def test_the_loop_survives_the_database_going_away(
    db: DatabaseManager,
    tenants: Tenants,
    database_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="moorline.dispatch.reaper")
    name = make_url(database_url).database
    assert name is not None
    reaper = new_reaper(db, unique("lease"), "survivor")
    stop = asyncio.Event()
    loop = asyncio.create_task(reaper.run(stop))
    tenant = await tenants.new()
    lane = unique("lane")

    async def reaped(run_id: str) -> bool:
        return (await statuses(db, [run_id]))[run_id][0] == "queued"

    [before] = await add_running(db, tenant, lane, 1, lease_s=-1.0)
    await wait_for(lambda: reaped(before.run_id), message="a first reap")

    def failed_passes() -> int:
        return sum("reaper pass failed" in r.getMessage() for r in caplog.records)

    async def outage_seen() -> bool:
        return failed_passes() >= 2

    # Refuse new connections and kill the open ones: every pass fails until it is undone.
    await asyncio.to_thread(run_sql, "postgresql", f"ALTER DATABASE {name} ALLOW_CONNECTIONS false")
    try:
        await asyncio.to_thread(
            run_sql,
            "postgresql",
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'",
        )
        await wait_for(outage_seen, message="passes failing during the outage")
    finally:
        await asyncio.to_thread(
            run_sql, "postgresql", f"ALTER DATABASE {name} ALLOW_CONNECTIONS true"
        )
    assert not loop.done()

    async def back() -> bool:
        # Not at once through PgBouncer: it refuses logins for server_login_retry after a
        # failed one.
        try:
            await statuses(db, [])
        except (BackendUnavailable, DBAPIError):
            return False
        return True

    await wait_for(back, message="the database to accept connections again")
    [after] = await add_running(db, tenant, lane, 1, lease_s=-1.0)
    await wait_for(lambda: reaped(after.run_id), message="a reap after the outage")
    assert not loop.done()
    stop.set()
    await asyncio.wait_for(loop, timeout=10)


async def test_concurrent_reapers_requeue_each_expired_run_exactly_once(
    db: DatabaseManager, tenants: Tenants
) -> None:
    started = time.monotonic()
    queue = QueueRepo(db)
    tenant = await tenants.new()
    lane = unique("lane")
    stop = asyncio.Event()
    lost_leases: list[str] = []
    slowest_round_s = 0.0
    first_rounds: list[asyncio.Event] = []

    async def heartbeats(fences: Sequence[Fence]) -> None:
        # One worker process's heartbeat loop over the runs it holds: one renew_leases per
        # beat, as LeaseKeeper.renew_all does. (Renewing one by one takes over a second per round
        # on SQLite under this load, past the live runs' first lease, so they would be expired
        # and rightly reapable: not live runs any more.)
        nonlocal slowest_round_s
        renewed_once = asyncio.Event()
        first_rounds.append(renewed_once)
        while not stop.is_set():
            round_started = time.monotonic()
            renewed = await queue.renew_leases(fences, LIVE_TTL_S)
            lost_leases.extend(
                fence.run_id
                for fence in fences
                if (fence.run_id, fence.attempt) not in renewed.renewed
            )
            slowest_round_s = max(slowest_round_s, time.monotonic() - round_started)
            renewed_once.set()
            try:
                async with asyncio.timeout(HEARTBEAT_EVERY_S):
                    await stop.wait()
            except TimeoutError:
                pass

    # The live runs' workers heartbeat from the start; their first leases are shorter than
    # the test, so only the heartbeats keep them.
    live = await add_running(
        db, tenant, lane, RACE_LIVE, lease_s=LIVE_FIRST_LEASE_S, owner="live-worker"
    )
    per_worker = len(live) // RACE_HEARTBEAT_WORKERS
    tasks = [
        asyncio.create_task(heartbeats(live[i : i + per_worker]))
        for i in range(0, len(live), per_worker)
    ]
    taken: Counter[str] = Counter()
    # Reapers start once every live run is under its heartbeat's lease: a first round that only
    # landed after the short first lease ran out would make those runs rightly reapable.
    await wait_for(
        lambda: _all_set(first_rounds, RACE_HEARTBEAT_WORKERS), message="first heartbeats"
    )

    async def reap(reaper: Reaper) -> None:
        while not stop.is_set():
            taken.update(r.run_id for r in await reaper.tick())
            try:
                async with asyncio.timeout(PASS_EVERY_S):
                    await stop.wait()
            except TimeoutError:
                pass

    async def all_doomed_requeued() -> bool:
        async with db.connect() as conn:
            left = (
                await conn.execute(
                    select(func.count()).where(
                        runs.c.tenant_id == tenant,
                        runs.c.status == RunStatus.RUNNING.value,
                        runs.c.lease_owner != "live-worker",
                    )
                )
            ).scalar_one()
        return left == 0

    try:
        expired = await add_running(db, tenant, lane, RACE_EXPIRED, lease_s=-5.0)
        expiring = await add_running(db, tenant, lane, RACE_EXPIRING, lease_s=EXPIRING_IN_S)
        doomed = Counter(ids(expired + expiring))
        reapers = [
            new_reaper(db, unique("lease"), f"reaper-{i}", batch_limit=RACE_BATCH)
            for i in range(RACE_REAPERS)
        ]
        tasks += [asyncio.create_task(reap(reaper)) for reaper in reapers]
        await wait_for(all_doomed_requeued, timeout_s=120.0, interval_s=0.2, message="reaping")
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    assert lost_leases == [], (
        f"live runs lost their lease: {lost_leases[:3]}; the slowest heartbeat round took "
        f"{slowest_round_s:.2f}s of a {LIVE_TTL_S}s lease"
    )
    assert time.monotonic() - started > LIVE_FIRST_LEASE_S  # only heartbeats kept them live
    live_ids = set(ids(live))
    twice = sorted(run_id for run_id, n in taken.items() if n > 1)
    assert not twice, f"{len(twice)} runs moved twice, e.g. {twice[:3]}"
    assert not set(taken) & live_ids, f"live runs reaped: {sorted(set(taken) & live_ids)[:3]}"
    missing = sorted(doomed - taken)
    assert not missing, f"{len(missing)} expired runs moved without a reaper saying so"
    reclaimed = await event_counts(db, [*doomed, *live_ids], EVENT_RECLAIMED)
    wrong = sorted(
        run_id for run_id in {*doomed, *reclaimed} if reclaimed[run_id] != doomed[run_id]
    )
    assert not wrong, f"{len(wrong)} runs without exactly one reclaimed event, e.g. {wrong[:3]}"
    assert set((await statuses(db, list(doomed))).values()) == {("queued", 1)}
    assert set((await statuses(db, ids(live))).values()) == {("running", 1)}


async def _all_set(events: Sequence[asyncio.Event], count: int) -> bool:
    return len(events) == count and all(event.is_set() for event in events)
