"""The admin's views the dashboard reads: every tenant's runs, one run's controls, tenants.

Tenant isolation of these routes (a tenant key is 403) is in ``test_isolation.py``; here is what
they answer to the admin, and that the dashboard's page and files are served.
"""

import tomllib
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from moorline.api.deps import Services
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.messages import MessagesRepo
from moorline.db.repos.runs import RunsRepo
from moorline.engine.conversations import window_key
from moorline.types import RunId, RunStatus
from tests.api.conftest import ADMIN, Api


async def test_the_admin_lists_every_tenants_runs_filtered_and_paged(api: Api) -> None:
    a, b = await api.tenant("team"), await api.tenant("sandbox")
    mine = [
        (await api.trigger(a, "add", input={"a": n, "b": 1})).json()["run_id"] for n in range(5)
    ]
    theirs = [(await api.trigger(b)).json()["run_id"] for _ in range(3)]
    await api.start(theirs[0])
    scoped = {"tenant_id": a.tenant_id}

    # Newest first, three pages of two, no run twice, none left out.
    seen: list[str] = []
    cursor = None
    for _ in range(10):
        params = {**scoped, "limit": "2", **({"cursor": cursor} if cursor else {})}
        page = (await api.client.get("/v1/admin/runs", params=params, headers=ADMIN)).json()
        seen += [run["run_id"] for run in page["runs"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == list(reversed(mine))

    async def listed(**params: str) -> list[str]:
        response = await api.client.get(
            "/v1/admin/runs", params={"limit": "200", **params}, headers=ADMIN
        )
        assert response.status_code == 200, response.text
        return [run["run_id"] for run in response.json()["runs"]]

    both = set(mine) | set(theirs)
    assert both <= set(await listed())
    assert set(await listed(workflow="add")) & both == set(mine)
    assert set(await listed(lane="workflow_sandbox")) & both == set(theirs)
    assert await listed(status=RunStatus.RUNNING.value, tenant_id=b.tenant_id) == [theirs[0]]
    assert await listed(tenant_id=str(uuid.uuid4())) == []
    bad = await api.client.get("/v1/admin/runs", params={"cursor": "nope"}, headers=ADMIN)
    assert (bad.status_code, bad.json()["error"]["code"]) == (422, "invalid_request")


async def test_the_admin_reads_resolves_messages_and_cancels_any_tenants_run(api: Api) -> None:
    a = await api.tenant()
    run_id = (await api.trigger(a, input={"message": "hi"})).json()["run_id"]
    fence = await api.start(run_id)
    interrupt = await InterruptsRepo(api.db).open(fence, "permission:1", "post", {"pr": 7}, 300.0)
    base = f"/v1/admin/runs/{run_id}"

    run = (await api.client.get(base, headers=ADMIN)).json()
    assert (run["tenant_id"], run["input"]) == (a.tenant_id, {"message": "hi"})
    assert run["pending_interrupt"]["data"] == {"pr": 7}
    resumed = await api.client.post(f"{base}/resume", json={"approved": True}, headers=ADMIN)
    assert resumed.json()["interrupt_id"] == interrupt.interrupt_id
    decided = await InterruptsRepo(api.db).get(interrupt.interrupt_id)
    assert decided is not None and decided.approved
    stored = await RunsRepo(api.db).get(RunId(run_id))
    assert stored is not None
    # What the runner does while the workflow executes: open the run's interactive window.
    services: Services = api.app.state.services
    await services.store.mark_interactive(window_key(stored), stored.run_id, 60.0)
    sent = await api.client.post(f"{base}/messages", json={"content": "go on"}, headers=ADMIN)
    assert sent.status_code == 202, sent.text
    assert [m.content for m in await MessagesRepo(api.db).list(RunId(run_id))] == ["go on"]
    cancelled = await api.client.post(f"{base}/cancel", headers=ADMIN)
    assert (cancelled.status_code, cancelled.json()["status"]) == (202, "running")
    # The owner sees the admin's decision and cancel as its own.
    owned = (await api.client.get(f"/v1/runs/{run_id}", headers=a.headers)).json()
    assert owned["pending_interrupt"] is None


async def test_the_admin_lists_tenants_with_quota_use_and_running_runs(api: Api) -> None:
    a = await api.tenant("team")
    for _ in range(3):
        assert (await api.trigger(a)).status_code == 202
    runs = (
        await api.client.get("/v1/admin/runs", params={"tenant_id": a.tenant_id}, headers=ADMIN)
    ).json()
    await api.start(runs["runs"][0]["run_id"])

    found = None
    cursor = None
    for _ in range(50):
        params = {"limit": "1", **({"cursor": cursor} if cursor else {})}
        page = (await api.client.get("/v1/admin/tenants", params=params, headers=ADMIN)).json()
        assert len(page["tenants"]) <= 1
        found = found or next((t for t in page["tenants"] if t["tenant_id"] == a.tenant_id), None)
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert found is not None
    assert (found["plan"], found["lane"]) == ("team", "workflow_team")
    assert (found["used_today"], found["daily_quota"]) == (3, 500)
    assert (found["running"], found["tenant_concurrency"]) == (1, 4)


async def test_the_dashboard_page_and_its_files_are_served(api: Api) -> None:
    page = await api.client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/dashboard/app.js"' in page.text
    assert '<script src="/dashboard/workers.js"' in page.text
    scripts = ("app.js", "workers.js")
    for name, kind in (*((script, "javascript") for script in scripts), ("app.css", "text/css")):
        asset = await api.client.get(f"/dashboard/{name}")
        assert asset.status_code == 200 and kind in asset.headers["content-type"]
    # Nothing from elsewhere: no CDN, no absolute URL to fetch.
    for name in scripts:
        script = (await api.client.get(f"/dashboard/{name}")).text
        assert "http://" not in script.replace('"http://www.w3.org/2000/svg"', "")
        assert "https://" not in script
    assert (await api.client.get("/dashboard/missing.js")).status_code == 404


def test_the_dashboard_files_ship_in_the_package() -> None:
    """Every file the page loads is matched by pyproject's package-data (no build step)."""
    root = Path(__file__).resolve().parents[2]
    config = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = config["tool"]["setuptools"]["package-data"]["moorline"]
    package = root / "moorline"
    shipped = {path for pattern in patterns for path in package.glob(pattern)}
    static = package / "api" / "dashboard" / "static"
    names = ("index.html", "app.js", "workers.js", "app.css")
    assert {static / name for name in names} <= shipped


@pytest.mark.parametrize(
    ("params", "index"),
    [
        ({}, "ix_runs_created"),
        ({"status": "failed"}, "ix_runs_status_created"),
        ({"workflow": "add"}, "ix_runs_workflow_created"),
        ({"tenant_id": "00000000-0000-4000-8000-000000000000"}, "ix_runs_tenant_created"),
    ],
    ids=["all", "status", "workflow", "tenant"],
)
async def test_the_admins_listing_walks_an_index_in_order(
    api: Api, params: dict[str, str], index: str
) -> None:
    """What keeps the runs table fast at 100,000 runs (bench/dashboard.py): SQLite's plan."""
    statements: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if "FROM runs" in statement and "ORDER BY runs.created_at DESC" in statement:
            statements.append((statement, parameters))

    engine = api.db.engine.sync_engine
    event.listen(engine, "before_cursor_execute", capture)
    try:
        page = await api.client.get("/v1/admin/runs", params=params, headers=ADMIN)
        assert page.status_code == 200
    finally:
        event.remove(engine, "before_cursor_execute", capture)
    [(statement, parameters)] = statements
    async with api.db.connect() as conn:
        plan = await conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters)
        details = " ".join(str(row[-1]) for row in plan)
    assert index in details.split(), details
    assert "TEMP B-TREE FOR ORDER BY" not in details, details
