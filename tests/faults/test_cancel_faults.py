"""Cancels and permission decisions against real worker processes, with kill -9 (issue 4).

The embedded database runs its workers with their own in-memory stores, so a cancel reaches
them only through the database (their heartbeat); the server databases share Redis with the
test, so the store's signal reaches them too. Both must end every cancelled run ``cancelled``
without starting a step after the cancel was recorded, and both must apply a decision taken
while no worker was alive.
"""

import asyncio
import os
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
from sqlalchemy import and_, func, select

from moorline.db.manager import DatabaseManager
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.records import DecisionReason, Interrupt
from moorline.db.repos.runs import RunsRepo
from moorline.db.repos.steps import StepsRepo
from moorline.db.schema import events, interrupts, runs, steps
from moorline.dispatch.cancel import cancel_run
from moorline.runtime.base import RuntimeStore
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.types import JSONObject, RunId, RunStatus, TenantId
from tests.conftest import BACKENDS, CAPABILITIES
from tests.contract.queue_helpers import Tenants, event_types, statuses
from tests.faults.harness import PLAN, RECOVERY_BOUND_S, Workers, owner_pattern, submit
from tests.helpers import wait_for
from tests.runtime.conftest import delete_keys, keys_without_ttl, make_redis_store
from tests.servers import REDIS_TEST_URL, require_server, unique_name

pytestmark = pytest.mark.faults

FULL = os.environ.get("MOORLINE_FULL") == "1"
"""Full size (``MOORLINE_FULL=1``): docs/reliability.md D3's 1,000 runs, on every backend."""

CI_BACKENDS = ["sqlite", "postgresql"]
"""The issue's matrix at CI size: SQLite + the in-memory store, PostgreSQL + Redis."""

CANCEL_RUNS = 1000 if FULL else 300
CANCEL_TENANTS = 5
ASKING_CANCELS = 3
"""Runs cancelled as soon as they are seen waiting for a decision, before the random ones."""
ASK_AT = (0, 1, -1)
"""Where runs wait for a permission, in turn: before their first step, after it, never."""
STEP_S = 1.0
"""Long enough that 40 runs in flight leave SQLite's single writer room for the cancels."""
CANCEL_WINDOW_S = CANCEL_RUNS / 40
"""The runs are cancelled at random instants spread over this long."""
TERMINAL_EVENTS = ["succeeded", "failed", "cancelled", "timed_out"]


@pytest.fixture(scope="module", params=BACKENDS if FULL else CI_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@dataclass(frozen=True)
class Runtime:
    """The store the test signals through, and how the workers reach the same one."""

    store: RuntimeStore
    redis_url: str | None = None
    redis_prefix: str = "mo"


@pytest.fixture
async def runtime(backend: str) -> AsyncIterator[Runtime]:
    if "embedded" in CAPABILITIES[backend]:
        memory = InMemoryRuntimeStore()
        yield Runtime(memory)
        await memory.close()
        return
    require_server("redis")
    prefix = unique_name("mo_test")
    redis = make_redis_store(prefix)
    try:
        yield Runtime(redis, REDIS_TEST_URL, prefix)
    finally:
        try:
            assert await keys_without_ttl(redis.client, prefix) == []
            await delete_keys(redis.client, prefix)
        finally:
            await redis.close()


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


@pytest.fixture
def workers(database_url: str, tmp_path: Path, runtime: Runtime) -> Iterator[Workers]:
    made = Workers(
        database_url, tmp_path, redis_url=runtime.redis_url, redis_prefix=runtime.redis_prefix
    )
    yield made
    made.kill_all()


async def running_under(db: DatabaseManager, pattern: str) -> list[RunId]:
    async with db.connect() as conn:
        rows = await conn.execute(
            select(runs.c.id).where(
                runs.c.status == RunStatus.RUNNING.value, runs.c.lease_owner.like(pattern)
            )
        )
        return [RunId(run_id) for run_id in rows.scalars()]


async def held_besides(db: DatabaseManager, pattern: str, known: set[RunId]) -> list[RunId]:
    """The runs ``running`` under a lease owner matching ``pattern``, but for ``known``."""
    return [run_id for run_id in await running_under(db, pattern) if run_id not in known]


async def waiting_for_a_decision(
    db: DatabaseManager, run_ids: Sequence[RunId], limit: int
) -> list[RunId]:
    """Up to ``limit`` of ``run_ids`` that wait for a permission decision now."""
    async with db.connect() as conn:
        rows = await conn.execute(
            select(interrupts.c.run_id)
            .where(interrupts.c.run_id.in_(run_ids), interrupts.c.status == "pending")
            .limit(limit)
        )
        return [RunId(run_id) for run_id in rows.scalars()]


async def started_after_cancel(db: DatabaseManager, run_ids: Sequence[str]) -> list[str]:
    """Steps started, and claims made, after their run's cancel was recorded (database time)."""
    late: list[str] = []
    async with db.connect() as conn:
        for offset in range(0, len(run_ids), 500):
            chunk = list(run_ids[offset : offset + 500])
            step_rows = await conn.execute(
                select(steps.c.run_id, steps.c.key)
                .join(runs, runs.c.id == steps.c.run_id)
                .where(
                    steps.c.run_id.in_(chunk),
                    steps.c.started_at > runs.c.cancel_requested_at,
                )
            )
            late += [f"step {row.key} of {row.run_id}" for row in step_rows]
            claims = await conn.execute(
                select(events.c.run_id, events.c.attempt)
                .join(runs, runs.c.id == events.c.run_id)
                .where(
                    events.c.run_id.in_(chunk),
                    events.c.type == "started",
                    events.c.created_at > runs.c.cancel_requested_at,
                )
            )
            late += [f"claim {row.attempt} of {row.run_id}" for row in claims]
    return late


async def settled_as_cancelled(db: DatabaseManager, run_ids: Sequence[str]) -> int:
    """Runs with a permission wait that ended because the run was cancelled."""
    async with db.connect() as conn:
        count: int = (
            await conn.execute(
                select(func.count(func.distinct(interrupts.c.run_id))).where(
                    interrupts.c.run_id.in_(list(run_ids)),
                    interrupts.c.reason == DecisionReason.CANCELLED.value,
                )
            )
        ).scalar_one()
    return count


async def terminal_events_per_run(db: DatabaseManager, run_ids: Sequence[str]) -> Counter[str]:
    async with db.connect() as conn:
        rows = await conn.execute(
            select(events.c.run_id, func.count())
            .where(events.c.run_id.in_(list(run_ids)), events.c.type.in_(TERMINAL_EVENTS))
            .group_by(events.c.run_id)
        )
        return Counter({run_id: count for run_id, count in rows})


async def last_event_types(db: DatabaseManager, run_ids: Sequence[str]) -> Counter[str]:
    last = (
        select(events.c.run_id, func.max(events.c.seq).label("seq"))
        .where(events.c.run_id.in_(list(run_ids)))
        .group_by(events.c.run_id)
        .subquery()
    )
    async with db.connect() as conn:
        rows = await conn.execute(
            select(events.c.type).join(
                last, and_(events.c.run_id == last.c.run_id, events.c.seq == last.c.seq)
            )
        )
        return Counter(rows.scalars())


async def test_cancels_at_random_points_end_every_run_cancelled_with_no_later_step(
    db: DatabaseManager, tenants: Tenants, workers: Workers, runtime: Runtime
) -> None:
    workers.measured = False  # killed at random: see Workers.measured
    rng = random.Random(20261124)
    procs = [workers.start(), workers.start()]  # they boot while the runs are submitted
    tenant_ids = [await tenants.new(PLAN) for _ in range(CANCEL_TENANTS)]
    repo = RunsRepo(db)
    inputs: list[JSONObject] = [
        {"steps": 60, "step_s": STEP_S, "ask_at": ASK_AT[index % len(ASK_AT)]}
        for index in range(CANCEL_RUNS)
    ]
    run_ids = await submit(repo, tenant_ids, "cancel_target", inputs)
    tenant_of: dict[RunId, TenantId] = {
        run_id: tenant_ids[index % CANCEL_TENANTS] for index, run_id in enumerate(run_ids)
    }
    points: Counter[str] = Counter()
    cancelled: set[RunId] = set()
    requests: list[asyncio.Task[None]] = []

    async def cancel(run_id: RunId, point: str | None) -> None:
        run = await cancel_run(repo, runtime.store, tenant_of[run_id], run_id)
        if point is None:
            point = "queued" if run.status is RunStatus.CANCELLED else "running"
        points[point] += 1

    def request(run_id: RunId, point: str | None = None) -> None:
        # Concurrent, as from many API clients: a slow commit delays no other request.
        if run_id not in cancelled:
            cancelled.add(run_id)
            requests.append(asyncio.create_task(cancel(run_id, point)))

    async def serving() -> bool:
        return all(workers.is_serving(proc) for proc in procs)

    await wait_for(serving, timeout_s=30, message="both workers serving")

    # However slow the machine, some cancels land on a permission wait for certain (the
    # random schedule below finds more on a fast one).
    for run_id in await wait_for(
        lambda: waiting_for_a_decision(db, run_ids, ASKING_CANCELS),
        timeout_s=60,
        message="runs waiting for a decision",
    ):
        request(run_id)
    order = list(run_ids)
    rng.shuffle(order)
    crash_at = len(order) // 3
    window_start = time.monotonic()
    instants = sorted(rng.uniform(0, CANCEL_WINDOW_S) for _ in order)
    for index, (run_id, instant) in enumerate(zip(order, instants, strict=True)):
        # The chaos schedule, not a synchronisation: each cancel lands at its random instant.
        await asyncio.sleep(max(0.0, window_start + instant - time.monotonic()))
        if index == crash_at:
            # kill -9 a worker, cancel what it held while it is dead, then replace it: the
            # reaper must end those runs cancelled, never requeue them. First it must hold a
            # run not cancelled yet (on a loaded machine all it held at this instant could
            # be cancelled already, or parked on a permission request).
            victim = procs[0]
            pattern = owner_pattern(victim)
            await wait_for(
                partial(held_besides, db, pattern, cancelled),
                timeout_s=30,
                message="a run of the worker to kill",
            )
            victim.kill()
            victim.wait()
            for held in await running_under(db, owner_pattern(victim)):
                request(held, "worker crash")
            workers.start()
        request(run_id)
    await asyncio.gather(*requests)

    async def all_ended() -> bool:
        states = await statuses(db, run_ids)
        return all(status not in ("queued", "running") for status, _ in states.values())

    await wait_for(all_ended, timeout_s=RECOVERY_BOUND_S + 20, message="every run to end")
    workers.kill_all()  # every run has ended: nothing is left for a graceful stop to do

    kinds = Counter(status for status, _ in (await statuses(db, run_ids)).values())
    assert kinds == {"cancelled": CANCEL_RUNS}, kinds
    # Permission waits that a cancel ended were settled as such by their worker.
    points["permission wait"] = await settled_as_cancelled(db, run_ids)
    for point in ("queued", "running", "permission wait", "worker crash"):
        assert points[point] > 0, f"no run was cancelled at point {point!r}: {points}"
    assert await started_after_cancel(db, run_ids) == []
    assert set((await terminal_events_per_run(db, run_ids)).values()) == {1}
    assert await last_event_types(db, run_ids) == {"cancelled": CANCEL_RUNS}


async def test_a_decision_taken_while_no_worker_lives_is_applied_after_a_restart(
    db: DatabaseManager, tenants: Tenants, workers: Workers
) -> None:
    tenant = await tenants.new(PLAN)
    permissions = InterruptsRepo(db)
    workers.measured = False  # the first worker is killed: see Workers.measured
    first = workers.start()
    workers.measured = True
    [run_id] = await submit(RunsRepo(db), [tenant], "approve_then_act", [{}])

    async def asking() -> list[Interrupt]:
        return await permissions.pending_for_run(run_id)

    [pending] = await wait_for(asking, timeout_s=30, message="the permission request")
    first.kill()
    first.wait()
    await permissions.resolve(
        run_id, pending.interrupt_id, approved=True, reason="approved", data={"by": "ops"}
    )
    assert (await statuses(db, [run_id]))[run_id] == ("running", 1)  # held by the dead worker
    workers.start()

    async def succeeded() -> bool:
        return (await statuses(db, [run_id]))[run_id][0] == "succeeded"

    await wait_for(succeeded, timeout_s=RECOVERY_BOUND_S + 20, message="the run to finish")
    workers.terminate_all()
    run = await RunsRepo(db).get(run_id)
    assert run is not None
    assert run.output == {
        "approved": True,
        "reason": "approved",
        "data": {"by": "ops"},
        "acted": True,
        "attempt": 2,
    }
    # The step before the wait ran once; the one after ran in the second attempt only.
    recorded = {s.key: s.attempt for s in await StepsRepo(db).list(run_id)}
    assert recorded == {"prepare": 1, "act": 2}
    types = await event_types(db, run_id)
    # The kill lands once the interrupt is stored: the first attempt's progress events and its
    # permission_request (written just after) may or may not have made it. The rest may not vary.
    before_kill = {"step_started", "step_finished", "permission_request"}
    reclaimed = types.index("reclaimed")
    assert set(types[2:reclaimed]) <= before_kill, types
    assert types[:2] == ["queued", "started"]
    assert types[reclaimed:] == [
        "reclaimed",
        "started",
        "step_started",
        "step_finished",
        "succeeded",
    ]
    assert await permissions.pending_for_run(run_id) == []
