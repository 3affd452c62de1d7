"""Cancel, messages and the event stream of a run, through the API.

The stream tests write a run's events with the repositories, under the fence a worker's claim
would hold, and read them back as Server-Sent Events over ``httpx.ASGITransport`` (which hands
the body over once the stream has closed: a test that must act while a stream is open runs the
request as a task and watches the tenant's stream slots).
"""

import asyncio
import json
from collections.abc import Awaitable, Callable

from moorline.api.deps import Services
from moorline.db.repos.events import EventsRepo
from moorline.db.repos.messages import MessagesRepo
from moorline.db.repos.records import Fence
from moorline.db.repos.runs import RunsRepo
from moorline.engine.conversations import window_key
from moorline.types import RunId, RunStatus
from tests.api.conftest import Api, Caller, MakeApi

DEADLINE_S = 10.0
STREAM_LIFETIME_S = 3.0


async def until(condition: Callable[[], Awaitable[bool] | bool]) -> None:
    """Poll ``condition`` until it holds, or fail after :data:`DEADLINE_S`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while True:
        outcome = condition()
        if outcome if isinstance(outcome, bool) else await outcome:
            return
        assert loop.time() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(0.01)


def parse_sse(text: str) -> list[tuple[int, str, object]]:
    """The ``(id, event, data)`` of each event of an SSE body (comments skipped)."""
    parsed = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            if line and not line.startswith(":"):
                name, _, value = line.partition(": ")
                fields[name] = value
        if "id" in fields:
            parsed.append((int(fields["id"]), fields["event"], json.loads(fields["data"])))
    return parsed


async def running_run(api: Api, caller: Caller) -> tuple[str, Fence]:
    run_id = (await api.trigger(caller)).json()["run_id"]
    return run_id, await api.start(run_id)


def services(api: Api) -> Services:
    found: Services = api.app.state.services
    return found


async def test_cancel_ends_a_queued_run_at_once_and_refuses_an_ended_one(api: Api) -> None:
    caller = await api.tenant()
    run_id = (await api.trigger(caller)).json()["run_id"]

    response = await api.client.post(f"/v1/runs/{run_id}/cancel", headers=caller.headers)

    assert response.status_code == 202
    assert response.json() == {"run_id": run_id, "status": "cancelled"}
    run = (await api.client.get(f"/v1/runs/{run_id}", headers=caller.headers)).json()
    assert run["status"] == "cancelled" and run["finished_at"] is not None
    again = await api.client.post(f"/v1/runs/{run_id}/cancel", headers=caller.headers)
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "run_finished"


async def test_cancel_of_a_running_run_is_recorded_and_signalled(api: Api) -> None:
    caller = await api.tenant()
    run_id, _ = await running_run(api, caller)

    response = await api.client.post(f"/v1/runs/{run_id}/cancel", headers=caller.headers)

    assert response.status_code == 202
    assert response.json() == {"run_id": run_id, "status": "running"}
    assert await services(api).store.is_cancelled(RunId(run_id))


async def test_a_message_to_a_run_that_is_not_executing_is_refused(api: Api) -> None:
    caller = await api.tenant()
    queued = (await api.trigger(caller)).json()["run_id"]
    running, _ = await running_run(api, caller)  # claimed, but no workflow code is executing
    for run_id in (queued, running):
        response = await api.client.post(
            f"/v1/runs/{run_id}/messages", json={"content": "hello"}, headers=caller.headers
        )
        assert response.status_code == 409, response.text
        assert response.json()["error"]["code"] == "run_not_interactive"
    empty = await api.client.post(
        f"/v1/runs/{queued}/messages", json={"content": ""}, headers=caller.headers
    )
    assert empty.status_code == 422


async def test_a_message_to_an_executing_run_is_stored_in_order(api: Api) -> None:
    caller = await api.tenant()
    run_id, _ = await running_run(api, caller)
    run = await RunsRepo(api.db).get(RunId(run_id))
    assert run is not None
    # What the runner does while the workflow executes: open the run's interactive window.
    await services(api).store.mark_interactive(window_key(run), run.run_id, 60.0)

    seqs = []
    for content in ("first", "second"):
        response = await api.client.post(
            f"/v1/runs/{run_id}/messages", json={"content": content}, headers=caller.headers
        )
        assert response.status_code == 202, response.text
        assert response.json()["run_id"] == run_id
        seqs.append(response.json()["seq"])

    stored = await MessagesRepo(api.db).list(run.run_id)
    assert [(m.seq, m.content) for m in stored] == list(zip(seqs, ["first", "second"], strict=True))


async def test_events_resume_after_last_event_id_and_close_after_the_terminal_one(
    api: Api,
) -> None:
    caller = await api.tenant()
    run_id, fence = await running_run(api, caller)
    repo = EventsRepo(api.db)
    first = await repo.append_many(
        fence, [("step_started", {"step": "a"}), ("delta", {"text": "x"}), ("delta", {"i": 1})]
    )
    resume_after = first[1].seq
    slots = services(api).stream_slots

    async def read(headers: dict[str, str]) -> str:
        response = await api.client.get(f"/v1/runs/{run_id}/events", headers=headers)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/event-stream")
        return response.text

    by_header = asyncio.create_task(read({**caller.headers, "Last-Event-ID": str(resume_after)}))
    await until(lambda: slots.held(caller.tenant_id) == 1)  # the stream is open, and live
    live = await repo.append_many(fence, [("delta", {"i": 2}), ("succeeded", {"output": 1})])
    # Events after the terminal one are never sent: the stream has closed.
    await repo.append_many(fence, [("delta", {"late": True})])
    body = await asyncio.wait_for(by_header, DEADLINE_S)

    expected = [(e.seq, e.type, e.data) for e in [first[2], *live]]
    assert parse_sse(body) == expected
    assert slots.held(caller.tenant_id) == 0
    by_query = await api.client.get(
        f"/v1/runs/{run_id}/events", params={"after": str(first[2].seq)}, headers=caller.headers
    )
    assert parse_sse(by_query.text) == expected[1:]
    bad = await api.client.get(
        f"/v1/runs/{run_id}/events", headers={**caller.headers, "Last-Event-ID": "-1"}
    )
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_request"


async def test_open_streams_are_capped_per_tenant_and_end_after_the_lifetime(
    make_api: MakeApi,
) -> None:
    # The lifetime (execution_timeout) outlasts the refused request by far on a loaded machine.
    async with make_api(
        max_streams_per_tenant=1, execution_timeout=STREAM_LIFETIME_S, permission_timeout=1.0
    ) as api:
        caller, other = await api.tenant(), await api.tenant()
        run_id, _ = await running_run(api, caller)
        slots = services(api).stream_slots
        url = f"/v1/runs/{run_id}/events"
        loop = asyncio.get_running_loop()
        opened = loop.time()
        held = asyncio.create_task(api.client.get(url, headers=caller.headers))
        await until(lambda: slots.held(caller.tenant_id) == 1)

        refused = await api.client.get(url, headers=caller.headers)

        assert refused.status_code == 429
        error = refused.json()["error"]
        assert error["code"] == "rate_limited" and "open event streams" in error["message"]
        assert "Retry-After" in refused.headers
        own_run, _ = await running_run(api, other)  # another tenant's cap is its own
        other_stream = asyncio.create_task(
            api.client.get(f"/v1/runs/{own_run}/events", headers=other.headers)
        )
        await until(lambda: slots.held(other.tenant_id) == 1)
        # No terminal event ever comes: the lifetime cap closes both streams.
        first = await asyncio.wait_for(held, DEADLINE_S)
        assert first.status_code == 200 and loop.time() - opened >= STREAM_LIFETIME_S
        assert (await asyncio.wait_for(other_stream, DEADLINE_S)).status_code == 200
        assert slots.held(caller.tenant_id) == slots.held(other.tenant_id) == 0
        status = (await api.client.get(f"/v1/runs/{run_id}", headers=caller.headers)).json()
        assert status["status"] == RunStatus.RUNNING.value
