"""Waiting runs through the API: listed, described, decided, messaged and cancelled.

The run is parked with the repository, under the fence a worker's claim would hold, as its
workflow's wait would park it; the API then sees what a client sees.
"""

from datetime import UTC, datetime, timedelta

from moorline.db.repos.events import EventsRepo
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.parking import ParkingRepo, Wait, WaitKind
from moorline.types import RunId
from tests.api.conftest import Api
from tests.api.test_run_control import running_run


async def test_a_parked_run_is_listed_as_waiting_with_what_it_waits_for(api: Api) -> None:
    caller = await api.tenant()
    run_id, fence = await running_run(api, caller)
    opened = await InterruptsRepo(api.db).open(fence, "permission:1", "ship", {"pr": 7}, 600)
    until = opened.expires_at
    wait = Wait(kind=WaitKind.PERMISSION, until=until, interrupt_id=opened.interrupt_id)
    assert await ParkingRepo(api.db).park(fence, wait)

    listed = await api.client.get("/v1/runs?status=waiting", headers=caller.headers)
    assert listed.status_code == 200
    [summary] = listed.json()["runs"]
    assert summary["run_id"] == run_id and summary["status"] == "waiting"
    expected = {"kind": "permission", "until": summary["waiting_for"]["until"]}
    described = {**expected, "interrupt_id": opened.interrupt_id, "children": None, "model": None}
    assert summary["waiting_for"] == described
    assert datetime.fromisoformat(summary["waiting_for"]["until"]) == until
    detail = (await api.client.get(f"/v1/runs/{run_id}", headers=caller.headers)).json()
    assert detail["pending_interrupt"]["interrupt_id"] == opened.interrupt_id

    decided = await api.client.post(
        f"/v1/runs/{run_id}/resume", json={"approved": True}, headers=caller.headers
    )
    assert decided.status_code == 200, decided.text
    after = (await api.client.get(f"/v1/runs/{run_id}", headers=caller.headers)).json()
    assert (after["status"], after["waiting_for"]) == ("queued", None)
    # (The stream of a run that has not ended stays open: read the record it replays.)
    stored = await EventsRepo(api.db).list(RunId(run_id))
    assert [e.type for e in stored][-2:] == ["waiting", "resumed"]
    assert stored[-1].data == {"reason": "decision", "waited_for": "permission"}


async def test_a_run_waiting_for_a_message_accepts_one_and_is_queued(api: Api) -> None:
    caller = await api.tenant()
    run_id, fence = await running_run(api, caller)
    assert await ParkingRepo(api.db).park(fence, Wait(kind=WaitKind.MESSAGE, until=None))
    posted = await api.client.post(
        f"/v1/runs/{run_id}/messages", json={"content": "hello"}, headers=caller.headers
    )
    assert posted.status_code == 202, posted.text
    assert posted.json() == {"run_id": run_id, "seq": 1}
    run = (await api.client.get(f"/v1/runs/{run_id}", headers=caller.headers)).json()
    assert run["status"] == "queued"


async def test_a_run_sleeping_refuses_messages(api: Api) -> None:
    caller = await api.tenant()
    run_id, fence = await running_run(api, caller)
    later = datetime.now(UTC) + timedelta(hours=1)
    assert await ParkingRepo(api.db).park(fence, Wait(kind=WaitKind.SLEEP, until=later))
    posted = await api.client.post(
        f"/v1/runs/{run_id}/messages", json={"content": "hello"}, headers=caller.headers
    )
    assert posted.status_code == 409
    assert posted.json()["error"]["code"] == "run_not_interactive"


async def test_cancelling_a_waiting_run_ends_it_at_once(api: Api) -> None:
    caller = await api.tenant()
    run_id, fence = await running_run(api, caller)
    later = datetime.now(UTC) + timedelta(hours=1)
    assert await ParkingRepo(api.db).park(fence, Wait(kind=WaitKind.SLEEP, until=later))
    cancelled = await api.client.post(f"/v1/runs/{run_id}/cancel", headers=caller.headers)
    assert cancelled.json() == {"run_id": run_id, "status": "cancelled"}
