"""``/v1/schedules``: create, list, read, edit, pause, resume and delete a tenant's schedules;
bad input is a 4xx with a code and a sentence; another tenant's schedule is 404."""

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import httpx
import pytest

from moorline.client import Client
from moorline.errors import ScheduleNotFound
from tests.api.conftest import Api


async def test_a_schedule_is_created_listed_edited_paused_resumed_and_deleted(api: Api) -> None:
    caller = await api.tenant()
    created = await api.client.post(
        "/v1/schedules",
        json={
            "workflow": "add",
            "input": {"a": 1, "b": 2},
            "cron": "30 2 * * *",
            "timezone": "Europe/Berlin",
            "catch_up": "one",
        },
        headers=caller.headers,
    )
    assert created.status_code == 201, created.text
    body = created.json()
    schedule_id = body["schedule_id"]
    assert body["workflow"] == "add" and body["input"] == {"a": 1, "b": 2}
    assert (body["cron"], body["every_seconds"], body["timezone"]) == (
        "30 2 * * *",
        None,
        "Europe/Berlin",
    )
    assert (body["catch_up"], body["paused"], body["fired_count"], body["refused_count"]) == (
        "one",
        False,
        0,
        0,
    )
    next_at = datetime.fromisoformat(body["next_at"])
    assert datetime.now(UTC) < next_at <= datetime.now(UTC) + timedelta(days=1, hours=1)
    listed = await api.client.get("/v1/schedules", headers=caller.headers)
    assert [s["schedule_id"] for s in listed.json()["schedules"]] == [schedule_id]
    url = f"/v1/schedules/{schedule_id}"
    assert (await api.client.get(url, headers=caller.headers)).json() == body

    # To an interval: the cron goes, next_at is the interval's next tick.
    edited = await api.client.patch(url, json={"every_seconds": 10}, headers=caller.headers)
    assert edited.status_code == 200, edited.text
    assert (edited.json()["cron"], edited.json()["every_seconds"]) == (None, 10)
    tick = datetime.fromisoformat(edited.json()["next_at"])
    assert tick.second % 10 == 0 and tick - datetime.now(UTC) <= timedelta(seconds=10)

    paused = await api.client.post(f"{url}/pause", headers=caller.headers)
    assert paused.status_code == 200 and paused.json()["paused"] is True
    patched = await api.client.patch(url, json={"paused": False}, headers=caller.headers)
    assert patched.json()["paused"] is False
    assert (await api.client.patch(url, json={"paused": True}, headers=caller.headers)).json()[
        "paused"
    ]
    resumed = await api.client.post(f"{url}/resume", headers=caller.headers)
    assert resumed.status_code == 200 and resumed.json()["paused"] is False
    assert datetime.fromisoformat(resumed.json()["next_at"]) > datetime.now(UTC)

    deleted = await api.client.delete(url, headers=caller.headers)
    assert deleted.status_code == 204
    gone = await api.client.get(url, headers=caller.headers)
    assert (gone.status_code, gone.json()["error"]["code"]) == (404, "schedule_not_found")


async def test_another_tenants_schedule_is_not_found(api: Api) -> None:
    owner, stranger = await api.tenant(), await api.tenant()
    created = await api.client.post(
        "/v1/schedules", json={"workflow": "echo", "every_seconds": 60}, headers=owner.headers
    )
    url = f"/v1/schedules/{created.json()['schedule_id']}"
    for method, path in (
        ("GET", url),
        ("PATCH", url),
        ("DELETE", url),
        ("POST", f"{url}/pause"),
        ("POST", f"{url}/resume"),
    ):
        answer = await api.client.request(
            method, path, headers=stranger.headers, json={} if method == "PATCH" else None
        )
        assert (answer.status_code, answer.json()["error"]["code"]) == (
            404,
            "schedule_not_found",
        ), (method, path)
    assert (await api.client.get("/v1/schedules", headers=stranger.headers)).json() == {
        "schedules": []
    }
    assert (await api.client.get(url, headers=owner.headers)).status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "code", "says"),
    [
        ({"workflow": "echo", "cron": "* * * *"}, 422, "invalid_request", "5 fields"),
        ({"workflow": "echo", "cron": "61 * * * *"}, 422, "invalid_request", "not valid"),
        ({"workflow": "echo"}, 422, "invalid_request", "exactly one"),
        (
            {"workflow": "echo", "cron": "* * * * *", "every_seconds": 5},
            422,
            "invalid_request",
            "exactly one",
        ),
        ({"workflow": "echo", "every_seconds": 0}, 422, "invalid_request", "every_seconds"),
        (
            {"workflow": "echo", "every_seconds": 5, "timezone": "Mars/Base"},
            422,
            "invalid_request",
            "time zone",
        ),
        (
            {"workflow": "echo", "every_seconds": 5, "catch_up": "all"},
            422,
            "invalid_request",
            "catch_up",
        ),
        ({"workflow": "nope", "every_seconds": 5}, 404, "workflow_not_found", "nope"),
        ({"workflow": "add", "every_seconds": 5, "input": {"a": "x"}}, 422, "invalid_input", "add"),
        (
            {"workflow": "echo", "every_seconds": 5, "tenant_id": "x"},
            422,
            "invalid_request",
            "tenant_id",
        ),
    ],
)
async def test_bad_schedules_are_refused_with_a_code_and_a_sentence(
    api: Api, body: dict[str, object], status: int, code: str, says: str
) -> None:
    caller = await api.tenant()
    refused = await api.client.post("/v1/schedules", json=body, headers=caller.headers)
    assert refused.status_code == status, refused.text
    error = refused.json()["error"]
    assert error["code"] == code and says in error["message"], error
    assert (await api.client.get("/v1/schedules", headers=caller.headers)).json() == {
        "schedules": []
    }


async def test_a_bad_edit_changes_nothing(api: Api) -> None:
    caller = await api.tenant()
    created = await api.client.post(
        "/v1/schedules",
        json={"workflow": "add", "input": {"a": 1, "b": 2}, "every_seconds": 30},
        headers=caller.headers,
    )
    url = f"/v1/schedules/{created.json()['schedule_id']}"
    for edit in (
        {"cron": "nonsense here and there now"},
        {"timezone": "Nowhere/Land"},
        {"input": {"a": "one"}},
        {"workflow": "echo", "input": {"x": 1}},
        {"paused": None},
    ):
        refused = await api.client.patch(url, json=edit, headers=caller.headers)
        assert refused.status_code in (404, 422), (edit, refused.text)
    assert (await api.client.get(url, headers=caller.headers)).json() == created.json()
    missing = await api.client.get("/v1/schedules/not-a-uuid", headers=caller.headers)
    assert missing.status_code == 404


async def test_the_client_manages_schedules(api: Api) -> None:
    caller = await api.tenant()
    transport = httpx.ASGITransport(app=api.app)
    async with Client("http://moorline.test", caller.api_key, transport=transport) as client:
        made = await client.create_schedule("echo", {"message": "hi"}, cron="0 9 * * MON")
        assert (made.cron, made.timezone, made.catch_up) == ("0 9 * * MON", "UTC", "skip")
        assert [s.schedule_id for s in await client.list_schedules()] == [made.schedule_id]
        moved = await client.update_schedule(made.schedule_id, timezone="Asia/Tokyo")
        assert moved.timezone == "Asia/Tokyo" and moved.next_at != made.next_at
        assert moved.next_at.astimezone(ZoneInfo("Asia/Tokyo")).hour == 9
        assert (await client.pause_schedule(made.schedule_id)).paused
        assert not (await client.resume_schedule(made.schedule_id)).paused
        assert (await client.get_schedule(made.schedule_id)).input == {"message": "hi"}
        await client.delete_schedule(made.schedule_id)
        with pytest.raises(ScheduleNotFound):
            await client.get_schedule(made.schedule_id)
