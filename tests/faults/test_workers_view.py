"""Three real worker processes in the workers view; ``kill -9`` one (issue 20, item 5).

``GET /v1/admin/workers`` lists each ``moorline worker`` process live with its lanes, slots and
the runs it holds; one killed with SIGKILL (it cannot delete its row) is shown dead within one
lease TTL of the kill, and the runs it held leave it once the reaper took them back; one that
stops with SIGTERM removes its row and leaves the list at once. On every backend.
"""

import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from moorline.api.app import create_app
from moorline.db.manager import DatabaseManager
from moorline.db.repos.runs import RunsRepo
from moorline.settings import Settings
from tests.contract.queue_helpers import Tenants
from tests.faults.app import app as fault_app
from tests.faults.harness import LANE, LEASE_TTL_S, PLAN, Workers, plans_file, submit
from tests.helpers import wait_for

pytestmark = pytest.mark.faults

ADMIN_TOKEN = "workers-view-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
SLOTS = 2
START_S = 60.0
"""Three worker processes starting at once on a loaded 2-core machine."""


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


@pytest.fixture
def workers(database_url: str, tmp_path: Path) -> Iterator[Workers]:
    # Not measured: a process killed with SIGKILL writes no coverage, and tracing slows starts.
    made = Workers(database_url, tmp_path, slots=SLOTS, grace_s=0.5, measured=False)
    yield made
    made.kill_all()


@pytest.fixture
async def admin(database_url: str, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """The API over the workers' database, in this process (the workers are the real ones)."""
    settings = Settings(
        database_url=database_url,
        admin_token=ADMIN_TOKEN,
        edition="community",
        plans_file=plans_file(tmp_path, tenant_concurrency=100),
        lease_ttl=LEASE_TTL_S,
        db_retry_base=0.01,
    )
    manager = DatabaseManager(settings)
    await manager.initialize()
    app = create_app(settings, manager, workflows=fault_app)
    transport = httpx.ASGITransport(app=app)
    try:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://moorline.test") as client,
        ):
            yield client
    finally:
        await manager.dispose()


async def listed(admin: httpx.AsyncClient, pids: set[int]) -> dict[int, dict[str, Any]]:
    """This test's workers as the API lists them, by pid (the database may hold others')."""
    answer = await admin.get("/v1/admin/workers", headers=ADMIN)
    assert answer.status_code == 200, answer.text
    return {w["pid"]: w for w in answer.json()["workers"] if w["pid"] in pids}


async def test_three_workers_are_listed_live_and_a_killed_one_is_shown_dead_within_a_ttl(
    db: DatabaseManager, tenants: Tenants, workers: Workers, admin: httpx.AsyncClient
) -> None:
    tenant = await tenants.new(PLAN)
    # Long runs, as many as the three workers' slots: each ends up holding SLOTS of them.
    run_ids = await submit(RunsRepo(db), [tenant], "work", [{"seconds": 120.0}] * (3 * SLOTS))
    procs = [workers.start() for _ in range(3)]
    pids = {proc.pid for proc in procs}

    async def all_busy() -> dict[int, dict[str, Any]] | None:
        found = await listed(admin, pids)
        busy = len(found) == 3 and all(w["runs"] == SLOTS for w in found.values())
        return found if busy else None

    found = await wait_for(all_busy, timeout_s=START_S, message="three busy workers")
    assert found is not None
    for proc in procs:
        shown = found[proc.pid]
        assert shown["status"] == "live"
        assert shown["lanes"] == {LANE: SLOTS}
        assert "work" in shown["workflows"]
        assert shown["host"] == os.uname().nodename
        assert shown["version"]
    held = [run_id for w in found.values() for run_id in w["run_ids"]]
    assert sorted(held) == sorted(run_ids)  # every run held once, by one worker

    victim = procs[0]
    victim_id = found[victim.pid]["worker_id"]
    victim.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    victim.wait()

    last_live_poll = killed_at

    async def shown_dead() -> bool:
        nonlocal last_live_poll
        started = time.monotonic()
        if (await listed(admin, pids))[victim.pid]["status"] == "dead":
            return True
        last_live_poll = started
        return False

    await wait_for(shown_dead, timeout_s=LEASE_TTL_S + 10.0, message="the killed worker dead")
    dead_after_s = time.monotonic() - killed_at
    live_until_s = last_live_poll - killed_at
    print(
        f"kill -9: last shown live {live_until_s:.2f}s, shown dead {dead_after_s:.2f}s after "
        f"(TTL {LEASE_TTL_S}s)"
    )
    # A poll that saw it live read the database clock before the row's expiry, which is at
    # most one TTL after the kill (its last beat came before): so it started before that.
    # Load can only delay the answer, never make a late poll see the worker live.
    assert live_until_s < LEASE_TTL_S
    now = await listed(admin, pids)
    assert [now[proc.pid]["status"] for proc in procs[1:]] == ["live", "live"]

    # Its runs leave it once the reaper takes them back (the survivors' slots are full).
    async def released() -> bool:
        answer = await admin.get(f"/v1/admin/workers/{victim_id}", headers=ADMIN)
        assert answer.status_code == 200, answer.text
        return bool(answer.json()["runs"] == 0 and answer.json()["held"] == [])

    await wait_for(released, timeout_s=LEASE_TTL_S + 10.0, message="the dead worker's runs reaped")

    # A worker that stops cleanly deletes its row: it leaves the list instead of dying.
    stopped = procs[1]
    stopped.send_signal(signal.SIGTERM)
    stopped.wait(timeout=30)
    assert stopped.returncode == 0, workers.log(stopped)
    remaining = await listed(admin, pids)
    assert set(remaining) == {victim.pid, procs[2].pid}
    assert remaining[procs[2].pid]["status"] == "live"
