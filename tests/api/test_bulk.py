"""Bulk cancel and retry through the API, processed as the worker processes do, on every backend.

The processor is the one every worker process runs (:func:`make_bulk_processor`), ticked here
in the test's process; the fault test (``tests/faults/test_bulk_faults.py``) kills a real one.
300 runs at CI size, 10,000 with ``MOORLINE_FULL=1`` (``make test-full``).
"""

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select, update

from moorline.db.manager import DatabaseManager
from moorline.db.repos.bulk_jobs import BulkAction, BulkJobsRepo, BulkState
from moorline.db.repos.listing import RunFilter
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.db.schema import bulk_jobs, events, runs
from moorline.dispatch.bulk import make_bulk_processor
from moorline.errors import TooManyRuns
from moorline.types import RunId, RunStatus, TenantId
from tests.api.conftest import ADMIN, Api, Caller
from tests.helpers import FULL_SIZE

RUNS = 10_000 if FULL_SIZE else 300


@pytest.fixture(scope="module")
def api_database_url(database_url: str) -> str:
    return database_url


async def stored_runs(
    db: DatabaseManager, caller: Caller, count: int, status: RunStatus, workflow: str = "echo"
) -> list[RunId]:
    """``count`` runs of ``caller`` in ``status`` (failed ones after one attempt)."""
    new = [
        NewRun(tenant_id=TenantId(caller.tenant_id), workflow=workflow, input={}, lane="w")
        for _ in range(count)
    ]
    ids: list[RunId] = []
    for offset in range(0, count, 1000):
        ids += [run.run_id for run in await RunsRepo(db).submit_many(new[offset : offset + 1000])]
    if status is not RunStatus.QUEUED:
        async with db.transaction() as conn:
            await conn.execute(
                update(runs)
                .where(runs.c.tenant_id == caller.tenant_id, runs.c.workflow == workflow)
                .values(
                    status=status.value,
                    attempt=1,
                    error={"type": "RuntimeError", "message": "bad deploy"},
                    finished_at=datetime.now(UTC),
                )
            )
    return ids


async def process_jobs(api: Api) -> int:
    """One pass of a bulk processor as a worker process runs it; the batches it committed."""
    processor = make_bulk_processor(api.settings, api.db)
    try:
        return await processor.tick()
    finally:
        await processor.elector.resign()  # the next test's processor leads at once


async def retried_counts(db: DatabaseManager, caller: Caller) -> dict[str, int]:
    """How many ``retried`` events each of the tenant's runs has."""
    stmt = (
        select(events.c.run_id, func.count())
        .join(runs, runs.c.id == events.c.run_id)
        .where(runs.c.tenant_id == caller.tenant_id, events.c.type == "retried")
        .group_by(events.c.run_id)
    )
    async with db.connect() as conn:
        return {row[0]: row[1] for row in await conn.execute(stmt)}


async def test_a_bulk_retry_sent_twice_retries_each_run_once(api: Api) -> None:
    caller, bystander = await api.tenant(), await api.tenant()
    failed = await stored_runs(api.db, caller, RUNS, RunStatus.FAILED)
    untouched = await stored_runs(api.db, bystander, 3, RunStatus.FAILED)
    body = {"status": "failed", "workflow": "echo", "idempotency_key": "bad-deploy-1"}

    first = await api.client.post("/v1/runs/bulk/retry", json=body, headers=caller.headers)
    second = await api.client.post("/v1/runs/bulk/retry", json=body, headers=caller.headers)

    assert (first.status_code, second.status_code) == (202, 200), first.text
    job_id = first.json()["job_id"]
    assert second.json()["job_id"] == job_id
    assert first.json()["total"] == RUNS and first.json()["state"] == "running"
    assert await process_jobs(api) >= -(-RUNS // api.settings.bulk_batch_size)
    progress = await api.client.get(f"/v1/runs/bulk/{job_id}", headers=caller.headers)
    assert progress.json()["state"] == "finished", progress.text
    assert (progress.json()["done"], progress.json()["failed"]) == (RUNS, 0)
    counts = await retried_counts(api.db, caller)
    assert set(counts) == set(failed) and set(counts.values()) == {1}
    assert await api.count_runs(caller, RunStatus.QUEUED) == RUNS
    assert await retried_counts(api.db, bystander) == {}
    assert len(untouched) == await api.count_runs(bystander, RunStatus.FAILED)
    assert await process_jobs(api) == 0  # nothing left: a finished job is never taken again


async def test_concurrent_processors_act_on_each_run_once(api: Api) -> None:
    caller = await api.tenant()
    await stored_runs(api.db, caller, 120, RunStatus.FAILED)
    jobs = BulkJobsRepo(api.db)
    job, _ = await jobs.create(
        scope=caller.tenant_id,
        action=BulkAction.RETRY,
        where=RunFilter(),
        filters={"all": True},
        tenant_id=TenantId(caller.tenant_id),
    )

    async def process() -> None:
        # As a processor that believes it leads, beside others that do too.
        while (await jobs.process_batch(job.job_id, size=7)).job.state is BulkState.RUNNING:
            pass

    await asyncio.gather(process(), process(), process())

    finished = await jobs.get(job.job_id)
    assert (finished.state, finished.done, finished.failed) == (BulkState.FINISHED, 120, 0)
    counts = await retried_counts(api.db, caller)
    assert len(counts) == 120 and set(counts.values()) == {1}


async def test_a_bulk_cancel_ends_queued_runs_and_counts_those_that_changed(api: Api) -> None:
    caller = await api.tenant()
    queued = await stored_runs(api.db, caller, 5, RunStatus.QUEUED)
    running = (await api.trigger(caller, "echo")).json()["run_id"]
    await api.start(running)
    created_after = (datetime.now(UTC) - timedelta(hours=1)).isoformat()

    started = await api.client.post(
        "/v1/runs/bulk/cancel",
        json={"workflow": "echo", "created_after": created_after},
        headers=caller.headers,
    )
    assert started.status_code == 202, started.text
    assert started.json()["total"] == 6
    await api.client.post(f"/v1/runs/{queued[0]}/cancel", headers=caller.headers)  # beforehand
    await process_jobs(api)

    job = await api.client.get(f"/v1/runs/bulk/{started.json()['job_id']}", headers=caller.headers)
    assert (job.json()["done"], job.json()["failed"], job.json()["state"]) == (5, 1, "finished")
    assert await api.count_runs(caller, RunStatus.CANCELLED) == 5
    run = (await api.client.get(f"/v1/runs/{running}", headers=caller.headers)).json()
    assert run["status"] == "running"  # signalled; it ends cancelled at its next check
    async with api.db.connect() as conn:
        requested = select(runs.c.cancel_requested_at).where(runs.c.id == running)
        assert (await conn.execute(requested)).scalar_one() is not None


async def test_bad_bulk_requests_are_refused_and_store_nothing(api: Api) -> None:
    caller = await api.tenant()
    await stored_runs(api.db, caller, 3, RunStatus.FAILED)

    async def post(action: str, body: dict[str, object]) -> tuple[int, str]:
        response = await api.client.post(
            f"/v1/runs/bulk/{action}", json=body, headers=caller.headers
        )
        return response.status_code, response.json()["error"]["code"]

    assert await post("retry", {}) == (422, "invalid_request")
    assert await post("retry", {"status": "queued"}) == (422, "invalid_request")
    assert await post("cancel", {"status": "failed"}) == (422, "invalid_request")
    assert await post("retry", {"ids": ["not a run id!"]}) == (422, "invalid_request")
    assert await post("retry", {"created_after": "2026-01-01T00:00:00"}) == (422, "invalid_request")
    far: dict[str, object] = {"created_before": "0001-01-01T00:00:00+01:00"}  # out of range
    assert await post("retry", far) == (422, "invalid_request")
    accepted = await api.client.post(
        "/v1/runs/bulk/retry",
        json={"status": "failed", "idempotency_key": "k"},
        headers=caller.headers,
    )
    assert accepted.status_code == 202
    conflict = await post("retry", {"workflow": "echo", "idempotency_key": "k"})
    assert conflict == (409, "idempotency_conflict")
    with pytest.raises(TooManyRuns, match="more than 2 runs"):
        await BulkJobsRepo(api.db).create(
            scope=caller.tenant_id,
            action=BulkAction.RETRY,
            where=RunFilter(),
            filters={"all": True},
            tenant_id=TenantId(caller.tenant_id),
            max_runs=2,
        )
    async with api.db.connect() as conn:
        count = select(func.count()).where(bulk_jobs.c.scope == caller.tenant_id)
        assert (await conn.execute(count)).scalar_one() == 1  # the one accepted above
    listed = await api.client.get("/v1/runs/bulk/no-such-job", headers=caller.headers)
    assert listed.status_code == 404 and listed.json()["error"]["code"] == "bulk_job_not_found"
    odd = await api.client.get("/v1/runs/bulk/no%00job", headers=caller.headers)
    assert odd.status_code == 422 and odd.json()["error"]["code"] == "invalid_request"


async def test_admin_bulk_jobs_act_on_a_chosen_tenant(api: Api) -> None:
    caller, other = await api.tenant(), await api.tenant()
    mine = await stored_runs(api.db, caller, 4, RunStatus.TIMED_OUT)
    await stored_runs(api.db, other, 2, RunStatus.TIMED_OUT)

    started = await api.client.post(
        "/v1/admin/runs/bulk/retry",
        json={"tenant_id": caller.tenant_id, "status": "timed_out"},
        headers=ADMIN,
    )
    assert started.status_code == 202 and started.json()["total"] == len(mine)
    job_id = started.json()["job_id"]
    hidden = await api.client.get(f"/v1/runs/bulk/{job_id}", headers=other.headers)
    assert hidden.status_code == 404  # an admin job is no tenant's
    await process_jobs(api)
    job = (await api.client.get(f"/v1/admin/runs/bulk/{job_id}", headers=ADMIN)).json()
    assert (job["state"], job["done"]) == ("finished", 4)
    assert await api.count_runs(other, RunStatus.TIMED_OUT) == 2
    refused = await api.client.post(
        "/v1/admin/runs/bulk/retry", json={"status": "failed"}, headers=caller.headers
    )
    assert refused.status_code == 403
