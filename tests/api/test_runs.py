"""Run routes: a run with its steps and pending interrupt, listings and their pages, resume."""

import asyncio
import base64
import json
import re
from datetime import datetime
from typing import Any

import pytest
from sqlalchemy import event
from starlette.responses import Response

from moorline.api.errors import rate_limit_headers
from moorline.api.guards import JSONRequest, solved_by
from moorline.api.routes import runs as runs_routes
from moorline.api.routes import trigger as trigger_route
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.db.repos.steps import StepsRepo
from moorline.runtime.base import InterruptStatus
from moorline.types import RunStatus, TenantId
from tests.api.conftest import ADMIN, Api, Caller, MakeApi


async def test_a_run_shows_its_steps_and_the_decision_it_waits_for(api: Api) -> None:
    caller = await api.tenant()
    accepted = await api.trigger(caller, "add", input={"a": 2, "b": 3}, conversation_id="c-1")
    assert accepted.status_code == 202
    created = accepted.json()
    assert (created["status"], created["queue"], created["workflow"]) == (
        "queued",
        "workflow_team",
        "add",
    )
    run_id = created["run_id"]
    fence = await api.start(run_id)
    steps = StepsRepo(api.db)
    await steps.start(fence, "fetch", "fetch", "0" * 64)
    await steps.succeed(fence, "fetch", {"diff": "+1"})
    await steps.start(fence, "review", "review", "1" * 64)
    interrupt = await InterruptsRepo(api.db).open(fence, "permission:1", "post", {"pr": 7}, 60.0)

    run = (await api.client.get(f"/v1/runs/{run_id}", headers=caller.headers)).json()

    assert run["run_id"] == run_id and run["tenant_id"] == caller.tenant_id
    assert (run["status"], run["attempt"], run["queue"]) == ("running", 1, "workflow_team")
    assert run["input"] == {"a": 2, "b": 3}
    assert (run["output"], run["error"], run["conversation_id"]) == (None, None, "c-1")
    assert run["started_at"] is not None and run["finished_at"] is None
    assert [(s["key"], s["status"], s["attempt"]) for s in run["steps"]] == [
        ("fetch", "succeeded", 1),
        ("review", "running", 1),
    ]
    assert run["steps"][0]["finished_at"] is not None
    assert run["pending_interrupt"] == {
        "interrupt_id": interrupt.interrupt_id,
        "action": "post",
        "data": {"pr": 7},
        "expires_at": run["pending_interrupt"]["expires_at"],
    }
    assert datetime.fromisoformat(run["pending_interrupt"]["expires_at"]) == interrupt.expires_at
    assert datetime.fromisoformat(run["created_at"]) == datetime.fromisoformat(
        created["created_at"]
    )


async def test_resume_records_the_decision_and_wakes_the_waiting_run(api: Api) -> None:
    caller = await api.tenant()
    run_id = (await api.trigger(caller)).json()["run_id"]
    fence = await api.start(run_id)
    interrupt = await InterruptsRepo(api.db).open(fence, "permission:1", "deploy", {}, 60.0)
    store = api.app.state.services.store
    await store.open_interrupt(fence.run_id, interrupt.interrupt_id, 60.0)
    waiter = asyncio.create_task(store.wait_interrupt(fence.run_id, interrupt.interrupt_id, 30.0))

    response = await api.client.post(
        f"/v1/runs/{run_id}/resume",
        json={"approved": False, "data": {"why": "friday"}},
        headers=caller.headers,
    )

    assert response.status_code == 200
    decision = await asyncio.wait_for(waiter, 10)
    assert decision == {"approved": False, "reason": "denied", "data": {"why": "friday"}}
    state = await store.get_interrupt(fence.run_id, interrupt.interrupt_id)
    assert state is not None and state.status is InterruptStatus.RESOLVED
    stored = await InterruptsRepo(api.db).get(interrupt.interrupt_id)
    assert stored is not None and not stored.approved and stored.decision == {"why": "friday"}
    after = (await api.client.get(f"/v1/runs/{run_id}", headers=caller.headers)).json()
    assert after["pending_interrupt"] is None


async def test_listing_filters_and_pages_newest_first(api: Api) -> None:
    caller = await api.tenant()
    # Concurrent triggers share a group-committed transaction, hence a created_at: the
    # cursor must page through ties without losing or repeating a run.
    answers = await asyncio.gather(
        *(api.trigger(caller, conversation_id=f"c-{i % 2}") for i in range(7)),
        api.trigger(caller, "add", input={"a": 1, "b": 1}),
    )
    assert [answer.status_code for answer in answers].count(202) == 3  # c-0, c-1, add
    await api.start(answers[-1].json()["run_id"])

    seen: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:
        params: dict[str, Any] = {"limit": 2} if cursor is None else {"limit": 2, "cursor": cursor}
        page = (await api.client.get("/v1/runs", params=params, headers=caller.headers)).json()
        assert len(page["runs"]) <= 2
        seen += page["runs"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == len({run["run_id"] for run in seen}) == 3
    # As times, not text: a time on the whole second is written without a fraction.
    order = [(datetime.fromisoformat(run["created_at"]), run["run_id"]) for run in seen]
    assert order == sorted(order, reverse=True)
    assert "input" not in seen[0] and "steps" not in seen[0]

    async def listed(**params: Any) -> list[str]:
        response = await api.client.get("/v1/runs", params=params, headers=caller.headers)
        assert response.status_code == 200, response.text
        return [run["workflow"] for run in response.json()["runs"]]

    assert await listed(workflow="add") == ["add"]
    assert await listed(status="running") == ["add"]
    assert await listed(status="queued") == ["echo", "echo"]
    assert await listed(conversation_id="c-1") == ["echo"]
    assert await listed(status="succeeded") == []


async def test_listing_filters_on_a_created_range_and_on_ids(api: Api) -> None:
    caller = await api.tenant()
    first = (await api.trigger(caller, "add", input={"a": 1, "b": 1})).json()
    second = (await api.trigger(caller, "add", input={"a": 2, "b": 2})).json()
    third = (await api.trigger(caller, "add", input={"a": 3, "b": 3})).json()
    between = second["created_at"]

    async def listed(headers: dict[str, str] = caller.headers, **params: Any) -> list[str]:
        path = "/v1/admin/runs" if headers is ADMIN else "/v1/runs"
        response = await api.client.get(path, params=params, headers=headers)
        assert response.status_code == 200, response.text
        return [run["run_id"] for run in response.json()["runs"]]

    wanted = [first["run_id"], third["run_id"]]
    assert await listed(ids=wanted) == [third["run_id"], first["run_id"]]
    assert await listed(ids=[*wanted, "no-such-run"], limit=1) == [third["run_id"]]
    # Runs created in one group commit share an instant: the range is checked against the
    # stored times, so each side holds the runs the other lacks and together all three.
    after = await listed(created_after=between)
    before = await listed(created_before=between)
    assert second["run_id"] in after and second["run_id"] not in before
    assert sorted(after + before) == sorted([first["run_id"], second["run_id"], third["run_id"]])
    assert await listed(created_after="2999-01-01T00:00:00Z") == []
    # The admin's listing takes the same filters; another tenant's ids show nothing.
    assert await listed(ADMIN, ids=wanted) == [third["run_id"], first["run_id"]]
    other = await api.tenant()
    assert await listed(other.headers, ids=wanted) == []
    for bad in (
        {"created_after": "2026-11-28T00:00:00"},  # no offset: which instant?
        {"created_before": "yesterday"},
        {"ids": ["a b"]},
        {"ids": [f"r{i}" for i in range(101)]},
    ):
        response = await api.client.get("/v1/runs", params=bad, headers=caller.headers)
        assert response.status_code == 422, (bad, response.text)
        assert response.json()["error"]["code"] == "invalid_request"


async def test_limit_is_clamped_and_cursors_are_checked(api: Api) -> None:
    caller = await api.tenant()
    runs = RunsRepo(api.db)
    await runs.submit_many(
        [
            NewRun(tenant_id=TenantId(caller.tenant_id), workflow="echo", input={}, lane="x")
            for _ in range(205)
        ]
    )
    default = (await api.client.get("/v1/runs", headers=caller.headers)).json()
    assert len(default["runs"]) == 50 and default["next_cursor"] is not None
    clamped = await api.client.get("/v1/runs", params={"limit": 5000}, headers=caller.headers)
    assert clamped.status_code == 200
    assert len(clamped.json()["runs"]) == 200 and clamped.json()["next_cursor"] is not None
    for bad in ("not-a-cursor", "W10", "WyJ4IiwgInkiXQ"):  # junk, [], ["x", "y"]
        response = await api.client.get("/v1/runs", params={"cursor": bad}, headers=caller.headers)
        assert response.status_code == 422, bad
        assert response.json()["error"]["code"] == "invalid_request"
    zero = await api.client.get("/v1/runs", params={"limit": 0}, headers=caller.headers)
    assert zero.status_code == 422


def forged_cursor(created_at: str, run_id: str) -> str:
    raw = json.dumps([created_at, run_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


async def test_forged_cursors_and_event_ids_are_refused_not_failed(api: Api) -> None:
    caller = await api.tenant()
    run_id = (await api.trigger(caller)).json()["run_id"]
    uuid_ = "0b6e6c1e-0000-4000-8000-000000000000"
    forged = [
        forged_cursor("0001-01-01T00:00:00+05:00", uuid_),  # overflows once made UTC
        forged_cursor("2026-11-28T00:00:00+00:00", "nul\u0000id"),  # PostgreSQL refuses NUL
        forged_cursor("2026-11-28T00:00:00", uuid_),  # naive
    ]
    for cursor in forged:
        for path in ("/v1/runs", "/v1/admin/runs"):
            headers = ADMIN if path.startswith("/v1/admin") else caller.headers
            response = await api.client.get(path, params={"cursor": cursor}, headers=headers)
            assert response.status_code == 422, (path, cursor, response.text)
            assert response.json()["error"]["code"] == "invalid_request"
    # Event ids are 32-bit: a larger one names no event and is refused before the stream.
    for after in ("2147483648", "999999999999999999"):
        response = await api.client.get(
            f"/v1/runs/{run_id}/events", params={"after": after}, headers=caller.headers
        )
        assert response.status_code == 422, response.text


async def test_a_listing_on_a_status_walks_the_tenants_own_index(api: Api) -> None:
    caller = await api.tenant()
    statements: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if "FROM runs" in statement and "ORDER BY runs.created_at DESC" in statement:
            statements.append((statement, parameters))

    engine = api.db.engine.sync_engine
    event.listen(engine, "before_cursor_execute", capture)
    try:
        page = await api.client.get(
            "/v1/runs", params={"status": "queued", "limit": 3}, headers=caller.headers
        )
        assert page.status_code == 200
    finally:
        event.remove(engine, "before_cursor_execute", capture)
    [(statement, parameters)] = statements
    async with api.db.connect() as conn:
        plan = await conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters)
        details = " ".join(str(row[-1]) for row in plan)
    # A tenant's listing on a status is one range of (tenant_id, status, created_at, id):
    # never the admin's ix_runs_status_created, which holds every tenant's runs.
    assert "ix_runs_tenant_status" in details, details
    # The index gives the created_at order; only runs that share a created_at (one group
    # commit) are sorted by id, as they come ("RIGHT PART"), never the whole listing.
    assert "TEMP B-TREE FOR ORDER BY" not in details, details


async def test_delay_seconds_postpones_the_claim(api: Api) -> None:
    caller = await api.tenant()
    accepted = await api.trigger(caller, delay_seconds=3600)
    assert accepted.status_code == 202
    run = await RunsRepo(api.db).get(accepted.json()["run_id"])
    assert run is not None and run.status is RunStatus.QUEUED
    assert 3590 <= (run.not_before - run.created_at).total_seconds() <= 3610


# (workflow, credential, content type, body): the trigger route's arguments, fitting or not.
JSON = "application/json"
LONG = "w" * 201
RUN_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
TRIGGERS: list[tuple[str, str | None, str | None, bytes]] = [
    ("echo", "key", JSON, b'{"input": {"message": "hi"}}'),
    ("echo", "key", None, b'{"input": {}}'),
    ("echo", "key", JSON, b'{"input": {}, "idempotency_key": "k-1", "delay_seconds": 1.5}'),
    ("echo", "key", JSON, b'{"input": {}, "idempotency_key": "k-1", "delay_seconds": 1.5}'),
    ("echo", "key", JSON, b'{"input": {"message": "other"}, "idempotency_key": "k-1"}'),
    ("echo", "key", JSON, b'{"input": {}, "conversation_id": "conv-1"}'),
    ("echo", None, JSON, b'{"input": {}}'),
    ("echo", None, JSON, b"[]"),
    ("echo", None, JSON, b"{"),  # 401, not 400: the credentials come before the body
    ("echo", "Bearer ml_not-a-key", "text/plain", b"{"),
    ("echo", "Basic dXNlcjpwYXNz", JSON, b'{"input": {}}'),
    ("echo", "Bearer", JSON, b'{"input": {}}'),
    ("echo", "Bearer ml_not-a-key", JSON, b"{}"),
    ("echo", "key", JSON, b""),
    ("echo", "key", JSON, b"null"),
    ("echo", "key", JSON, b"[]"),
    ("echo", "key", JSON, b'"input"'),
    ("echo", "key", JSON, b"7"),
    ("echo", "key", JSON, b"{"),
    ("echo", "key", "text/plain", b'{"input": {}}'),
    ("echo", "key", JSON, b'{"input": 1}'),
    ("echo", "key", JSON, b'{"input": {}, "unknown": 1}'),
    ("echo", "key", JSON, b'{"input": {}, "delay_seconds": -1}'),
    ("echo", "key", JSON, b'{"input": {}, "delay_seconds": "soon"}'),
    ("echo", "key", JSON, b'{"input": {}, "idempotency_key": ""}'),
    ("echo", "key", JSON, b'{"input": {}, "conversation_id": "no spaces allowed"}'),
    ("echo", "key", JSON, b'{"input": 1, "delay_seconds": -1, "unknown": 1}'),
    ("echo", "key", JSON, b'{"input": {"message": 5}}'),
    ("echo", "key", JSON, b'{"input": {"nothing": 5}}'),
    ("missing", "key", JSON, b'{"input": {}}'),
    (LONG, "key", JSON, b'{"input": {}}'),
    (LONG, "key", JSON, b"[]"),
    (LONG, None, JSON, b"[]"),
]


async def send_trigger(
    api: Api, caller: Caller, trigger: tuple[str, str | None, str | None, bytes]
) -> tuple[int, Any]:
    """A trigger's status and body, its run's own fields (ids, times) left out."""
    workflow, credential, content_type, body = trigger
    headers = {} if content_type is None else {"Content-Type": content_type}
    if credential is not None:
        headers["Authorization"] = credential.replace("key", f"Bearer {caller.api_key}")
    response = await api.client.post(
        f"/v1/workflows/{workflow}/runs", content=body, headers=headers
    )
    answer = response.json()
    if response.status_code in (200, 202):
        answer = {key: value for key, value in answer.items() if key in ("status", "workflow")}
    return response.status_code, json.loads(RUN_ID.sub("<run id>", json.dumps(answer)))


async def test_a_trigger_is_answered_as_fastapis_own_solver_would_answer_it(
    make_api: MakeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The trigger route's arguments are solved by hand (runs.solve_trigger); the same route
    # with FastAPI's dependency solver must give the same answers, errors and all.
    solved: list[str] = []

    async def solve(request: JSONRequest) -> dict[str, Any]:
        solved.append(request.url.path)
        return await trigger_route.solve_trigger(request)

    monkeypatch.setattr(runs_routes, "TriggerRoute", solved_by(solve))
    async with make_api(fast_paths=True) as api:
        caller = await api.tenant()
        by_hand = [await send_trigger(api, caller, trigger) for trigger in TRIGGERS]
        openapi = api.app.openapi()
    assert len(solved) == len(TRIGGERS)  # solve reads the body, once the caller is known
    monkeypatch.setattr(runs_routes, "TriggerRoute", runs_routes.TenantRoute)
    async with make_api(fast_paths=True) as api:
        caller = await api.tenant()
        by_fastapi = [await send_trigger(api, caller, trigger) for trigger in TRIGGERS]
        assert api.app.openapi() == openapi
    assert by_hand == by_fastapi
    assert [status for status, _ in by_hand].count(202) == 4
    assert {status for status, _ in by_hand} >= {200, 400, 401, 404, 409, 422}


def _form_of(name: bytes, value: bytes) -> bytes:
    """A header's value, or the form of one that names a run or counts recent hits."""
    if name == b"location":
        return value.rsplit(b"/", 1)[0]
    if name == b"ratelimit-remaining":
        return b"<count>" if value.isdigit() else value
    return value


async def test_the_fast_and_the_public_trigger_paths_answer_alike(make_api: MakeApi) -> None:
    # fast_paths=False: FastAPI's own solver and route order, and Starlette's own Response.
    answers: dict[bool, list[Any]] = {}
    documents: dict[bool, Any] = {}
    for fast in (True, False):
        async with make_api(fast_paths=fast) as api:
            caller = await api.tenant()
            answers[fast] = [await send_trigger(api, caller, trigger) for trigger in TRIGGERS]
            accepted = await api.trigger(caller, idempotency_key="same")
            again = await api.trigger(caller, idempotency_key="same")
            # Each app makes its own run: the Location names it (its id differs, not its form).
            # The hits left in the rate limit's one-second window depend on how long the
            # triggers before took: only its form is compared.
            answers[fast] += [
                [
                    (name, _form_of(name, value))
                    for name, value in answer.headers.raw
                    if name != b"content-length"
                ]
                for answer in (accepted, again)
            ]
            documents[fast] = api.app.openapi()
            hand_solved = [r for r in api.app.routes if isinstance(r, trigger_route.TriggerRoute)]
            assert len(hand_solved) == (1 if fast else 0)
            assert (api.app.routes[0] in hand_solved) is fast
    assert answers[True] == answers[False]
    assert documents[True] == documents[False]


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "public"])
async def test_a_trigger_is_answered_with_the_header_lines_starlette_would_build(
    make_api: MakeApi, fast: bool
) -> None:
    # runs.TriggerAnswer writes its header lines itself; they must be Starlette's own.
    async with make_api(fast_paths=fast) as api:
        await check_header_lines(api)


async def check_header_lines(api: Api) -> None:
    caller = await api.tenant()
    for expected_status, key in ((202, "k"), (200, "k"), (202, None)):
        body: dict[str, Any] = {} if key is None else {"idempotency_key": key}
        answer = await api.trigger(caller, **body)
        assert answer.status_code == expected_status
        rate = rate_limit_headers(
            int(answer.headers["RateLimit-Limit"]),
            int(answer.headers["RateLimit-Remaining"]),
            int(answer.headers["RateLimit-Reset"]),
        )
        if expected_status == 202:  # a new run: its address (Location)
            rate["location"] = f"/v1/runs/{answer.json()['run_id']}"
        starlette = Response(
            answer.content,
            status_code=expected_status,
            headers=rate,
            media_type="application/json",
        )
        assert answer.headers.raw == starlette.raw_headers
