"""Parked runs across real faults, with real worker processes (issue 16).

Worker processes (``moorline worker``, ``MOORLINE_PARK_AFTER=0`` so every wait parks at once)
run ``tests/faults/suspension_app.py``, while the test kills them with SIGKILL while runs park,
while parked runs resume, and while the timer sweep moves due runs; posts decisions while no
worker lives; and runs two timer sweeps that both lead. Afterwards
:func:`~tests.faults.suspension.check_outcomes` must hold: every run ended ``succeeded``
exactly once, with the decision recorded for it, and no step ran after its checkpoint.

SQLite workers each have their own in-memory RuntimeStore; on the servers they share Redis.
CI runs a few dozen runs per test; ``MOORLINE_FULL=1`` ten times as many.
"""

import asyncio
import subprocess
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from moorline.db.manager import DatabaseManager
from moorline.db.repos.parking import ParkingRepo, Resumed
from moorline.db.repos.queue import QueueRepo
from moorline.db.repos.runs import RunsRepo
from moorline.db.schema import interrupts, leader_leases
from moorline.dispatch.leader import LeaderElector
from moorline.dispatch.timers import LEADER_LEASE, TimerSweep
from moorline.types import JSONObject, JSONValue, RunId, RunStatus, TenantId
from tests.contract.queue_helpers import Tenants
from tests.faults.harness import PLAN, RECOVERY_BOUND_S, Workers, owner_pattern, submit
from tests.faults.suspension import (
    Posted,
    check_outcomes,
    count_by_status,
    decide_all,
    events_of,
    running_under,
    with_status,
)
from tests.faults.suspension_app import MAX_ATTEMPTS
from tests.helpers import FULL_SIZE, wait_for
from tests.servers import REDIS_TEST_URL

pytestmark = pytest.mark.faults

RUNS = 400 if FULL_SIZE else 40
SLOTS = 20
TIMER_INTERVAL_S = 0.2
KILLS = 2
SETTLE_S = 60 + KILLS * RECOVERY_BOUND_S
"""Bound on any one phase: runs parking, resuming or finishing after the faults."""
WAITING = RunStatus.WAITING.value
SUCCEEDED = RunStatus.SUCCEEDED.value


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


@pytest.fixture
def workers(
    backend: str, database_url: str, tmp_path: Path, redis_prefix: str
) -> Iterator[Workers]:
    made = Workers(
        database_url,
        tmp_path,
        slots=SLOTS,
        redis_url=None if backend == "sqlite" else REDIS_TEST_URL,
        redis_prefix=redis_prefix,
        app="tests.faults.suspension_app:app",
        extra_env={
            "MOORLINE_PARK_AFTER": "0",
            "MOORLINE_TIMER_INTERVAL": str(TIMER_INTERVAL_S),
        },
        measured=False,  # killed at random: see Workers.measured
    )
    yield made
    made.kill_all()


@pytest.fixture
def effects(tmp_path: Path) -> Path:
    return tmp_path / "effects.jsonl"


async def start_runs(
    db: DatabaseManager, tenant: TenantId, count: int, **arguments: JSONValue
) -> list[RunId]:
    base: JSONObject = dict(arguments)
    return await submit(RunsRepo(db), [tenant], "parks", [base] * count, max_attempts=MAX_ATTEMPTS)


async def until_all(db: DatabaseManager, run_ids: list[RunId], status: str, what: str) -> None:
    async def reached() -> bool:
        return (await count_by_status(db, run_ids))[status] == len(run_ids)

    await wait_for(reached, timeout_s=SETTLE_S, interval_s=0.05, message=what)


async def kill_while_running(
    db: DatabaseManager, run_ids: list[RunId], proc: subprocess.Popen[bytes], settled: str
) -> list[str]:
    """SIGKILL ``proc`` as soon as it runs one of ``run_ids``; the runs it held then.

    Once every run is ``settled`` there is nothing left to catch in flight (a fast worker
    may have parked or finished the last ones between two looks): ``proc`` is killed all
    the same and no run is returned. The callers assert that some kill caught runs.
    """

    async def holding() -> tuple[list[str], ...]:
        held = await running_under(db, run_ids, owner_pattern(proc))
        if held or (await count_by_status(db, run_ids))[settled] == len(run_ids):
            return (held,)  # truthy, even when empty
        return ()

    [held] = await wait_for(
        holding, timeout_s=SETTLE_S, interval_s=0.005, message="a run in flight"
    )
    proc.kill()
    proc.wait()
    return held


async def test_kill_9_while_runs_park_loses_and_doubles_nothing(
    db: DatabaseManager, tenants: Tenants, workers: Workers, effects: Path
) -> None:
    """Fault: SIGKILL while runs are between their claim and their park, twice."""
    run_ids = await start_runs(db, await tenants.new(PLAN), RUNS, effects=str(effects))
    proc = workers.start()
    interrupted: list[str] = []
    for _ in range(KILLS):
        # Every ``running`` moment of these runs is on the way to the park: the prepare
        # step, the interrupt opened, the park's fenced UPDATE.
        interrupted += await kill_while_running(db, run_ids, proc, WAITING)
        # No process lives: nothing is lost (each run queued, running on a dead lease or
        # waiting) and nothing ended.
        states = await count_by_status(db, run_ids)
        assert sum(states.values()) == len(run_ids)
        assert set(states) <= {"queued", "running", WAITING}, states
        proc = workers.start()
    assert interrupted, "no kill caught a run parking: the test did not test"
    await until_all(db, run_ids, WAITING, "every run parked")
    # A replayed park reopened the interrupt of the attempt it replaced: one per run.
    async with db.connect() as conn:
        opened = Counter(
            (
                await conn.execute(
                    select(interrupts.c.run_id).where(interrupts.c.run_id.in_(run_ids))
                )
            ).scalars()
        )
    assert opened == Counter({run_id: 1 for run_id in run_ids}), "a replay asked twice"
    posted = await decide_all(db, run_ids)
    await until_all(db, run_ids, SUCCEEDED, "every run finished")
    workers.terminate_all()
    await check_outcomes(db, run_ids, effects, posted)


async def test_kill_9_while_runs_resume_loses_and_doubles_nothing(
    db: DatabaseManager, tenants: Tenants, workers: Workers, effects: Path
) -> None:
    """Fault: SIGKILL while decided runs replay and act on their decision, twice."""
    tenant = await tenants.new(PLAN)
    run_ids = await start_runs(db, tenant, RUNS, effects=str(effects), act_s=0.3)
    proc = workers.start()
    await until_all(db, run_ids, WAITING, "every run parked")
    posted = await decide_all(db, run_ids)
    interrupted: list[str] = []
    for _ in range(KILLS):
        interrupted += await kill_while_running(db, run_ids, proc, SUCCEEDED)
        proc = workers.start()
    assert interrupted, "no kill caught a run resuming: the test did not test"
    await until_all(db, run_ids, SUCCEEDED, "every run finished")
    workers.terminate_all()
    resumed = await events_of(db, run_ids, "resumed")
    assert resumed == Counter({run_id: 1 for run_id in run_ids}), "a decision resumed twice"
    await check_outcomes(db, run_ids, effects, posted)


async def timer_leader(db: DatabaseManager) -> str | None:
    async with db.connect() as conn:
        holder: str | None = (
            await conn.execute(
                select(leader_leases.c.holder).where(leader_leases.c.name == LEADER_LEASE)
            )
        ).scalar_one_or_none()
    return holder


async def test_kill_9_of_the_timer_sweep_leader_while_timers_come_due(
    db: DatabaseManager, tenants: Tenants, workers: Workers, effects: Path
) -> None:
    """Fault: SIGKILL of the process leading the timer sweep while it moves due runs."""
    tenant = await tenants.new(PLAN)
    # Sleeps of 2 to 4 s: the sweep moves runs over two seconds, and the kill lands among.
    run_ids: list[RunId] = []
    for index in range(RUNS):
        run_ids += await start_runs(
            db, tenant, 1, effects=str(effects), ask=False, sleep_s=2.0 + 2.0 * index / RUNS
        )
    procs = [workers.start(), workers.start()]

    async def some_resumed() -> bool:
        states = await count_by_status(db, run_ids)
        return sum((await events_of(db, run_ids, "resumed")).values()) > 0 and states[WAITING] > 0

    await wait_for(some_resumed, timeout_s=SETTLE_S, interval_s=0.01, message="timers firing")
    holder = await timer_leader(db)
    assert holder is not None
    [leader] = [proc for proc in procs if f":{proc.pid}:" in holder]
    leader.kill()
    leader.wait()
    parked = await with_status(db, run_ids, WAITING)
    assert parked, "every timer fired before the kill: the test did not test"
    workers.start()  # the survivor takes the lead when the dead one's lease lapses
    await until_all(db, run_ids, SUCCEEDED, "every run finished")
    workers.terminate_all()
    resumed = await events_of(db, run_ids, "resumed")
    assert max(resumed.values()) == 1, "a timer fired twice"
    # A run the leader was executing when it died is reclaimed; if its sleep is due by then,
    # the replay returns at once without parking. Those parked at the kill were all moved.
    assert set(parked) <= set(resumed), "a timer due after the kill never fired"
    assert (await timer_leader(db)) != holder
    await check_outcomes(db, run_ids, effects, {}, keys=("prepare", "finish"))


async def test_decisions_posted_while_no_worker_lives_are_acted_on(
    db: DatabaseManager, tenants: Tenants, workers: Workers, effects: Path
) -> None:
    """Fault: every worker killed; decisions posted, permissions expire; a new worker."""
    tenant = await tenants.new(PLAN)
    decided = await start_runs(db, tenant, RUNS, effects=str(effects))
    expiring = await start_runs(db, tenant, RUNS // 4, effects=str(effects), timeout_s=4.0)
    run_ids = decided + expiring
    proc = workers.start()

    async def all_parked() -> bool:
        # An expiring run may time out and finish before the rest park on a slow machine.
        settled = await with_status(db, expiring, WAITING) + await with_status(
            db, expiring, SUCCEEDED
        )
        parked = await count_by_status(db, decided)
        return parked[WAITING] == len(decided) and len(settled) == len(expiring)

    await wait_for(all_parked, timeout_s=SETTLE_S, interval_s=0.05, message="every run parked")
    proc.kill()
    proc.wait()
    posted = await decide_all(db, decided)
    # The decisions re-queued their runs in their own transactions, with no worker alive.
    assert (await count_by_status(db, decided)) == Counter({"queued": len(decided)})
    expired = Posted(approved=False, reason="timeout", data=None)
    posted |= {run_id: expired for run_id in expiring}
    workers.start()
    await until_all(db, run_ids, SUCCEEDED, "every run finished")
    workers.terminate_all()
    await check_outcomes(db, run_ids, effects, posted)


async def test_two_timer_sweeps_that_both_lead_move_each_run_once(
    db: DatabaseManager, tenants: Tenants, workers: Workers, effects: Path
) -> None:
    """Fault: two sweeps, each leading its own lease, race on the same due runs."""
    workers.extra_env["MOORLINE_TIMER_INTERVAL"] = "3600"  # only the test's sweeps act
    tenant = await tenants.new(PLAN)
    sleepers = await start_runs(db, tenant, RUNS, effects=str(effects), ask=False, sleep_s=2.0)
    # A permission that expires while its run waits: the sweeps record the timeout.
    expiring = await start_runs(db, tenant, RUNS // 2, effects=str(effects), timeout_s=2.0)
    run_ids = sleepers + expiring
    workers.start()
    workers.start()
    sweeps = [
        TimerSweep(
            ParkingRepo(db),
            LeaderElector(QueueRepo(db), name=f"timers-{name}", holder=name, ttl_s=30),
            interval_s=TIMER_INTERVAL_S,
            batch_limit=7,  # several transactions per pass, so the two interleave
        )
        for name in ("a", "b")
    ]
    moved: list[Resumed] = []
    stop = asyncio.Event()

    async def sweeping(sweep: TimerSweep) -> None:
        while not stop.is_set():
            moved.extend(await sweep.tick())
            await asyncio.sleep(0)  # yield to the other sweep; it is not a wait for anything

    async def finished() -> bool:
        return (await count_by_status(db, run_ids))[SUCCEEDED] == len(run_ids)

    tasks = [asyncio.create_task(sweeping(sweep)) for sweep in sweeps]
    try:
        await wait_for(finished, timeout_s=SETTLE_S, interval_s=0.05, message="every run")
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    workers.terminate_all()
    for sweep in sweeps:
        assert await sweep.elector.tick(), "a sweep did not lead"
    once = Counter(r.run_id for r in moved)
    assert max(once.values()) == 1, "a run was moved twice"
    # Every run that parked was moved once, by one of the sweeps. (A run whose timer is due
    # by the time it would park, on a slow machine, does not park at all.)
    assert await events_of(db, run_ids, "waiting") == once, "a parked run was not moved once"
    assert set(sleepers) & set(once), "no sleeper parked: the test did not test"
    assert await events_of(db, run_ids, "resumed") == once
    timed_out = Posted(approved=False, reason="timeout", data=None)
    await check_outcomes(db, sleepers, effects, {}, keys=("prepare", "finish"))
    await check_outcomes(db, expiring, effects, {run_id: timed_out for run_id in expiring})
