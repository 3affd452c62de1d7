"""A rolling deploy with real worker processes, on every backend (issue 15, item 1).

Workers claimed by lane whatever the workflow: a worker whose app lacked a workflow claimed its
runs and failed them for good (``WorkflowNotFound`` is not retried). Now a worker claims only
the workflows its app registers; a run no live worker serves stays ``queued`` and is reported
by ``GET /v1/admin/queues`` and ``/metrics`` until a worker that has it starts and runs it.
"""

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from moorline.api.app import create_app
from moorline.db.manager import DatabaseManager
from moorline.db.repos.runs import RunsRepo
from moorline.db.repos.workers import WorkersRepo
from moorline.db.schema import events, runs
from moorline.settings import Settings
from tests.contract.queue_helpers import Tenants
from tests.faults.harness import LANE, PLAN, Workers, plans_file, submit
from tests.faults.served_apps import alpha_app
from tests.helpers import wait_for

pytestmark = pytest.mark.faults

ADMIN_TOKEN = "served-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
OLD_APP = "tests.faults.served_apps:alpha_app"
NEW_APP = "tests.faults.served_apps:beta_app"
START_S = 60.0
"""A worker process's start (imports, migrations check) on a loaded 2-core machine."""


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


@pytest.fixture
def workers(database_url: str, tmp_path: Path) -> Iterator[Workers]:
    made = Workers(database_url, tmp_path, slots=2, app=OLD_APP)
    yield made
    made.kill_all()


@pytest.fixture
async def admin(database_url: str, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """The API over the workers' database (in this process: the workers are the real ones)."""
    settings = Settings(
        database_url=database_url,
        admin_token=ADMIN_TOKEN,
        edition="community",
        plans_file=plans_file(tmp_path, tenant_concurrency=10),
        db_retry_base=0.01,
    )
    manager = DatabaseManager(settings)
    await manager.initialize()
    app = create_app(settings, manager, workflows=alpha_app)
    transport = httpx.ASGITransport(app=app)
    try:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://moorline.test") as client,
        ):
            yield client
    finally:
        await manager.dispose()


async def run_row(db: DatabaseManager, run_id: str) -> Any:
    async with db.connect() as conn:
        return (await conn.execute(select(runs).where(runs.c.id == run_id))).mappings().one()


async def event_types(db: DatabaseManager, run_id: str) -> list[str]:
    async with db.connect() as conn:
        rows = await conn.execute(
            select(events.c.type).where(events.c.run_id == run_id).order_by(events.c.seq)
        )
        return list(rows.scalars())


async def lane_figures(admin: httpx.AsyncClient) -> dict[str, Any]:
    answer = await admin.get("/v1/admin/queues", headers=ADMIN)
    assert answer.status_code == 200, answer.text
    [lane] = [lane for lane in answer.json()["lanes"] if lane["lane"] == LANE]
    return dict(lane)


async def unserved_samples(admin: httpx.AsyncClient) -> list[str]:
    answer = await admin.get("/metrics")
    assert answer.status_code == 200
    return [line for line in answer.text.splitlines() if line.startswith("moorline_runs_unserved{")]


async def succeeded(db: DatabaseManager, run_id: str) -> bool:
    return bool((await run_row(db, run_id))["status"] == "succeeded")


async def test_a_rolling_deploy_leaves_unserved_runs_queued_until_a_worker_serves_them(
    db: DatabaseManager, tenants: Tenants, workers: Workers, admin: httpx.AsyncClient
) -> None:
    repo = RunsRepo(db)
    tenant = await tenants.new(PLAN)
    # The new workflow's run first: the claim that takes the old one has seen it.
    [beta_run] = await submit(repo, [tenant], "beta", [{}])
    [alpha_run] = await submit(repo, [tenant], "alpha", [{}])
    old = workers.start()
    await wait_for(lambda: succeeded(db, alpha_run), timeout_s=START_S, message="alpha ran")

    # The old worker passed over the run its app lacks: never claimed, nothing failed.
    row = await run_row(db, beta_run)
    assert (row["status"], row["attempt"], row["error"]) == ("queued", 0, None)
    assert await event_types(db, beta_run) == ["queued"]
    figures = await lane_figures(admin)
    assert (figures["queued"], figures["unserved"]) == (1, 1)
    assert figures["unserved_workflows"] == ["beta"]
    assert await unserved_samples(admin) == [
        f'moorline_runs_unserved{{lane="{LANE}",workflow="beta"}} 1.0'
    ]

    # The new app's worker starts and runs it; nothing is unserved any more.
    workers.app = NEW_APP
    workers.start()
    await wait_for(lambda: succeeded(db, beta_run), timeout_s=START_S, message="beta ran")
    assert (await run_row(db, beta_run))["attempt"] == 1
    figures = await lane_figures(admin)
    assert (figures["unserved"], figures["unserved_workflows"]) == (0, [])
    assert await unserved_samples(admin) == []

    # The old worker stops (its row goes with it): the old workflow is unserved now.
    old.terminate()
    old.wait(timeout=30)
    live = await WorkersRepo(db).live()
    assert [worker.entry.pid for worker in live] == [workers.procs[1].pid]
    [late_alpha] = await submit(repo, [tenant], "alpha", [{}])
    figures = await lane_figures(admin)
    assert (figures["unserved"], figures["unserved_workflows"]) == (1, ["alpha"])
    assert (await run_row(db, late_alpha))["status"] == "queued"
