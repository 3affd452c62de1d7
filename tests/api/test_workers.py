"""``GET /v1/admin/workers`` and ``GET /v1/admin/workers/{worker_id}`` (issue 20, item 5).

What they answer to the admin, their refusals, and the document. The rows and the held runs
are the repository's (its contract test runs on every backend); real worker processes listed
live and shown dead after ``kill -9`` are in ``tests/faults/test_workers_view.py``.
"""

import uuid

from sqlalchemy import update

from moorline.db.repos.workers import WorkerEntry, WorkersRepo
from moorline.db.schema import runs
from moorline.types import RunStatus
from tests.api.conftest import ADMIN, Api

TTL_S = 30.0


def entry(lanes: dict[str, int]) -> WorkerEntry:
    return WorkerEntry(
        worker_id=f"host-{uuid.uuid4().hex[:8]}:4242:{uuid.uuid4().hex[:8]}",
        host="host-a",
        pid=4242,
        lanes=lanes,
        workflows=["add", "echo"],
        version="9.9.9",
    )


async def hold(api: Api, owner: str, run_id: str) -> None:
    async with api.db.transaction() as conn:
        result = await conn.execute(
            update(runs)
            .where(runs.c.id == run_id)
            .values(
                status=RunStatus.RUNNING.value,
                attempt=1,
                lease_owner=owner,
                lease_expires_at=api.db.backend.now(plus_s=TTL_S),
                started_at=api.db.backend.now(),
            )
        )
    assert result.rowcount == 1


async def test_the_admin_lists_workers_live_and_dead_with_their_runs(api: Api) -> None:
    repo = WorkersRepo(api.db)
    caller = await api.tenant()
    live, dead = entry({"workflow_team": 4}), entry({"workflow_team": 2, "workflow_sandbox": 1})
    await repo.beat(live, TTL_S)
    await repo.beat(dead, -1.0)
    held = sorted([(await api.trigger(caller)).json()["run_id"] for _ in range(2)])
    for run_id in held:
        await hold(api, live.worker_id, run_id)
    dead_run = (await api.trigger(caller)).json()["run_id"]
    await hold(api, dead.worker_id, dead_run)
    try:
        answer = await api.client.get("/v1/admin/workers", headers=ADMIN)
        assert answer.status_code == 200, answer.text
        by_id = {w["worker_id"]: w for w in answer.json()["workers"]}
        shown = by_id[live.worker_id]
        assert {k: shown[k] for k in ("host", "pid", "version", "lanes", "workflows")} == {
            "host": "host-a",
            "pid": 4242,
            "version": "9.9.9",
            "lanes": {"workflow_team": 4},
            "workflows": ["add", "echo"],
        }
        assert (shown["status"], shown["runs"], shown["run_ids"]) == ("live", 2, held)
        assert 0 <= shown["last_seen_age_s"] < TTL_S
        assert shown["started_at"] <= shown["last_seen_at"] < shown["expires_at"]
        assert (by_id[dead.worker_id]["status"], by_id[dead.worker_id]["runs"]) == ("dead", 1)
        # Live ones first.
        order = list(by_id)
        assert order.index(live.worker_id) < order.index(dead.worker_id)

        async def ids(status: str) -> set[str]:
            page = await api.client.get(
                "/v1/admin/workers", params={"status": status}, headers=ADMIN
            )
            assert page.status_code == 200, page.text
            return {w["worker_id"] for w in page.json()["workers"]}

        assert live.worker_id in await ids("live") and dead.worker_id not in await ids("live")
        assert dead.worker_id in await ids("dead") and live.worker_id not in await ids("dead")

        one = await api.client.get(f"/v1/admin/workers/{live.worker_id}", headers=ADMIN)
        assert one.status_code == 200, one.text
        detail = one.json()
        assert detail["status"] == "live" and detail["runs"] == 2
        assert [run["run_id"] for run in detail["held"]] == held
        assert {
            (r["tenant_id"], r["workflow"], r["queue"], r["attempt"]) for r in detail["held"]
        } == {(caller.tenant_id, "echo", "workflow_team", 1)}
        assert all(run["lease_expires_at"] for run in detail["held"])
    finally:
        await repo.leave(live.worker_id)
        await repo.leave(dead.worker_id)


async def test_workers_routes_refuse_what_they_do_not_serve(api: Api) -> None:
    caller = await api.tenant()
    gone = await api.client.get("/v1/admin/workers/no-such-worker:1:x", headers=ADMIN)
    assert (gone.status_code, gone.json()["error"]["code"]) == (404, "worker_not_found")
    assert "no worker" in gone.json()["error"]["message"]
    bad = await api.client.get("/v1/admin/workers/a%20b", headers=ADMIN)
    assert (bad.status_code, bad.json()["error"]["code"]) == (422, "invalid_request")
    bad = await api.client.get("/v1/admin/workers", params={"status": "zombie"}, headers=ADMIN)
    assert (bad.status_code, bad.json()["error"]["code"]) == (422, "invalid_request")
    for path in ("/v1/admin/workers", "/v1/admin/workers/x"):
        refused = await api.client.get(path, headers=caller.headers)
        assert (refused.status_code, refused.json()["error"]["code"]) == (403, "forbidden")
        refused = await api.client.get(path)
        assert (refused.status_code, refused.json()["error"]["code"]) == (401, "unauthorized")


async def test_the_document_names_the_workers_routes_and_fields(api: Api) -> None:
    document = (await api.client.get("/openapi.json")).json()
    assert "get" in document["paths"]["/v1/admin/workers"]
    one = document["paths"]["/v1/admin/workers/{worker_id}"]["get"]
    assert "404" in one["responses"]
    fields = set(document["components"]["schemas"]["WorkerOut"]["properties"])
    # The names docs/api.md promises (shared API.md), none renamed.
    assert {
        "worker_id",
        "host",
        "pid",
        "lanes",
        "workflows",
        "started_at",
        "last_seen_at",
    } <= fields
    assert {"runs", "run_ids", "status", "version"} <= fields
