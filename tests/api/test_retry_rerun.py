"""Retry and re-run through the API, tenant and admin routes, on every backend.

The runs are failed by hand (as a worker's last attempt would leave them): what the routes
must get right is the transition, its event, its refusals and who may ask.
"""

from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import update

from moorline.db.repos.events import EventsRepo
from moorline.db.repos.records import Run
from moorline.db.repos.runs import RunsRepo
from moorline.db.schema import runs
from moorline.types import RunId, RunStatus
from tests.api.conftest import ADMIN, Api, Caller


@pytest.fixture(scope="module")
def api_database_url(database_url: str) -> str:
    return database_url


async def stored_run(api: Api, run_id: str) -> Run:
    run = await RunsRepo(api.db).get(RunId(run_id))
    assert run is not None
    return run


async def failed_run(api: Api, caller: Caller, **body: Any) -> str:
    """A run of ``caller`` that ended ``failed`` after one attempt."""
    response = await api.trigger(caller, **body)
    assert response.status_code == 202, response.text
    run_id: str = response.json()["run_id"]
    await api.start(run_id)
    async with api.db.transaction() as conn:
        await conn.execute(
            update(runs)
            .where(runs.c.id == run_id)
            .values(
                status=RunStatus.FAILED.value,
                lease_owner=None,
                lease_expires_at=None,
                error={"type": "RuntimeError", "message": "boom", "reason": "max attempts"},
                finished_at=datetime.now(UTC),
            )
        )
    return run_id


async def test_retry_queues_a_failed_run_again_with_a_fresh_budget(api: Api) -> None:
    caller = await api.tenant()
    run_id = await failed_run(api, caller)

    response = await api.client.post(f"/v1/runs/{run_id}/retry", headers=caller.headers)

    assert response.status_code == 202, response.text
    assert response.json()["run_id"] == run_id and response.json()["status"] == "queued"
    run = (await api.client.get(f"/v1/runs/{run_id}", headers=caller.headers)).json()
    assert (run["status"], run["error"], run["finished_at"], run["attempt"]) == (
        "queued",
        None,
        None,
        1,
    )
    stored = await stored_run(api, run_id)
    assert stored.resumes == stored.attempt == 1  # attempt - resumes: a whole budget left
    events = await EventsRepo(api.db).list(stored.run_id)
    assert events[-1].type == "retried"
    assert events[-1].data == {
        "previous_status": "failed",
        "error": {"type": "RuntimeError", "message": "boom", "reason": "max attempts"},
    }
    again = await api.client.post(f"/v1/runs/{run_id}/retry", headers=caller.headers)
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "run_not_retryable"
    assert "queued" in again.json()["error"]["message"]


async def test_retry_refuses_other_statuses_and_other_tenants(api: Api) -> None:
    caller, other = await api.tenant(), await api.tenant()
    queued = (await api.trigger(caller)).json()["run_id"]
    refused = await api.client.post(f"/v1/runs/{queued}/retry", headers=caller.headers)
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "run_not_retryable"
    failed = await failed_run(api, caller)
    hidden = await api.client.post(f"/v1/runs/{failed}/retry", headers=other.headers)
    assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "run_not_found"
    assert (await stored_run(api, failed)).status is RunStatus.FAILED


async def test_retry_of_a_run_whose_conversation_is_busy_is_refused(api: Api) -> None:
    caller = await api.tenant()
    failed = await failed_run(api, caller, conversation_id="chat-1")
    active = (await api.trigger(caller, conversation_id="chat-1")).json()["run_id"]

    response = await api.client.post(f"/v1/runs/{failed}/retry", headers=caller.headers)

    assert response.status_code == 409
    assert response.json()["error"] == {
        "code": "conversation_busy",
        "message": "conversation 'chat-1' already has an active run: " + active,
        "run_id": active,
    }


async def test_rerun_starts_a_linked_run_with_the_same_input(api: Api) -> None:
    caller = await api.tenant()
    original = await failed_run(api, caller, input={"message": "again"})

    response = await api.client.post(f"/v1/runs/{original}/rerun", headers=caller.headers)

    assert response.status_code == 202, response.text
    body = response.json()
    assert body["rerun_of"] == original and body["run_id"] != original
    assert response.headers["location"] == f"/v1/runs/{body['run_id']}"
    rerun = (await api.client.get(response.headers["location"], headers=caller.headers)).json()
    assert (rerun["rerun_of"], rerun["input"], rerun["status"]) == (
        original,
        {"message": "again"},
        "queued",
    )
    listed = (await api.client.get("/v1/runs", headers=caller.headers)).json()["runs"]
    assert {run["run_id"]: run["rerun_of"] for run in listed} == {
        body["run_id"]: original,
        original: None,
    }
    other = await api.tenant()
    hidden = await api.client.post(f"/v1/runs/{original}/rerun", headers=other.headers)
    assert hidden.status_code == 404


async def test_a_rerun_sent_again_with_its_key_returns_the_first(api: Api) -> None:
    caller = await api.tenant()
    original = await failed_run(api, caller, input={"message": "once"})
    other = await failed_run(api, caller, input={"message": "once"})
    path = f"/v1/runs/{original}/rerun"
    body = {"idempotency_key": "rerun-1"}

    first = await api.client.post(path, json=body, headers=caller.headers)
    again = await api.client.post(path, json=body, headers=caller.headers)
    # The same key on a re-run of another run (same workflow and input) is a conflict, not
    # a silent answer naming a re-run of something else.
    elsewhere = await api.client.post(f"/v1/runs/{other}/rerun", json=body, headers=caller.headers)

    assert first.status_code == 202, first.text
    assert again.status_code == 200, again.text
    assert again.json()["run_id"] == first.json()["run_id"]
    assert again.json()["rerun_of"] == original
    assert again.headers["location"] == first.headers["location"]
    assert elsewhere.status_code == 409
    assert elsewhere.json()["error"]["code"] == "idempotency_conflict"
    listed = (await api.client.get("/v1/runs", headers=caller.headers)).json()["runs"]
    assert [run["rerun_of"] for run in listed].count(original) == 1
    bad = await api.client.post(path, json={"idempotency_key": ""}, headers=caller.headers)
    assert bad.status_code == 422


async def test_rerun_goes_through_admission(api: Api) -> None:
    caller = await api.tenant(plan="trickle")  # a daily quota of 2
    original = await failed_run(api, caller)
    assert (await api.client.post(f"/v1/runs/{original}/rerun", headers=caller.headers)).is_success

    refused = await api.client.post(f"/v1/runs/{original}/rerun", headers=caller.headers)

    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "quota_exceeded"


async def test_admin_routes_retry_and_rerun_any_tenants_run(api: Api) -> None:
    caller = await api.tenant()
    run_id = await failed_run(api, caller)
    forbidden = await api.client.post(f"/v1/admin/runs/{run_id}/retry", headers=caller.headers)
    assert forbidden.status_code == 403

    rerun = await api.client.post(f"/v1/admin/runs/{run_id}/rerun", headers=ADMIN)
    retried = await api.client.post(f"/v1/admin/runs/{run_id}/retry", headers=ADMIN)

    assert rerun.status_code == 202 and rerun.json()["rerun_of"] == run_id
    new = await api.client.get(f"/v1/runs/{rerun.json()['run_id']}", headers=caller.headers)
    assert new.json()["tenant_id"] == caller.tenant_id  # the tenant's run, on its quota
    assert retried.status_code == 202 and retried.json()["status"] == "queued"
    missing = await api.client.post("/v1/admin/runs/nope/retry", headers=ADMIN)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "run_not_found"
