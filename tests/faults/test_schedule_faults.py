"""The schedules drill (issue 20): three API processes and two workers, the leader killed twice.

Three ``moorline serve --workers 0`` processes and two ``moorline worker`` processes, all
running the scheduler chore, fire a ``* * * * *`` schedule and an every-10-seconds one
(``every_seconds``, the interval form) for three minutes, while the process leading the
scheduler is killed with SIGKILL twice (and replaced, so five processes run throughout); a third
schedule stays paused. Afterwards every tick between each schedule's creation and its final
``next_at`` has exactly one run (its idempotency key names the tick), every such run
succeeded, the counts on the schedules match, and the paused schedule fired nothing.

Full size only (``make test-schedules-drill``, or ``MOORLINE_FULL=1``): the three minutes are
the point, and CI's contract test (``tests/contract/test_schedules.py``) covers a leader that
dies mid-tick in a few seconds.
"""

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import select

from moorline.admission.scheduler import LEADER_LEASE, tick_key
from moorline.db.manager import DatabaseManager
from moorline.db.repos.schedules import NewSchedule, Schedule, SchedulesRepo
from moorline.db.schema import leader_leases, runs
from moorline.dispatch.cron import Cadence
from moorline.types import RunStatus, TenantId
from tests.contract.queue_helpers import Tenants
from tests.faults.harness import PLAN, REPO_ROOT, Workers
from tests.helpers import FULL_SIZE, wait_for
from tests.integration.test_cli import free_port
from tests.servers import REDIS_TEST_URL

pytestmark = [
    pytest.mark.faults,
    pytest.mark.skipif(not FULL_SIZE, reason="the three-minute drill runs at full size only"),
]

DRILL_S = 180.0
KILLS = 2
API_PROCESSES = 3
WORKER_PROCESSES = 2
SCHEDULER_INTERVAL_S = 0.5


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


class Deployment(Workers):
    """The test's ``moorline worker`` processes, and its ``moorline serve`` ones."""

    def serve(self) -> subprocess.Popen[bytes]:
        index = len(self.procs)
        log = (self.folder / f"worker-{index}.log").open("wb")
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "moorline", "serve", "--workers", "0", "--port", str(port),
             "--app", self.app],
            cwd=REPO_ROOT, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        self.procs.append(proc)
        return proc


@pytest.fixture
def deployment(
    backend: str, database_url: str, tmp_path: Path, redis_prefix: str
) -> Iterator[Deployment]:
    made = Deployment(
        database_url,
        tmp_path,
        redis_url=None if backend == "sqlite" else REDIS_TEST_URL,
        redis_prefix=redis_prefix,
        extra_env={"MOORLINE_SCHEDULER_INTERVAL": str(SCHEDULER_INTERVAL_S)},
        measured=False,  # killed: see Workers.measured
    )
    yield made
    made.kill_all()


async def scheduler_holder(db: DatabaseManager) -> str | None:
    stmt = select(leader_leases.c.holder).where(leader_leases.c.name == LEADER_LEASE)
    async with db.connect() as conn:
        return (await conn.execute(stmt)).scalar_one_or_none()


async def tick_runs(db: DatabaseManager, tenant: TenantId) -> dict[str, str]:
    """Idempotency key → status of the tenant's runs ("-" for a run without a key)."""
    stmt = select(runs.c.idempotency_key, runs.c.status).where(runs.c.tenant_id == tenant)
    async with db.connect() as conn:
        rows = (await conn.execute(stmt)).all()
    found: dict[str, str] = {}
    for key, status in rows:
        assert (key or "-") not in found, f"two runs under {key}"
        found[key or "-"] = status
    return found


def expected_keys(schedule: Schedule, final: Schedule, cadence: Cadence) -> set[str]:
    keys: set[str] = set()
    tick = schedule.next_at
    while tick < final.next_at:
        keys.add(tick_key(schedule.schedule_id, tick))
        tick = cadence.next_after(tick)
    return keys


async def test_three_api_processes_and_two_workers_fire_every_tick_once_across_two_kills(
    db: DatabaseManager, tenants: Tenants, deployment: Deployment
) -> None:
    """Fault: SIGKILL of the scheduler's leader, twice, during a three-minute drill."""
    tenant = await tenants.new(PLAN)
    repo = SchedulesRepo(db)
    now = datetime.now(UTC)
    cron = Cadence(cron="* * * * *")
    every = Cadence(every_s=10)

    def new(cadence: Cadence, *, paused: bool = False) -> NewSchedule:
        return NewSchedule(
            tenant_id=tenant, workflow="work", input={"seconds": 0.05}, cron=cadence.cron,
            every_s=cadence.every_s, timezone="UTC", catch_up="skip", paused=paused,
            next_at=cadence.next_after(now),
        )  # fmt: skip

    by_minute = await repo.create(new(cron))
    by_ten = await repo.create(new(every))
    paused = await repo.create(new(every, paused=True))
    for _ in range(API_PROCESSES):
        deployment.serve()
    for _ in range(WORKER_PROCESSES):
        deployment.start()
    started = time.monotonic()
    killed: list[str] = []
    for kill in range(1, KILLS + 1):
        await asyncio.sleep(max(0.0, started + DRILL_S * kill / (KILLS + 1) - time.monotonic()))
        holder = await wait_for(lambda: scheduler_holder(db), timeout_s=30, message="a leader")
        assert holder is not None
        [leader] = [p for p in deployment.alive() if f":{p.pid}:" in holder]
        serving = leader.args[3] == "serve"  # type: ignore[index]
        leader.send_signal(signal.SIGKILL)
        leader.wait()
        killed.append(holder)
        if serving:
            deployment.serve()
        else:
            deployment.start()
    await asyncio.sleep(max(0.0, started + DRILL_S - time.monotonic()))
    for schedule in (by_minute, by_ten):
        await repo.update(schedule.schedule_id, tenant_id=tenant, values={"paused": True})

    async def drained() -> dict[str, str] | None:
        found = await tick_runs(db, tenant)
        return found if all(s == RunStatus.SUCCEEDED.value for s in found.values()) else None

    # Every tick's run ran: the workers drain the last ones before they stop.
    await wait_for(drained, timeout_s=60, interval_s=0.2, message="every tick's run succeeded")
    deployment.terminate_all()

    found = await tick_runs(db, tenant)
    print(f"drill: {len(found)} tick runs, each once; scheduler leaders killed: {killed}")
    assert "-" not in found
    assert not any(key.startswith(f"schedule:{paused.schedule_id}:") for key in found)
    for schedule, cadence in ((by_minute, cron), (by_ten, every)):
        final = await repo.get(schedule.schedule_id, tenant_id=tenant)
        assert final is not None
        wanted = expected_keys(schedule, final, cadence)
        mine = {key for key in found if key.startswith(f"schedule:{schedule.schedule_id}:")}
        assert mine == wanted, (sorted(wanted - mine), sorted(mine - wanted))
        assert final.fired == len(wanted) and final.refused == 0
        assert len(wanted) >= DRILL_S / (60 if cadence.cron else 10) - 2
    assert len(killed) == KILLS and killed[0] != killed[1]
