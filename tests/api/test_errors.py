"""Every error code of docs/api.md that this API answers, with its status, body and side effects.

Each test also checks what must *not* have happened: a refused trigger stores nothing (or,
for the quota, exactly one ``rate_limited`` run), a refused admin call changes nothing.
"""

import json
import logging
import threading
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from starlette.types import Message, Scope

from moorline.api import guards
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.tenants import TenantsRepo
from moorline.types import JSONValue, RunStatus, TenantId
from tests.api.conftest import ADMIN, Api, MakeApi


def error_of(response: httpx.Response, status: int, code: str) -> dict[str, object]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error: dict[str, object] = body["error"]
    assert error["code"] == code
    assert isinstance(error["message"], str) and error["message"]
    return error


# --- authentication -------------------------------------------------------------------------


async def test_missing_wrong_and_revoked_keys_are_401_alike(api: Api) -> None:
    caller = await api.tenant()
    tenants = TenantsRepo(api.db)
    revoked = await api.tenant()
    [revoked_key] = await tenants.list_keys(TenantId(revoked.tenant_id))
    assert await tenants.revoke_key(revoked_key.key_id)

    attempts = {
        "no header": {},
        "not bearer": {"Authorization": f"Basic {caller.api_key}"},
        "unknown key": {"Authorization": "Bearer ml_" + "x" * 43},
        "revoked key": revoked.headers,
        "admin token": ADMIN,
    }
    for headers in attempts.values():
        error_of(await api.client.get("/v1/usage", headers=headers), 401, "unauthorized")
    assert (await api.client.get("/v1/usage", headers=caller.headers)).status_code == 200


async def test_admin_routes_refuse_tenant_keys_with_403_and_bad_tokens_with_401(api: Api) -> None:
    caller = await api.tenant()
    body = {"name": f"x-{uuid.uuid4().hex}", "plan": "team"}
    forbidden = await api.client.post("/v1/admin/tenants", json=body, headers=caller.headers)
    error_of(forbidden, 403, "forbidden")
    wrong = await api.client.post(
        "/v1/admin/tenants", json=body, headers={"Authorization": "Bearer not-the-token"}
    )
    error_of(wrong, 401, "unauthorized")
    error_of(await api.client.get("/v1/admin/queues"), 401, "unauthorized")
    assert await TenantsRepo(api.db).get_by_name(body["name"]) is None


async def test_admin_routes_are_off_without_an_admin_token(make_api: MakeApi) -> None:
    async with make_api(admin_token=None) as api:
        response = await api.client.get(
            "/v1/admin/queues", headers={"Authorization": "Bearer anything"}
        )
    error = error_of(response, 403, "forbidden")
    assert "MOORLINE_ADMIN_TOKEN" in str(error["message"])


async def test_a_key_in_the_query_string_is_refused_before_anything_else(api: Api) -> None:
    caller = await api.tenant()
    for query in (f"api_key={caller.api_key}", f"status=queued&x={caller.api_key}", "token=t"):
        response = await api.client.get(f"/v1/runs?{query}", headers=caller.headers)
        error = error_of(response, 400, "key_in_query")
        assert caller.api_key not in json.dumps(error)


# --- tenants ----------------------------------------------------------------------------------


async def test_tenant_names_are_unique_and_plans_must_exist(api: Api) -> None:
    name = f"acme-{uuid.uuid4().hex}"
    first = await api.client.post(
        "/v1/admin/tenants", json={"name": name, "plan": "team"}, headers=ADMIN
    )
    assert first.status_code == 201
    again = await api.client.post(
        "/v1/admin/tenants", json={"name": name, "plan": "sandbox"}, headers=ADMIN
    )
    error_of(again, 409, "tenant_exists")
    unknown = await api.client.post(
        "/v1/admin/tenants", json={"name": f"{name}-2", "plan": "platinum"}, headers=ADMIN
    )
    assert "platinum" in str(error_of(unknown, 422, "invalid_request")["message"])
    assert await TenantsRepo(api.db).get_by_name(f"{name}-2") is None


async def test_tenant_names_refuse_control_and_bidi_characters(api: Api) -> None:
    for name in ("bell\u0007", "next\u0085line", "rtl\u202eoverride", "isolate\u2067", "zw\u200dj"):
        response = await api.client.post(
            "/v1/admin/tenants", json={"name": name, "plan": "team"}, headers=ADMIN
        )
        error_of(response, 422, "invalid_request")
    accepted = await api.client.post(
        "/v1/admin/tenants",
        json={"name": f"équipe 漢 {uuid.uuid4()}", "plan": "team"},
        headers=ADMIN,
    )
    assert accepted.status_code == 201, accepted.text


async def test_plan_change_of_an_unknown_tenant_is_404(api: Api) -> None:
    for tenant_id in (str(uuid.uuid4()), "not-an-id!"):
        response = await api.client.patch(
            f"/v1/admin/tenants/{tenant_id}", json={"plan": "team"}, headers=ADMIN
        )
        error_of(response, 404, "tenant_not_found")


async def test_plan_change_takes_effect_on_the_next_trigger(api: Api) -> None:
    caller = await api.tenant("team")
    response = await api.client.patch(
        f"/v1/admin/tenants/{caller.tenant_id}", json={"plan": "sandbox"}, headers=ADMIN
    )
    assert response.status_code == 200
    assert response.json()["plan"] == "sandbox"
    accepted = await api.trigger(caller)
    assert accepted.json()["queue"] == "workflow_sandbox"


async def test_a_plan_change_and_a_revocation_reach_a_key_in_use_at_once(api: Api) -> None:
    """This process keeps authenticated keys for a few seconds; its own changes drop them."""
    caller = await api.tenant("team")
    assert (await api.trigger(caller)).json()["queue"] == "workflow_team"  # the key is kept
    response = await api.client.patch(
        f"/v1/admin/tenants/{caller.tenant_id}", json={"plan": "sandbox"}, headers=ADMIN
    )
    assert response.status_code == 200
    assert (await api.trigger(caller)).json()["queue"] == "workflow_sandbox"
    tenants = api.app.state.services.tenants  # the app's own repository, as its routes use it
    [key] = await tenants.list_keys(TenantId(caller.tenant_id))
    assert await tenants.revoke_key(key.key_id)
    error_of(await api.trigger(caller), 401, "unauthorized")


async def test_a_server_fault_is_500_and_logged_with_its_cause(
    api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    """A tenant whose plan the configuration lacks (the file was edited): the server's fault.

    Answered 500 with the error's own code, nothing stored, and an ERROR line with the
    traceback: Starlette logs only what reaches its catch-all, not what a handler answered.
    """
    caller = await api.tenant("team")
    tenants = api.app.state.services.tenants  # the app's own repository: its cache drops the key
    assert await tenants.set_plan(TenantId(caller.tenant_id), "no-longer-configured")
    with caplog.at_level(logging.ERROR, logger="moorline.api.errors"):
        error_of(await api.trigger(caller), 500, "config_error")
    [record] = [r for r in caplog.records if r.name == "moorline.api.errors"]
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert "no-longer-configured" in str(record.exc_info[1])
    assert await api.count_runs(caller) == 0


# --- triggers ----------------------------------------------------------------------------------


async def test_unknown_workflow_and_invalid_input_store_nothing(api: Api) -> None:
    caller = await api.tenant()
    error_of(await api.trigger(caller, "no_such_workflow"), 404, "workflow_not_found")
    invalid = await api.trigger(caller, "add", input={"a": 1, "b": "two"})
    assert "b" in str(error_of(invalid, 422, "invalid_input")["message"])
    missing = await api.trigger(caller, "add", input={"a": 1})
    error_of(missing, 422, "invalid_input")
    assert await api.count_runs(caller) == 0


async def test_bodies_that_do_not_fit_the_schema_are_422_and_store_nothing(api: Api) -> None:
    caller = await api.tenant()
    cases = [
        {"input": {}, "tenant_id": str(uuid.uuid4())},  # the server owns the tenant
        {"input": {}, "status": "succeeded"},
        {"input": []},
        {"input": {}, "delay_seconds": -1},
        {"input": {}, "delay_seconds": False},  # not a number of seconds
        {"input": {}, "delay_seconds": "10"},
        {"input": {}, "conversation_id": "room:{1}"},
        {"input": {}, "idempotency_key": "has space"},
        {"input": {"message": "nul\u0000byte"}},
    ]
    for body in cases:
        response = await api.client.post(
            "/v1/workflows/echo/runs", json=body, headers=caller.headers
        )
        error_of(response, 422, "invalid_request")
    assert await api.count_runs(caller) == 0


async def test_malformed_and_too_deep_json_are_400(api: Api) -> None:
    caller = await api.tenant()

    def nested(depth: int) -> bytes:
        # ``depth`` levels: the body object, its "input" object, then lists.
        return b'{"input": {"message": ' + b"[" * (depth - 2) + b"]" * (depth - 2) + b"}}"

    for body in (b'{"input": ', b"\xff\xfe", b'{"input": {"message": NaN}}', nested(65)):
        response = await api.client.post(
            "/v1/workflows/echo/runs", content=body, headers=caller.headers
        )
        error_of(response, 400, "invalid_json")
    # 64 levels parse; the list is then not a string, which the workflow refuses.
    at_limit = await api.client.post(
        "/v1/workflows/echo/runs", content=nested(64), headers=caller.headers
    )
    error_of(at_limit, 422, "invalid_input")
    assert await api.count_runs(caller) == 0


async def test_idempotency_key_reused_with_other_input_is_409(api: Api) -> None:
    caller = await api.tenant()
    first = await api.trigger(caller, input={"message": "a"}, idempotency_key="order-1")
    assert first.status_code == 202
    repeat = await api.trigger(caller, input={"message": "a"}, idempotency_key="order-1")
    assert repeat.status_code == 200
    assert repeat.json() == first.json()
    other = await api.trigger(caller, input={"message": "b"}, idempotency_key="order-1")
    error_of(other, 409, "idempotency_conflict")
    other_workflow = await api.trigger(
        caller, "add", input={"a": 1, "b": 2}, idempotency_key="order-1"
    )
    error_of(other_workflow, 409, "idempotency_conflict")
    assert await api.count_runs(caller) == 1
    # Keys are per tenant.
    stranger = await api.tenant()
    elsewhere = await api.trigger(stranger, input={"message": "b"}, idempotency_key="order-1")
    assert elsewhere.status_code == 202


async def test_busy_conversation_is_409_with_the_active_run(api: Api) -> None:
    caller = await api.tenant()
    active = await api.trigger(caller, conversation_id="chat-1")
    run_id = active.json()["run_id"]
    busy = await api.trigger(caller, conversation_id="chat-1")
    assert error_of(busy, 409, "conversation_busy")["run_id"] == run_id
    await api.start(run_id)
    error_of(await api.trigger(caller, conversation_id="chat-1"), 409, "conversation_busy")
    # Another conversation, and the same name for another tenant, are free.
    assert (await api.trigger(caller, conversation_id="chat-2")).status_code == 202
    stranger = await api.tenant()
    assert (await api.trigger(stranger, conversation_id="chat-1")).status_code == 202
    assert await api.count_runs(caller) == 2


async def test_over_the_daily_quota_is_429_with_the_stored_run(api: Api) -> None:
    caller = await api.tenant("trickle")  # daily quota 2, rate 3/minute
    for _ in range(2):
        assert (await api.trigger(caller)).status_code == 202
    refused = await api.trigger(caller, idempotency_key="after-quota")
    error = error_of(refused, 429, "quota_exceeded")
    now = datetime.now(UTC)
    midnight = datetime.combine(now.date() + timedelta(days=1), datetime.min.time(), UTC)
    retry_after = int(refused.headers["Retry-After"])
    assert abs(retry_after - (midnight - now).total_seconds()) <= 5
    run = (await api.client.get(f"/v1/runs/{error['run_id']}", headers=caller.headers)).json()
    assert run["status"] == RunStatus.RATE_LIMITED
    assert run["error"]["code"] == "quota_exceeded"
    assert run["finished_at"] is not None
    usage = (await api.client.get("/v1/usage", headers=caller.headers)).json()
    assert (usage["used_today"], usage["remaining"]) == (2, 0)
    assert await api.count_runs(caller, RunStatus.QUEUED) == 2
    assert await api.count_runs(caller, RunStatus.RATE_LIMITED) == 1


async def test_over_the_rate_limit_is_429_with_headers_and_stores_nothing(api: Api) -> None:
    caller = await api.tenant("trickle")  # 3/minute
    unknown = [await api.trigger(caller, "no_such_workflow") for _ in range(3)]
    assert [answer.status_code for answer in unknown] == [404] * 3  # no workflow: not counted
    first = await api.trigger(caller)
    assert first.status_code == 202
    assert first.headers["RateLimit-Limit"] == "3"
    assert first.headers["RateLimit-Remaining"] == "2"
    for _ in range(2):
        invalid = await api.trigger(caller, "add", input={})
        error_of(invalid, 422, "invalid_input")  # counted first, then refused
    refused = await api.trigger(caller)
    error = error_of(refused, 429, "rate_limited")
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    assert refused.headers["RateLimit-Limit"] == "3"
    assert refused.headers["RateLimit-Remaining"] == "0"
    assert refused.headers["RateLimit-Reset"] == refused.headers["Retry-After"]
    assert error["retry_after_s"] == int(refused.headers["Retry-After"])
    assert await api.count_runs(caller) == 1
    assert (await api.client.get("/v1/usage", headers=caller.headers)).json()["used_today"] == 1
    # The refusal is counted once (this app's own metrics).
    exposition = (await api.client.get("/metrics")).text
    assert 'moorline_rejections_total{reason="rate_limited"} 1.0' in exposition.splitlines()


async def test_a_body_over_the_limit_is_413_before_it_is_read(make_api: MakeApi) -> None:
    limit = 4096
    async with make_api(max_body_bytes=limit) as api:
        caller = await api.tenant()
        declared = await api.client.post(
            "/v1/workflows/echo/runs",
            content=b"x" * (limit + 1),
            headers=caller.headers,
        )
        error_of(declared, 413, "body_too_large")

        pulled = 0

        async def endless() -> AsyncIterator[bytes]:
            nonlocal pulled
            while pulled < 1000:  # far past the limit; a guard that reads on fails below
                pulled += 1
                yield b"x" * 1024

        chunked = await api.client.post(
            "/v1/workflows/echo/runs", content=endless(), headers=caller.headers
        )
        error_of(chunked, 413, "body_too_large")
        assert pulled <= limit // 1024 + 1
        assert await api.count_runs(caller) == 0


# --- runs and interrupts ------------------------------------------------------------------


async def test_unknown_runs_are_404(api: Api) -> None:
    caller = await api.tenant()
    for run_id in (str(uuid.uuid4()), "x" * 200, "not a uuid"):
        error_of(
            await api.client.get(f"/v1/runs/{run_id}", headers=caller.headers), 404, "run_not_found"
        )
        resume = await api.client.post(
            f"/v1/runs/{run_id}/resume", json={"approved": True}, headers=caller.headers
        )
        error_of(resume, 404, "run_not_found")


async def test_resume_without_a_pending_interrupt_is_409(api: Api) -> None:
    caller = await api.tenant()
    run_id = (await api.trigger(caller)).json()["run_id"]
    response = await api.client.post(
        f"/v1/runs/{run_id}/resume", json={"approved": True}, headers=caller.headers
    )
    error_of(response, 409, "no_pending_interrupt")
    fence = await api.start(run_id)
    await InterruptsRepo(api.db).open(fence, "permission:1", "post", {}, 300.0)
    unknown = await api.client.post(
        f"/v1/runs/{run_id}/resume",
        json={"approved": True, "interrupt_id": str(uuid.uuid4())},
        headers=caller.headers,
    )
    error_of(unknown, 404, "interrupt_not_found")


async def test_resume_twice_with_another_decision_is_409(api: Api) -> None:
    caller = await api.tenant()
    run_id = (await api.trigger(caller)).json()["run_id"]
    fence = await api.start(run_id)
    opened = await InterruptsRepo(api.db).open(fence, "permission:1", "post", {"pr": 7}, 300.0)
    approve = await api.client.post(
        f"/v1/runs/{run_id}/resume",
        json={"approved": True, "data": {"note": "ok"}},
        headers=caller.headers,
    )
    assert approve.status_code == 200
    assert approve.json() == {
        "run_id": run_id,
        "interrupt_id": opened.interrupt_id,
        "resolution": "resolved",
    }
    deny = await api.client.post(
        f"/v1/runs/{run_id}/resume",
        json={"approved": False, "interrupt_id": opened.interrupt_id},
        headers=caller.headers,
    )
    error_of(deny, 409, "interrupt_resolved")
    recorded = await InterruptsRepo(api.db).get(opened.interrupt_id)
    assert recorded is not None and recorded.approved and recorded.decision == {"note": "ok"}


# --- routing ----------------------------------------------------------------------------------


async def test_unknown_routes_and_methods_answer_in_the_error_shape(api: Api) -> None:
    error_of(await api.client.get("/v1/nothing-here"), 404, "not_found")
    error_of(await api.client.delete("/v1/usage"), 405, "method_not_allowed")


async def test_openapi_documents_the_error_shape(api: Api) -> None:
    document = (await api.client.get("/openapi.json")).json()
    for path in ("/v1/runs", "/v1/usage", "/v1/admin/queues", "/v1/workflows/{workflow}/runs"):
        operation = next(iter(document["paths"][path].values()))
        assert operation["responses"]["401"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"
        }
    assert "HTTPValidationError" not in document["components"]["schemas"]


# --- bodies and credentials -------------------------------------------------------------------


async def test_no_body_is_read_before_the_credentials_are_checked(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    caller = await api.tenant()
    parsed: list[bytes] = []
    real_parse = guards.parse_json

    def recording_parse(body: bytes) -> JSONValue:
        parsed.append(body)
        return real_parse(body)

    monkeypatch.setattr(guards, "parse_json", recording_parse)
    nested = b'{"input": {"message": ' + b"[{}," * 5000 + b"{}" + b"]" * 5000 + b"}}"
    without = {"Content-Type": "application/json"}
    forged = {**without, "Authorization": "Bearer ml_" + "x" * 40}
    tenant_routes = [
        "/v1/workflows/echo/runs",
        f"/v1/runs/{uuid.uuid4()}/messages",
        f"/v1/runs/{uuid.uuid4()}/resume",
        "/v1/webhooks",
    ]
    for path in tenant_routes:
        for headers, code in ((without, "unauthorized"), (forged, "unauthorized")):
            error_of(await api.client.post(path, content=nested, headers=headers), 401, code)
    for path in ("/v1/admin/tenants", f"/v1/admin/runs/{uuid.uuid4()}/messages"):
        error_of(await api.client.post(path, content=b"{", headers=without), 401, "unauthorized")
        refused = await api.client.post(path, content=b"{", headers=caller.headers)
        error_of(refused, 403, "forbidden")
    assert parsed == [], "a body was parsed for a request without valid credentials"
    # With the key, the same malformed body is the body's error.
    malformed = await api.client.post(
        "/v1/workflows/echo/runs", content=b"{", headers=caller.headers
    )
    error_of(malformed, 400, "invalid_json")


async def test_a_large_body_is_parsed_off_the_event_loop(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    caller = await api.tenant()
    threads: list[str] = []
    real_parse = guards.parse_json

    def recording_parse(body: bytes) -> JSONValue:
        threads.append(threading.current_thread().name)
        return real_parse(body)

    monkeypatch.setattr(guards, "parse_json", recording_parse)
    small = await api.trigger(caller, input={"message": "small"})
    large = await api.trigger(caller, input={"message": "x" * (guards.PARSE_INLINE_BYTES + 1)})
    assert (small.status_code, large.status_code) == (202, 202)
    main = threading.main_thread().name
    assert threads[0] == main and threads[1] != main, threads


async def test_a_client_that_leaves_mid_body_is_no_error(
    api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    caller = await api.tenant()
    # Chunked (no Content-Length), part of a body, then the client is gone.
    messages: list[Message] = [
        {"type": "http.request", "body": b'{"input": {"mess', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[Message] = []

    async def receive() -> Message:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope: Scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/workflows/echo/runs",
        "raw_path": b"/v1/workflows/echo/runs",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"moorline.test"),
            (b"content-type", b"application/json"),
            (b"transfer-encoding", b"chunked"),
            (b"authorization", caller.headers["Authorization"].encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("moorline.test", 80),
    }
    with caplog.at_level(logging.INFO):
        await api.app(scope, receive, send)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert any("closed the connection" in r.getMessage() for r in caplog.records)
    assert await api.count_runs(caller) == 0
