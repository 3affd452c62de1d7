"""Tenant isolation, driven by the route table (docs/reliability.md I3, docs/design.md invariant 6).

Every route of the app whose path takes a parameter must have a probe in :data:`PROBES`; a
new route without one fails :func:`test_every_route_with_a_parameter_has_a_probe`, so no
route that takes an id reaches CI without its isolation check. Each probe uses tenant B's
credentials on tenant A's object and asserts B learns nothing (404 exactly as for an object
that does not exist, or 401/403 where the route is not a tenant's) and changes nothing.
"""

import json
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
import pytest
from fastapi.routing import iter_route_contexts

from moorline.api.routes.webhooks import sign
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.messages import MessagesRepo
from moorline.db.repos.runs import RunsRepo
from moorline.db.repos.tenants import TenantsRepo
from moorline.db.repos.workers import WorkerEntry, WorkersRepo
from moorline.types import RunId, RunStatus, TenantId
from tests.api.conftest import ADMIN, Api, Caller


@dataclass
class World:
    """Tenant A's objects, and tenant B who probes them."""

    a: Caller
    b: Caller
    run_id: str
    interrupt_id: str
    webhook_id: str
    webhook_secret: str
    b_webhook_secret: str
    schedule_id: str = ""


Probe = Callable[[Api, World], Awaitable[None]]


def same_not_found(foreign: httpx.Response, missing: httpx.Response, *ids: str) -> None:
    """B's answer about A's object is the answer about no object: status, code, shape, size."""
    assert foreign.status_code == missing.status_code == 404, foreign.text
    texts = [foreign.text, missing.text]
    for object_id in ids:
        texts[0] = texts[0].replace(object_id, "<id>")
    texts[1] = re.sub(r"[0-9a-f-]{36}", "<id>", texts[1])
    assert texts[0] == texts[1]


async def probe_get_run(api: Api, world: World) -> None:
    foreign = await api.client.get(f"/v1/runs/{world.run_id}", headers=world.b.headers)
    missing = await api.client.get(f"/v1/runs/{uuid.uuid4()}", headers=world.b.headers)
    same_not_found(foreign, missing, world.run_id)
    assert foreign.json()["error"]["code"] == "run_not_found"
    own = await api.client.get(f"/v1/runs/{world.run_id}", headers=world.a.headers)
    assert own.status_code == 200


async def probe_resume_run(api: Api, world: World) -> None:
    body = {"approved": True}
    foreign = await api.client.post(
        f"/v1/runs/{world.run_id}/resume", json=body, headers=world.b.headers
    )
    missing = await api.client.post(
        f"/v1/runs/{uuid.uuid4()}/resume", json=body, headers=world.b.headers
    )
    same_not_found(foreign, missing, world.run_id)
    with_id = await api.client.post(
        f"/v1/runs/{world.run_id}/resume",
        json={**body, "interrupt_id": world.interrupt_id},
        headers=world.b.headers,
    )
    assert with_id.status_code == 404
    interrupt = await InterruptsRepo(api.db).get(world.interrupt_id)
    assert interrupt is not None and interrupt.is_pending  # B decided nothing


async def probe_cancel_run(api: Api, world: World) -> None:
    foreign = await api.client.post(f"/v1/runs/{world.run_id}/cancel", headers=world.b.headers)
    missing = await api.client.post(f"/v1/runs/{uuid.uuid4()}/cancel", headers=world.b.headers)
    same_not_found(foreign, missing, world.run_id)
    run = await RunsRepo(api.db).get(RunId(world.run_id))
    assert run is not None and run.cancel_requested_at is None  # B cancelled nothing
    assert not await api.app.state.services.store.is_cancelled(RunId(world.run_id))


async def probe_post_message(api: Api, world: World) -> None:
    body = {"content": "from B"}
    foreign = await api.client.post(
        f"/v1/runs/{world.run_id}/messages", json=body, headers=world.b.headers
    )
    missing = await api.client.post(
        f"/v1/runs/{uuid.uuid4()}/messages", json=body, headers=world.b.headers
    )
    same_not_found(foreign, missing, world.run_id)
    assert await MessagesRepo(api.db).list(RunId(world.run_id)) == []


async def probe_stream_events(api: Api, world: World) -> None:
    foreign = await api.client.get(f"/v1/runs/{world.run_id}/events", headers=world.b.headers)
    missing = await api.client.get(f"/v1/runs/{uuid.uuid4()}/events", headers=world.b.headers)
    same_not_found(foreign, missing, world.run_id)
    assert foreign.headers["content-type"].startswith("application/json")


async def probe_change_plan(api: Api, world: World) -> None:
    response = await api.client.patch(
        f"/v1/admin/tenants/{world.a.tenant_id}", json={"plan": "sandbox"}, headers=world.b.headers
    )
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "forbidden"
    tenant = await TenantsRepo(api.db).get(TenantId(world.a.tenant_id))
    assert tenant is not None and tenant.plan == world.a.plan


def probe_key_route(method: str, suffix: str) -> Probe:
    """A tenant's key on the admin key routes: 403, and A's keys are unchanged."""

    async def probe(api: Api, world: World) -> None:
        keys = await TenantsRepo(api.db).list_keys(TenantId(world.a.tenant_id))
        path = f"/v1/admin/tenants/{world.a.tenant_id}/keys" + suffix.format(key_id=keys[0].key_id)
        response = await api.client.request(method, path, headers=world.b.headers)
        assert response.status_code == 403
        assert response.json()["error"]["code"] == "forbidden"
        assert await TenantsRepo(api.db).list_keys(TenantId(world.a.tenant_id)) == keys
        assert (await api.client.get("/v1/usage", headers=world.a.headers)).status_code == 200

    return probe


async def probe_delete_webhook(api: Api, world: World) -> None:
    foreign = await api.client.delete(f"/v1/webhooks/{world.webhook_id}", headers=world.b.headers)
    missing = await api.client.delete(f"/v1/webhooks/{uuid.uuid4()}", headers=world.b.headers)
    same_not_found(foreign, missing, world.webhook_id)
    listed = await api.client.get("/v1/webhooks", headers=world.a.headers)
    assert world.webhook_id in {hook["webhook_id"] for hook in listed.json()["webhooks"]}


async def probe_deliver_webhook(api: Api, world: World) -> None:
    body = json.dumps({"action": "opened"}).encode()
    before = await api.count_runs(world.a)
    for secret in (world.b_webhook_secret, "guessed-secret-0123456789"):
        response = await api.client.post(
            f"/v1/hooks/{world.webhook_id}",
            content=body,
            headers={"X-Hub-Signature-256": sign(secret, body), **world.b.headers},
        )
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_signature"
    assert await api.count_runs(world.a) == before


async def probe_trigger(api: Api, world: World) -> None:
    # ``{workflow}`` names a workflow of the app, not a tenant's object: B's trigger is B's.
    response = await api.trigger(world.b)
    assert response.status_code == 202
    run = await api.client.get(f"/v1/runs/{response.json()['run_id']}", headers=world.b.headers)
    assert run.json()["tenant_id"] == world.b.tenant_id


async def probe_trigger_batch(api: Api, world: World) -> None:
    # As the trigger: B's items are B's. A's conversation (busy with A's run) is not B's, so
    # B's item joining a conversation of that id is admitted, and A's run id never shows.
    response = await api.client.post(
        "/v1/workflows/echo/runs/batch",
        json={"runs": [{"input": {}, "conversation_id": "secret-room"}]},
        headers=world.b.headers,
    )
    assert response.status_code == 200
    [item] = response.json()["results"]
    assert item["status_code"] == 202 and world.run_id not in response.text
    run = await api.client.get(f"/v1/runs/{item['run_id']}", headers=world.b.headers)
    assert run.json()["tenant_id"] == world.b.tenant_id


async def probe_retry_run(api: Api, world: World) -> None:
    foreign = await api.client.post(f"/v1/runs/{world.run_id}/retry", headers=world.b.headers)
    missing = await api.client.post(f"/v1/runs/{uuid.uuid4()}/retry", headers=world.b.headers)
    same_not_found(foreign, missing, world.run_id)
    run = await RunsRepo(api.db).get(RunId(world.run_id))
    assert run is not None and run.status is RunStatus.RUNNING  # B moved nothing


async def probe_rerun_run(api: Api, world: World) -> None:
    before = await api.count_runs(world.a)
    foreign = await api.client.post(f"/v1/runs/{world.run_id}/rerun", headers=world.b.headers)
    missing = await api.client.post(f"/v1/runs/{uuid.uuid4()}/rerun", headers=world.b.headers)
    same_not_found(foreign, missing, world.run_id)
    assert await api.count_runs(world.a) == before and await api.count_runs(world.b) == 0


async def a_bulk_job(api: Api, world: World) -> str:
    created = await api.client.post(
        "/v1/runs/bulk/cancel", json={"ids": [world.run_id]}, headers=world.a.headers
    )
    assert created.status_code == 202, created.text
    job_id: str = created.json()["job_id"]
    return job_id


async def probe_bulk_job(api: Api, world: World) -> None:
    job_id = await a_bulk_job(api, world)
    foreign = await api.client.get(f"/v1/runs/bulk/{job_id}", headers=world.b.headers)
    missing = await api.client.get(f"/v1/runs/bulk/{uuid.uuid4()}", headers=world.b.headers)
    assert foreign.json()["error"]["code"] == "bulk_job_not_found"
    same_not_found(foreign, missing, job_id)
    assert (await api.client.get(f"/v1/runs/bulk/{job_id}", headers=world.a.headers)).is_success


async def probe_admin_bulk_job(api: Api, world: World) -> None:
    job_id = await a_bulk_job(api, world)
    for caller in (world.b, world.a):
        response = await api.client.get(f"/v1/admin/runs/bulk/{job_id}", headers=caller.headers)
        assert response.status_code == 403
        assert response.json()["error"]["code"] == "forbidden"


ADMIN_RUN_BODIES: dict[str, dict[str, object] | None] = {
    "": None,
    "/events": None,
    "/resume": {"approved": True},
    "/cancel": None,
    "/messages": {"content": "from a tenant"},
    "/retry": None,
    "/rerun": None,
}


def probe_admin_run_route(method: str, suffix: str) -> Probe:
    """An admin route on any tenant's run: every tenant key is 403, the run's owner's too."""

    async def probe(api: Api, world: World) -> None:
        for caller in (world.b, world.a):
            response = await api.client.request(
                method,
                f"/v1/admin/runs/{world.run_id}{suffix}",
                json=ADMIN_RUN_BODIES[suffix],
                headers=caller.headers,
            )
            assert response.status_code == 403, response.text
            assert response.json()["error"]["code"] == "forbidden"
        run = await RunsRepo(api.db).get(RunId(world.run_id))
        assert run is not None and run.cancel_requested_at is None
        interrupt = await InterruptsRepo(api.db).get(world.interrupt_id)
        assert interrupt is not None and interrupt.is_pending
        assert await MessagesRepo(api.db).list(RunId(world.run_id)) == []
        # The admin reaches it; a run id that names nothing is 404 for the admin too.
        seen = await api.client.get(f"/v1/admin/runs/{world.run_id}", headers=ADMIN)
        assert seen.status_code == 200 and seen.json()["tenant_id"] == world.a.tenant_id
        missing = await api.client.get(f"/v1/admin/runs/{uuid.uuid4()}", headers=ADMIN)
        assert missing.json()["error"]["code"] == "run_not_found"

    return probe


async def probe_worker_route(api: Api, world: World) -> None:
    """A worker holding A's run: its page is 403 to every tenant key, and names nothing."""
    repo = WorkersRepo(api.db)
    a_run = (await api.client.get(f"/v1/admin/runs/{world.run_id}", headers=ADMIN)).json()
    entry = WorkerEntry(worker_id="test-worker", host="h", pid=1, lanes={"l": 1}, workflows=None)
    await repo.beat(entry, 60.0)  # api.start leased A's run to "test-worker"
    try:
        for caller in (world.b, world.a):
            response = await api.client.get("/v1/admin/workers/test-worker", headers=caller.headers)
            assert response.status_code == 403, response.text
            assert response.json()["error"]["code"] == "forbidden"
            assert world.run_id not in response.text and world.a.tenant_id not in response.text
        seen = await api.client.get("/v1/admin/workers/test-worker", headers=ADMIN)
        # Other tests' worlds leased their runs to "test-worker" too.
        assert a_run["run_id"] in {run["run_id"] for run in seen.json()["held"]}
    finally:
        await repo.leave(entry.worker_id)


def probe_schedule_route(method: str, suffix: str) -> Probe:
    """B's call on A's schedule is answered as for no schedule, and leaves it as it was."""

    async def probe(api: Api, world: World) -> None:
        url = f"/v1/schedules/{world.schedule_id}"
        before = (await api.client.get(url, headers=world.a.headers)).json()
        body = {"paused": True} if method == "PATCH" else None
        foreign = await api.client.request(
            method, f"{url}{suffix}", headers=world.b.headers, json=body
        )
        missing = await api.client.request(
            method, f"/v1/schedules/{uuid.uuid4()}{suffix}", headers=world.b.headers, json=body
        )
        same_not_found(foreign, missing, world.schedule_id)
        assert foreign.json()["error"]["code"] == "schedule_not_found"
        assert (await api.client.get(url, headers=world.a.headers)).json() == before

    return probe


PROBES: dict[tuple[str, str], Probe] = {
    **{
        (method, f"/v1/schedules/{{schedule_id}}{suffix}"): probe_schedule_route(method, suffix)
        for method, suffix in (
            ("GET", ""),
            ("PATCH", ""),
            ("DELETE", ""),
            ("POST", "/pause"),
            ("POST", "/resume"),
        )
    },
    **{
        (method, f"/v1/admin/runs/{{run_id}}{suffix}"): probe_admin_run_route(method, suffix)
        for method, suffix in (
            ("GET", ""),
            ("GET", "/events"),
            ("POST", "/resume"),
            ("POST", "/cancel"),
            ("POST", "/messages"),
            ("POST", "/retry"),
            ("POST", "/rerun"),
        )
    },
    ("POST", "/v1/runs/{run_id}/retry"): probe_retry_run,
    ("POST", "/v1/runs/{run_id}/rerun"): probe_rerun_run,
    ("GET", "/v1/runs/bulk/{job_id}"): probe_bulk_job,
    ("GET", "/v1/admin/runs/bulk/{job_id}"): probe_admin_bulk_job,
    ("GET", "/v1/runs/{run_id}"): probe_get_run,
    ("POST", "/v1/runs/{run_id}/resume"): probe_resume_run,
    ("POST", "/v1/runs/{run_id}/cancel"): probe_cancel_run,
    ("POST", "/v1/runs/{run_id}/messages"): probe_post_message,
    ("GET", "/v1/runs/{run_id}/events"): probe_stream_events,
    ("PATCH", "/v1/admin/tenants/{tenant_id}"): probe_change_plan,
    ("POST", "/v1/hooks/{webhook_id}"): probe_deliver_webhook,
    ("DELETE", "/v1/webhooks/{webhook_id}"): probe_delete_webhook,
    ("GET", "/v1/admin/tenants/{tenant_id}/keys"): probe_key_route("GET", ""),
    ("POST", "/v1/admin/tenants/{tenant_id}/keys"): probe_key_route("POST", ""),
    ("DELETE", "/v1/admin/tenants/{tenant_id}/keys/{key_id}"): probe_key_route(
        "DELETE", "/{key_id}"
    ),
    ("POST", "/v1/workflows/{workflow}/runs"): probe_trigger,
    ("GET", "/v1/admin/workers/{worker_id}"): probe_worker_route,
    ("POST", "/v1/workflows/{workflow}/runs/batch"): probe_trigger_batch,
}


def parameterised_routes(api: Api) -> set[tuple[str, str]]:
    """Every (method, path) of the app whose path takes a parameter, hidden routes included."""
    found: set[tuple[str, str]] = set()
    for route in iter_route_contexts(api.app.routes):
        path = route.path
        if path is None or "{" not in path:
            continue
        found.update((method, path) for method in route.methods or ())
    return found


async def build_world(api: Api) -> World:
    a, b = await api.tenant(), await api.tenant()
    run_id = (await api.trigger(a, conversation_id="secret-room")).json()["run_id"]
    fence = await api.start(run_id)
    interrupt = await InterruptsRepo(api.db).open(fence, "permission:1", "post", {}, 300.0)
    hooks = []
    for caller in (a, b):
        created = await api.client.post(
            "/v1/webhooks", json={"workflow": "review"}, headers=caller.headers
        )
        assert created.status_code == 201
        hooks.append(created.json())
    schedule = await api.client.post(
        "/v1/schedules", json={"workflow": "echo", "every_seconds": 3600}, headers=a.headers
    )
    assert schedule.status_code == 201, schedule.text
    return World(
        a=a,
        b=b,
        run_id=run_id,
        interrupt_id=interrupt.interrupt_id,
        webhook_id=hooks[0]["webhook_id"],
        webhook_secret=hooks[0]["secret"],
        b_webhook_secret=hooks[1]["secret"],
        schedule_id=schedule.json()["schedule_id"],
    )


async def test_every_route_with_a_parameter_has_a_probe(api: Api) -> None:
    routes = parameterised_routes(api)
    unprobed = sorted(routes - set(PROBES))
    assert not unprobed, f"routes with an id and no isolation probe in PROBES: {unprobed}"
    stale = sorted(set(PROBES) - routes)
    assert not stale, f"probes for routes that no longer exist: {stale}"


@pytest.mark.parametrize("route", sorted(PROBES), ids=lambda route: " ".join(route))
async def test_tenant_b_cannot_reach_tenant_a(api: Api, route: tuple[str, str]) -> None:
    world = await build_world(api)
    await PROBES[route](api, world)


async def test_listings_and_usage_show_only_the_callers_own(api: Api) -> None:
    world = await build_world(api)
    listed = await api.client.get(
        "/v1/runs", params={"conversation_id": "secret-room"}, headers=world.b.headers
    )
    assert listed.json() == {"runs": [], "next_cursor": None}
    everything = await api.client.get("/v1/runs", headers=world.b.headers)
    assert world.run_id not in everything.text
    running = await api.client.get(
        "/v1/runs", params={"status": RunStatus.RUNNING.value}, headers=world.a.headers
    )
    assert [run["run_id"] for run in running.json()["runs"]] == [world.run_id]
    usage = (await api.client.get("/v1/usage", headers=world.b.headers)).json()
    assert (usage["tenant_id"], usage["used_today"]) == (world.b.tenant_id, 0)
    # The admin's views of the lanes, every tenant's runs and the tenants are the admin's only.
    for path in ("/v1/admin/queues", "/v1/admin/runs", "/v1/admin/tenants"):
        assert (await api.client.get(path, headers=world.b.headers)).status_code == 403
        assert (await api.client.get(path, headers=ADMIN)).status_code == 200
    every_tenant = await api.client.get(
        "/v1/admin/runs", params={"tenant_id": world.a.tenant_id}, headers=ADMIN
    )
    assert [run["run_id"] for run in every_tenant.json()["runs"]] == [world.run_id]
