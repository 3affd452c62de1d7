"""Real faults injected into real worker processes, on every backend (issue 3).

kill -9 at random under load, SIGSTOP past the lease, a run that kills its worker every time,
SIGTERM with runs in flight. Each asserts what must hold afterwards: every run ends exactly
once, interrupted runs come back in bounded time, a paused worker writes nothing after its
lease is taken, tenant caps hold throughout.
"""

import asyncio
import random
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import func, select

from moorline.db.manager import DatabaseManager
from moorline.db.repos.runs import RunsRepo
from moorline.db.schema import events
from moorline.types import TERMINAL_STATUSES, JSONObject, TenantId
from tests.contract.queue_helpers import Tenants, event_types, running_per_tenant, statuses
from tests.faults.harness import (
    LEASE_TTL_S,
    PLAN,
    RECOVERY_BOUND_S,
    Workers,
    held_by,
    owner_pattern,
    pause_between_transactions,
    submit,
    terminal_count,
    terminal_events,
)
from tests.helpers import wait_for

pytestmark = pytest.mark.faults

CHAOS_RUNS = 300
CHAOS_WORKERS = 3
CHAOS_TENANTS = 10
CHAOS_TENANT_CAP = 6
MIN_KILLS = 3
"""Kills of a worker mid-run the chaos test needs before it counts as having tested."""
CAP_TEST_RUNS = 40
CAP_TEST_CAP = 5
TERMINAL = [status.value for status in TERMINAL_STATUSES]


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


@pytest.fixture
def workers(database_url: str, tmp_path: Path) -> Iterator[Workers]:
    made = Workers(database_url, tmp_path)
    yield made
    made.kill_all()


async def database_time(db: DatabaseManager) -> datetime:
    async with db.connect() as conn:
        value: datetime = (await conn.execute(select(db.backend.now()))).scalar_one()
    return value


async def reclaimed_at(db: DatabaseManager, run_id: str, attempt: int) -> datetime | None:
    async with db.connect() as conn:
        value: datetime | None = (
            await conn.execute(
                select(func.min(events.c.created_at)).where(
                    events.c.run_id == run_id,
                    events.c.attempt == attempt,
                    events.c.type == "reclaimed",
                )
            )
        ).scalar_one()
    return value


async def test_kill_9_at_random_loses_and_doubles_nothing(
    db: DatabaseManager, tenants: Tenants, workers: Workers
) -> None:
    workers.measured = False  # killed at random: see Workers.measured
    rng = random.Random(20261123)
    workers.tenant_concurrency = CHAOS_TENANT_CAP
    tenant_ids = [await tenants.new(PLAN) for _ in range(CHAOS_TENANTS)]

    def batch(count: int) -> list[JSONObject]:
        return [{"seconds": rng.uniform(1.0, 2.5)} for _ in range(count)]

    run_ids = await submit(RunsRepo(db), tenant_ids, "work", batch(CHAOS_RUNS))
    for _ in range(CHAOS_WORKERS):
        workers.start()
    interrupted: list[tuple[str, int, datetime]] = []
    most_running: Counter[str] = Counter()
    kills = 0
    deadline = time.monotonic() + 240
    next_kill = time.monotonic() + rng.uniform(0.5, 3.0)
    while (ended := await terminal_count(db, run_ids)) < len(run_ids):
        assert time.monotonic() < deadline, "runs did not all finish within 240 s"
        if kills < MIN_KILLS and len(run_ids) - ended < CHAOS_RUNS // 4:
            # A slow machine boots replacement workers slowly: keep work coming until the
            # test has killed enough workers mid-run to mean something.
            run_ids += await submit(RunsRepo(db), tenant_ids, "work", batch(CHAOS_RUNS // 4))
        for tenant, running in (await running_per_tenant(db, tenant_ids)).items():
            most_running[tenant] = max(most_running[tenant], running)
        # Kill only workers that are serving: one still starting up runs nothing yet, and
        # killing those would leave no reaper alive rather than test recovery.
        serving = [proc for proc in workers.alive() if workers.is_serving(proc)]
        if time.monotonic() >= next_kill and len(serving) == CHAOS_WORKERS:
            victim = rng.choice(serving)
            victim.kill()
            victim.wait()
            killed_at = await database_time(db)
            interrupted += [(r, a, killed_at) for r, a in await held_by(db, owner_pattern(victim))]
            kills += 1
            workers.start()
            next_kill = time.monotonic() + rng.uniform(0.5, 3.0)
        await asyncio.sleep(0.05)  # sampling cadence of the cap check, not synchronisation
    workers.terminate_all()

    assert kills >= MIN_KILLS, f"only {kills} kills happened: the test did not test"
    assert interrupted, "no kill interrupted a run: the test did not test"
    assert max(most_running.values()) <= CHAOS_TENANT_CAP, most_running
    assert max(most_running.values()) == CHAOS_TENANT_CAP, "no tenant reached its cap: untested"
    assert set((await statuses(db, run_ids)).values()) <= {
        ("succeeded", attempt) for attempt in range(1, 51)
    }
    doubled = {r: n for r, n in (await terminal_events(db, run_ids)).items() if n != 1}
    assert not doubled, f"runs with more than one terminal transition: {doubled}"
    slow: list[tuple[str, float]] = []
    for run_id, attempt, killed_at in interrupted:
        back = await reclaimed_at(db, run_id, attempt)
        assert back is not None, f"run {run_id} attempt {attempt} was never reclaimed"
        took = (back - killed_at).total_seconds()
        if took > RECOVERY_BOUND_S:
            slow.append((run_id, took))
    assert not slow, f"reclaimed later than {RECOVERY_BOUND_S}s after the kill: {slow}"


@pytest.mark.requires("server")  # SQLite's cap is sampled in the kill -9 test above
async def test_four_workers_never_exceed_a_tenant_cap(
    db: DatabaseManager, tenants: Tenants, workers: Workers
) -> None:
    # 4 workers x 20 slots could run 80 at once; each tenant may run CAP_TEST_CAP.
    workers.tenant_concurrency = CAP_TEST_CAP
    tenant_ids = [await tenants.new(PLAN) for _ in range(2)]
    run_ids = await submit(RunsRepo(db), tenant_ids, "work", [{"seconds": 0.3}] * CAP_TEST_RUNS)
    for _ in range(4):
        workers.start()
    most_running: Counter[str] = Counter()
    deadline = time.monotonic() + 120
    while await terminal_count(db, run_ids) < CAP_TEST_RUNS:
        assert time.monotonic() < deadline, "runs did not all finish within 120 s"
        for tenant, running in (await running_per_tenant(db, tenant_ids)).items():
            most_running[tenant] = max(most_running[tenant], running)
        await asyncio.sleep(0.02)  # sampling cadence of the cap check, not synchronisation
    workers.terminate_all()
    assert max(most_running.values()) <= CAP_TEST_CAP, most_running
    assert min(most_running.values()) == CAP_TEST_CAP, f"a cap was never reached: {most_running}"


async def test_a_worker_paused_past_its_lease_writes_nothing_and_stops(
    db: DatabaseManager, tenants: Tenants, workers: Workers
) -> None:
    tenant = await tenants.new(PLAN)
    paused = workers.start()
    [run_id] = await submit(
        RunsRepo(db), [tenant], "first_attempt_hangs", [{"seconds": 20 * LEASE_TTL_S}]
    )

    async def held_by_paused() -> bool:
        return bool(await held_by(db, owner_pattern(paused)))

    await wait_for(held_by_paused, timeout_s=30, message="the first worker to claim the run")
    workers.start()
    await pause_between_transactions(db, paused)
    stopped_at = time.monotonic()

    async def finished_by_successor() -> bool:
        done = (await statuses(db, [run_id]))[run_id] == ("succeeded", 2)
        return done and time.monotonic() - stopped_at >= 3 * LEASE_TTL_S

    await wait_for(finished_by_successor, timeout_s=30, message="the successor to finish the run")
    paused.send_signal(signal.SIGCONT)

    async def paused_worker_stopped_the_run() -> bool:
        return "lease lost" in workers.log(paused)

    # Within one heartbeat interval (TTL/3) of waking, plus process scheduling slack.
    await wait_for(
        paused_worker_stopped_the_run, timeout_s=LEASE_TTL_S / 3 + 2.0, message="self-fence"
    )
    workers.terminate_all()
    assert paused.returncode == 0, workers.log(paused)
    kinds = await event_types(db, run_id)
    assert kinds == ["queued", "started", "reclaimed", "started", "succeeded"], kinds
    async with db.connect() as conn:
        late = await conn.execute(
            select(events.c.type).where(
                events.c.run_id == run_id,
                events.c.attempt == 1,
                events.c.type.not_in(["queued", "started", "reclaimed"]),
            )
        )
        assert list(late) == [], "the paused worker wrote for a run it had lost"
    assert (await statuses(db, [run_id]))[run_id] == ("succeeded", 2)


async def test_a_run_that_kills_its_worker_every_time_fails_after_max_attempts(
    db: DatabaseManager, tenants: Tenants, workers: Workers
) -> None:
    workers.measured = False  # each one dies by os._exit, which writes no coverage data
    tenant = await tenants.new(PLAN)
    [run_id] = await submit(RunsRepo(db), [tenant], "kills_its_worker", [{}], max_attempts=3)

    async def failed_while_respawning() -> bool:
        # Two alive at all times: when a claim kills one, the other is already serving and
        # reaps and reclaims the run once the lease expires, instead of the run waiting for
        # a replacement to start (several seconds on a loaded machine, for each attempt).
        while len(workers.alive()) < 2:
            workers.start()
        return (await statuses(db, [run_id]))[run_id][0] in TERMINAL

    await wait_for(failed_while_respawning, timeout_s=60, interval_s=0.1, message="run failed")
    assert (await statuses(db, [run_id]))[run_id] == ("failed", 3)
    assert (await event_types(db, run_id)).count("started") == 3
    run = await RunsRepo(db).get(run_id)
    assert run is not None and isinstance(run.error, dict)
    assert run.error["reason"] == "max attempts"
    workers.terminate_all()


async def test_sigterm_releases_runs_in_flight_and_leaves_none_running(
    db: DatabaseManager, tenants: Tenants, workers: Workers
) -> None:
    workers.grace_s = 0.5
    tenant_ids: list[TenantId] = [await tenants.new(PLAN) for _ in range(2)]
    procs = [workers.start(), workers.start()]

    async def both_serving() -> bool:
        return all(workers.is_serving(proc) for proc in procs)

    await wait_for(both_serving, timeout_s=30, message="both workers serving")
    run_ids = await submit(RunsRepo(db), tenant_ids, "work", [{"seconds": 60.0}] * 8)

    async def all_running() -> bool:
        return all(s == "running" for s, _ in (await statuses(db, run_ids)).values())

    await wait_for(all_running, timeout_s=30, message="all eight runs running")
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        assert proc.wait(20) == 0, workers.log(proc)
    assert {s for s, _ in (await statuses(db, run_ids)).values()} == {"queued"}
    for run_id in run_ids:
        assert (await event_types(db, run_id))[-1] == "released"
