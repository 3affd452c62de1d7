"""``POST /v1/workflows/{workflow}/runs/batch`` and ``Client.trigger_many``, on every backend.

Each item is answered as the single trigger would answer its body; the request as a whole is
refused only for what the single trigger refuses before admission.
"""

import httpx
import pytest

from moorline.client import Client
from moorline.types import RunStatus
from tests.api.conftest import Api


@pytest.fixture(scope="module")
def api_database_url(database_url: str) -> str:
    return database_url


def client_of(api: Api, api_key: str) -> Client:
    return Client("http://moorline.test", api_key, transport=httpx.ASGITransport(app=api.app))


async def test_each_item_gets_the_single_triggers_answer(api: Api) -> None:
    caller = await api.tenant("team")
    first = await api.trigger(caller, "add", input={"a": 1, "b": 1}, idempotency_key="k")
    assert first.status_code == 202
    items = [
        {"input": {"a": 1, "b": 2}},
        {"input": {"a": 1, "b": 1}, "idempotency_key": "k"},
        {"input": {"a": 9, "b": 9}, "idempotency_key": "k"},
        {"input": {"a": "x", "b": 1}},
        {"input": {"a": 3, "b": 3}, "conversation_id": "c-1"},
        {"input": {"a": 4, "b": 4}, "conversation_id": "c-1"},
        {"input": {"a": 5, "b": 5}, "delay_seconds": 60},
    ]
    response = await api.client.post(
        "/v1/workflows/add/runs/batch", json={"runs": items}, headers=caller.headers
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["created"], body["existing"], body["refused"]) == (3, 1, 3)
    new, repeat, conflict, invalid, talk, busy, delayed = body["results"]
    assert new["status_code"] == 202 and new["status"] == "queued" and new["error"] is None
    assert repeat["status_code"] == 200 and repeat["run_id"] == first.json()["run_id"]
    assert conflict["status_code"] == 409 and conflict["error"]["code"] == "idempotency_conflict"
    assert conflict["run_id"] is None
    assert invalid["status_code"] == 422 and invalid["error"]["code"] == "invalid_input"
    assert talk["status_code"] == 202
    assert busy["status_code"] == 409 and busy["error"]["code"] == "conversation_busy"
    assert busy["error"]["run_id"] == talk["run_id"]
    assert delayed["status_code"] == 202
    # Only the new runs were stored: the first trigger's, and three of the batch.
    assert await api.count_runs(caller) == 4
    got = await api.client.get(f"/v1/runs/{new['run_id']}", headers=caller.headers)
    assert got.json()["input"] == {"a": 1, "b": 2}


async def test_over_the_quota_and_rate_items_are_429_each(api: Api) -> None:
    caller = await api.tenant("trickle")  # daily quota 2, rate 3/minute
    items = [{"input": {"a": n, "b": 0}} for n in range(4)]
    response = await api.client.post(
        "/v1/workflows/add/runs/batch", json={"runs": items}, headers=caller.headers
    )
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [r["status_code"] for r in results] == [202, 202, 429, 429]
    quota, rate = results[2], results[3]
    assert quota["error"]["code"] == "quota_exceeded" and quota["status"] == "rate_limited"
    assert quota["run_id"] == quota["error"]["run_id"]
    assert rate["error"]["code"] == "rate_limited" and rate["run_id"] is None
    assert await api.count_runs(caller, RunStatus.RATE_LIMITED) == 1
    assert await api.count_runs(caller) == 3


async def test_more_than_1000_items_refuse_the_whole_request(api: Api) -> None:
    caller = await api.tenant("team")
    items = [{"input": {"a": n, "b": 0}} for n in range(1_001)]
    response = await api.client.post(
        "/v1/workflows/add/runs/batch", json={"runs": items}, headers=caller.headers
    )
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and "runs" in error["message"]
    assert await api.count_runs(caller) == 0


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/v1/workflows/nope/runs/batch", {"runs": [{"input": {}}]}, 404, "workflow_not_found"),
        ("/v1/workflows/add/runs/batch", {"runs": []}, 422, "invalid_request"),
        ("/v1/workflows/add/runs/batch", {"runs": [{"inptu": {}}]}, 422, "invalid_request"),
    ],
)
async def test_what_the_single_trigger_refuses_first_refuses_the_batch(
    api: Api, path: str, body: object, status: int, code: str
) -> None:
    caller = await api.tenant("team")
    response = await api.client.post(path, json=body, headers=caller.headers)
    assert response.status_code == status
    assert response.json()["error"]["code"] == code
    assert await api.count_runs(caller) == 0


async def test_without_a_key_the_batch_is_401(api: Api) -> None:
    response = await api.client.post("/v1/workflows/add/runs/batch", json={"runs": []})
    assert response.status_code == 401


async def test_trigger_many_sends_1000_a_request_and_answers_in_order(api: Api) -> None:
    caller = await api.tenant("team")  # daily quota 500: the rest are stored rate_limited
    items = [{"input": {"a": n, "b": 0}, "idempotency_key": f"n-{n}"} for n in range(1_001)]
    async with client_of(api, caller.api_key) as client:
        answers = await client.trigger_many("add", items)
        again = await client.trigger_many("add", [*items[:3], {"input": {"a": "x", "b": 0}}])
    assert len(answers) == 1_001
    # Which items get the last units of the quota is not the list's order (items are admitted
    # concurrently); how many is exact.
    codes = [a.status_code for a in answers]
    assert (codes.count(202), codes.count(429)) == (500, 501)
    assert all(a.status == "rate_limited" for a in answers if a.status_code == 429)
    assert len({a.run_id for a in answers}) == 1_001  # the last one came in a second request
    # An item refused by the quota was stored without its key: repeated, it is refused again.
    assert [a.status_code for a in again[:3]] == [200 if c == 202 else 429 for c in codes[:3]]
    assert [a.run_id for a in again[:3] if a.status_code == 200] == [
        a.run_id for a in answers[:3] if a.status_code == 202
    ]
    assert again[3].error is not None and again[3].error["code"] == "invalid_input"
    assert await api.count_runs(caller, RunStatus.QUEUED) == 500
    assert await api.count_runs(caller, RunStatus.RATE_LIMITED) == 501
