"""Issue 21's dashboard reads on every backend: per-workflow statistics and run search.

Runs are triggered over HTTP and then ended by writing their final columns as a worker's
finish would (status, ``finished_at``, ``elapsed_time``), so the figures are known exactly.
"""

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import update

from moorline.db.schema import runs
from tests.api.conftest import ADMIN, Api, Caller


@pytest.fixture(scope="module")
def api_database_url(database_url: str) -> str:
    return database_url


async def ended(api: Api, run_id: str, status: str, elapsed_s: float, at: datetime) -> None:
    async with api.db.transaction() as conn:
        await conn.execute(
            update(runs)
            .where(runs.c.id == run_id)
            .values(status=status, finished_at=at, elapsed_time=elapsed_s, updated_at=at)
        )


async def started(api: Api, caller: Caller, workflow: str, **input: Any) -> str:
    answer = await api.trigger(caller, workflow, input=input)
    assert answer.status_code == 202, answer.text
    run_id: str = answer.json()["run_id"]
    return run_id


async def test_statistics_count_rate_and_percentiles_per_workflow(api: Api) -> None:
    caller, other = await api.tenant(), await api.tenant()
    now = datetime.now(UTC)
    # echo: durations 1..10 s succeeded, 11 s failed, 12 s timed out, one cancelled (no time).
    for seconds in range(1, 11):
        await ended(api, await started(api, caller, "echo"), "succeeded", seconds, now)
    await ended(api, await started(api, caller, "echo"), "failed", 11, now)
    await ended(api, await started(api, caller, "echo"), "timed_out", 12, now)
    await ended(api, await started(api, caller, "echo"), "cancelled", 99, now)
    # add: one run that ended two hours ago (outside the default hour), one now.
    await ended(api, await started(api, caller, "add", a=1, b=2), "succeeded", 5, now)
    old = await started(api, caller, "add", a=1, b=2)
    await ended(api, old, "failed", 7, now - timedelta(hours=2))
    # Another tenant's run is not the caller's.
    await ended(api, await started(api, other, "echo"), "failed", 1, now)

    answer = await api.client.get("/v1/stats/workflows", headers=caller.headers)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    by_name = {w["workflow"]: w for w in body["workflows"]}
    assert sorted(by_name) == ["add", "echo"]
    echo = by_name["echo"]
    assert echo["ended"] == 13
    assert echo["by_status"] == {"cancelled": 1, "failed": 1, "succeeded": 10, "timed_out": 1}
    assert echo["failure_rate"] == pytest.approx(2 / 13)
    assert echo["runs_per_minute"] == pytest.approx(13 / 60)
    # Nearest rank over the 12 timed runs 1..12 s: p50 the 6th, p95 the 12th.
    assert (echo["p50_seconds"], echo["p95_seconds"]) == (6, 12)
    assert by_name["add"]["ended"] == 1 and not echo["sampled"]

    # A range of three hours takes the older run in.
    since = (now - timedelta(hours=3)).isoformat()
    until = (now + timedelta(minutes=1)).isoformat()
    wide = await api.client.get(
        "/v1/stats/workflows", params={"since": since, "until": until}, headers=caller.headers
    )
    assert {w["workflow"]: w["ended"] for w in wide.json()["workflows"]} == {"add": 2, "echo": 13}

    # The admin sees every tenant's, or one tenant's.
    every = await api.client.get("/v1/admin/stats/workflows", headers=ADMIN)
    assert {w["workflow"]: w["ended"] for w in every.json()["workflows"]}["echo"] >= 14
    one = await api.client.get(
        "/v1/admin/stats/workflows", params={"tenant_id": other.tenant_id}, headers=ADMIN
    )
    assert [(w["workflow"], w["ended"]) for w in one.json()["workflows"]] == [("echo", 1)]


@pytest.mark.parametrize(
    "params",
    [
        {"since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"},
        {"since": "2026-01-01T00:00:00Z", "until": "2026-03-01T00:00:00Z"},
        {"since": "2026-01-01T00:00:00"},  # no offset
    ],
)
async def test_a_bad_range_is_refused(api: Api, params: dict[str, str]) -> None:
    caller = await api.tenant()
    refused = await api.client.get("/v1/stats/workflows", params=params, headers=caller.headers)
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["code"] == "invalid_request"


async def test_search_by_run_id_input_text_and_creation_time(api: Api) -> None:
    caller, other = await api.tenant(), await api.tenant()
    wanted = await started(api, caller, "echo", message="Lighthouses at dusk")
    plain = await started(api, caller, "echo", message="harbour")
    await started(api, other, "echo", message="lighthouses elsewhere")

    async def found(**params: str) -> list[str]:
        page = await api.client.get("/v1/runs", params=params, headers=caller.headers)
        assert page.status_code == 200, page.text
        return [run["run_id"] for run in page.json()["runs"]]

    # The short id the dashboard shows is an id's end (the start is the time it was made);
    # up to 12 characters match either end, more the start only.
    assert await found(run_id=wanted[-8:]) == [wanted]
    assert wanted in await found(run_id=wanted[:8])
    assert await found(run_id=wanted[:24]) == [wanted]
    assert await found(run_id=wanted[-24:]) == []
    assert await found(run_id=wanted) == [wanted]
    assert await found(input_contains="LIGHTHOUSE") == [wanted]  # any case, own runs only
    assert await found(input_contains="50%_off") == []  # LIKE's wildcards are text here
    assert set(await found()) == {wanted, plain}
    later = (datetime.now(UTC) + timedelta(minutes=1)).isoformat()
    assert await found(created_after=later) == []
    assert set(await found(created_before=later)) == {wanted, plain}
    # The admin searches every tenant's runs the same way.
    page = await api.client.get(
        "/v1/admin/runs", params={"input_contains": "lighthouses"}, headers=ADMIN
    )
    assert wanted in [run["run_id"] for run in page.json()["runs"]]
    assert len(page.json()["runs"]) >= 2
    page = await api.client.get("/v1/admin/runs", params={"run_id": wanted[-8:]}, headers=ADMIN)
    assert [run["run_id"] for run in page.json()["runs"]] == [wanted]
    refused = await api.client.get("/v1/runs", params={"run_id": "XYZ!"}, headers=caller.headers)
    assert refused.status_code == 422
