"""Schedules on every backend: the repository's tenant isolation and conditional advance, and
the scheduler firing ticks through admission exactly once while its leader dies mid-tick."""

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select

from moorline.admission.admit import Admission
from moorline.admission.scheduler import Scheduler, tick_key
from moorline.admission.stack import build_admission
from moorline.db.manager import DatabaseManager
from moorline.db.repos.queue import QueueRepo
from moorline.db.repos.schedules import NewSchedule, Outcome, Schedule, SchedulesRepo
from moorline.db.repos.tenants import TenantsRepo
from moorline.db.schema import runs
from moorline.dispatch.cron import Cadence
from moorline.dispatch.leader import LeaderElector
from moorline.dispatch.wakeups import LocalWakeups
from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.observability.metrics import Metrics
from moorline.plans import PlansProvider
from moorline.settings import Settings
from moorline.types import JSONObject, RunStatus, TenantId
from moorline.worker.process import run_worker_process
from tests.contract.queue_helpers import Tenants, unique
from tests.helpers import sampled, wait_for

PLANS = """
plans:
  wide:
    lane: workflow_wide
    priority: 10
    daily_quota: 100000
    rate_limit: "100000/second"
    tenant_concurrency: 100
    lane_slots: 4
  tiny:
    lane: workflow_tiny
    priority: 10
    daily_quota: 2
    rate_limit: "100000/second"
    tenant_concurrency: 1
    lane_slots: 1
"""

workflows = Moorline(Settings())


@workflows.workflow("tick")
async def tick_workflow(ctx: Context, n: int = 0) -> JSONObject:
    return {"n": n}


class Died(Exception):
    """The leader's process ends here (a fault injected between the submit and the advance)."""


class DyingSchedules(SchedulesRepo):
    """The real repository, whose ``advance`` dies once, on call number ``die_on``."""

    def __init__(self, db: DatabaseManager, die_on: int) -> None:
        super().__init__(db)
        self.calls = 0
        self.die_on = die_on

    async def advance(self, schedule: Schedule, outcome: Outcome) -> bool:
        self.calls += 1
        if self.calls == self.die_on:
            raise Died
        return await super().advance(schedule, outcome)


@pytest.fixture
def plan_settings(settings: Settings, tmp_path: Path) -> Settings:
    plans = tmp_path / "plans.yaml"
    plans.write_text(PLANS, encoding="utf-8")
    return settings.model_copy(update={"plans_file": plans})


@pytest.fixture
async def admission(db: DatabaseManager, plan_settings: Settings) -> AsyncIterator[Admission]:
    local = LocalWakeups()
    async with AsyncExitStack() as closing:
        stack = build_admission(
            plan_settings, db, closing, metrics=Metrics(), wakeups=(local, local)
        )
        yield stack.admission


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


def scheduler(
    db: DatabaseManager,
    settings: Settings,
    admission: Admission,
    *,
    holder: str,
    repo: SchedulesRepo | None = None,
    clock: datetime | None = None,
    ttl_s: float = 1.0,
    metrics: Metrics | None = None,
) -> Scheduler:
    elector = LeaderElector(QueueRepo(db), name=unique("sched"), holder=holder, ttl_s=ttl_s)
    return Scheduler(
        repo or SchedulesRepo(db),
        elector,
        admission=admission,
        workflows=workflows,
        tenants=TenantsRepo(db),
        plans=PlansProvider(settings),
        interval_s=0.05,
        grace_s=60,
        clock=None if clock is None else (lambda: clock),
        metrics=metrics,
    )


def every(tenant_id: TenantId, seconds: int, first: datetime, **fields: object) -> NewSchedule:
    values: dict[str, object] = {
        "tenant_id": tenant_id,
        "workflow": "tick",
        "input": {"n": 1},
        "cron": None,
        "every_s": seconds,
        "timezone": "UTC",
        "catch_up": "skip",
        "paused": False,
        "next_at": first,
        **fields,
    }
    return NewSchedule(**values)  # type: ignore[arg-type]


async def keys_of(db: DatabaseManager, tenant_id: TenantId) -> list[str]:
    """The idempotency keys of the tenant's runs ("-" for a run without one)."""
    stmt = select(runs.c.idempotency_key).where(runs.c.tenant_id == tenant_id)
    async with db.connect() as conn:
        return [row[0] or "-" for row in (await conn.execute(stmt)).all()]


async def test_schedules_are_the_tenants_own_and_advance_once(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = SchedulesRepo(db)
    a, b = await tenants.new("wide"), await tenants.new("wide")
    first = datetime(2030, 1, 1, tzinfo=UTC)
    mine = await repo.create(every(a, 10, first))
    theirs = await repo.create(every(b, 10, first))
    assert mine.next_at == first and not mine.paused and mine.fired == 0
    assert [s.schedule_id for s in await repo.list_for(a)] == [mine.schedule_id]
    assert await repo.get(theirs.schedule_id, tenant_id=a) is None
    assert await repo.update(theirs.schedule_id, tenant_id=a, values={"paused": True}) is None
    assert not await repo.delete(theirs.schedule_id, tenant_id=a)
    assert await repo.due(first - timedelta(seconds=1), limit=10) == []
    assert {s.schedule_id for s in await repo.due(first, limit=1000)} >= {
        mine.schedule_id,
        theirs.schedule_id,
    }
    # Two passes over the same tick: only the first one's advance counts.
    outcome = Outcome(
        next_at=first + timedelta(seconds=10),
        fired=1,
        last_fired_at=first,
        last_run_id="r1",
    )
    assert await repo.advance(mine, outcome)
    assert not await repo.advance(mine, outcome)
    advanced = await repo.get(mine.schedule_id, tenant_id=a)
    assert advanced is not None
    assert (advanced.next_at, advanced.fired, advanced.last_run_id) == (
        first + timedelta(seconds=10),
        1,
        "r1",
    )
    # A pause is not overwritten by a pass, and a paused schedule is never due.
    paused = await repo.update(mine.schedule_id, tenant_id=a, values={"paused": True})
    assert paused is not None and paused.paused
    assert mine.schedule_id not in {
        s.schedule_id for s in await repo.due(first + timedelta(days=1), limit=1000)
    }
    with pytest.raises(ValueError, match="not editable"):
        await repo.update(mine.schedule_id, tenant_id=a, values={"fired": 0})
    assert await repo.delete(mine.schedule_id, tenant_id=a)
    assert await repo.get(mine.schedule_id, tenant_id=a) is None


async def test_two_schedulers_fire_every_tick_once_while_the_leader_dies_mid_tick(
    db: DatabaseManager, plan_settings: Settings, admission: Admission, tenants: Tenants
) -> None:
    tenant = await tenants.new("wide")
    repo = SchedulesRepo(db)
    cadence = Cadence(every_s=1)
    start = cadence.next_after(datetime.now(UTC))
    schedule = await repo.create(every(tenant, 1, start))
    # The leader dies on its third advance: that tick's run is stored, next_at is not moved.
    dying = DyingSchedules(db, die_on=3)
    leader = scheduler(db, plan_settings, admission, holder="leader", repo=dying)
    follower = scheduler(db, plan_settings, admission, holder="follower")
    await leader.tick()  # takes the lease first
    assert leader.elector.is_leader
    alive = True
    deadline = time.monotonic() + 15.0
    while True:
        if alive:
            try:
                await leader.tick()
            except Died:
                alive = False  # no resign: its lease runs out, the follower takes over
        await follower.tick()
        current = await repo.get(schedule.schedule_id, tenant_id=tenant)
        if not alive and current is not None and current.fired >= 5:
            break
        assert time.monotonic() < deadline, "the follower did not take over in time"
        await asyncio.sleep(0.05)
    assert dying.calls == 3
    assert follower.elector.is_leader
    final = await repo.get(schedule.schedule_id, tenant_id=tenant)
    assert final is not None
    expected = [
        tick_key(schedule.schedule_id, start + timedelta(seconds=s))
        for s in range(int((final.next_at - start).total_seconds()))
    ]
    assert len(expected) >= 4
    keys = await keys_of(db, tenant)
    assert sorted(keys) == sorted(expected)  # one run per tick: none lost, none doubled
    assert final.fired == len(expected) and final.refused == 0
    assert final.last_fired_at == final.next_at - timedelta(seconds=1)


async def test_a_paused_schedule_fires_nothing_and_resumes_from_now(
    db: DatabaseManager, plan_settings: Settings, admission: Admission, tenants: Tenants
) -> None:
    tenant = await tenants.new("wide")
    repo = SchedulesRepo(db)
    first = datetime(2031, 1, 1, tzinfo=UTC)
    created = await repo.create(every(tenant, 60, first, paused=True))
    later = first + timedelta(hours=2)
    passes = scheduler(db, plan_settings, admission, holder=unique("h"), clock=later)
    assert await passes.tick() == []
    assert await keys_of(db, tenant) == []
    # Resumed (the API computes next_at from now, as here): fires from then on, not the past.
    resumed = await repo.update(
        created.schedule_id, tenant_id=tenant, values={"paused": False, "next_at": later}
    )
    assert resumed is not None
    (outcome,) = await passes.tick()
    assert outcome.fired == 1
    assert await keys_of(db, tenant) == [tick_key(created.schedule_id, later)]


async def test_refused_ticks_are_counted_on_the_schedule(
    db: DatabaseManager, plan_settings: Settings, admission: Admission, tenants: Tenants
) -> None:
    tenant = await tenants.new("tiny")  # daily quota 2
    repo = SchedulesRepo(db)
    now = datetime.now(UTC).replace(microsecond=0)
    created = await repo.create(every(tenant, 1, now - timedelta(seconds=3)))
    bad = await repo.create(every(tenant, 60, now, input={"n": "not a number"}))
    counted = Metrics()
    passes = scheduler(db, plan_settings, admission, holder=unique("h"), clock=now, metrics=counted)
    await passes.tick()
    ticks = counted.schedule_ticks
    assert sampled(ticks, "moorline_schedule_ticks_total", outcome="fired") == 2
    assert sampled(ticks, "moorline_schedule_ticks_total", outcome="refused") == 3
    quota = await repo.get(created.schedule_id, tenant_id=tenant)
    assert quota is not None
    assert (quota.fired, quota.refused) == (2, 2)
    assert quota.last_error is not None and quota.last_error["code"] == "quota_exceeded"
    assert quota.next_at == now + timedelta(seconds=1)
    invalid = await repo.get(bad.schedule_id, tenant_id=tenant)
    assert invalid is not None and invalid.refused == 1
    assert invalid.last_error is not None and invalid.last_error["code"] == "invalid_input"
    stmt = select(runs.c.status, func.count()).where(runs.c.tenant_id == tenant)
    async with db.connect() as conn:
        counts: dict[str, int] = dict((await conn.execute(stmt.group_by(runs.c.status))).all())
    assert counts == {RunStatus.QUEUED.value: 2, RunStatus.RATE_LIMITED.value: 2}


async def test_a_run_worker_process_runs_the_scheduler_chore(
    db: DatabaseManager, plan_settings: Settings, admission: Admission, tenants: Tenants
) -> None:
    tenant = await tenants.new("wide")
    repo = SchedulesRepo(db)
    first = Cadence(every_s=1).next_after(datetime.now(UTC))
    created = await repo.create(every(tenant, 1, first))
    stop = asyncio.Event()
    chore = scheduler(db, plan_settings, admission, holder=unique("h"))
    task = asyncio.create_task(
        run_worker_process(
            plan_settings, workflows, db, lanes={}, stop=stop, loops=0, chores=[chore]
        )
    )
    try:
        await wait_for(lambda: keys_of(db, tenant), timeout_s=10, message="a tick's run")
    finally:
        stop.set()
        await task
    assert (await keys_of(db, tenant))[0] == tick_key(created.schedule_id, first)


async def test_missed_ticks_are_skipped_or_caught_up_once(
    db: DatabaseManager, plan_settings: Settings, admission: Admission, tenants: Tenants
) -> None:
    tenant = await tenants.new("wide")
    repo = SchedulesRepo(db)
    now = datetime(2032, 1, 1, 12, 0, 30, tzinfo=UTC)
    hour_ago = datetime(2032, 1, 1, 11, 0, tzinfo=UTC)
    skip = await repo.create(every(tenant, 60, hour_ago))
    one = await repo.create(every(tenant, 60, hour_ago, catch_up="one"))
    passes = scheduler(db, plan_settings, admission, holder=unique("h"), clock=now)
    await passes.tick()  # the grace is 60 s: 12:00:00 is on time, 11:59:00 and before missed
    on_time = [datetime(2032, 1, 1, 12, tzinfo=UTC)]
    keys = set(await keys_of(db, tenant))
    assert keys == {
        *(tick_key(skip.schedule_id, tick) for tick in on_time),
        *(tick_key(one.schedule_id, tick) for tick in on_time),
        tick_key(one.schedule_id, datetime(2032, 1, 1, 11, 59, tzinfo=UTC)),  # the latest missed
    }
    for schedule in (skip, one):
        after = await repo.get(schedule.schedule_id, tenant_id=tenant)
        assert after is not None and after.next_at == datetime(2032, 1, 1, 12, 1, tzinfo=UTC)
