"""A bulk retry whose processor is killed mid-job (kill -9) finishes, each run retried once.

Real ``moorline worker`` processes run the bulk processor (leader-elected). The first is
killed once the job is under way; the second takes the leadership when the first's lease
expires and finishes the job from the last committed batch. The runs sit in a lane no worker
serves, so a retried run stays ``queued`` and its ``retried`` events count its retries.
300 runs on SQLite and PostgreSQL at CI size, 10,000 on every backend with ``MOORLINE_FULL=1``.
"""

from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import delete, func, select, update

from moorline.db.manager import DatabaseManager
from moorline.db.repos.bulk_jobs import BulkAction, BulkJob, BulkJobsRepo, BulkState
from moorline.db.repos.listing import RunFilter
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.db.schema import bulk_jobs, events, runs
from moorline.types import RunStatus
from tests.conftest import BACKENDS
from tests.contract.queue_helpers import Tenants
from tests.faults.harness import Workers
from tests.helpers import FULL_SIZE, wait_for

pytestmark = pytest.mark.faults

RUNS = 10_000 if FULL_SIZE else 300
CI_BACKENDS = ["sqlite", "postgresql"]
"""MariaDB too at full size: its batches are tested beside each other in api/test_bulk.py."""
BATCH = 200 if FULL_SIZE else 10
UNSERVED_LANE = "bulk_unserved"


@pytest.fixture(scope="module", params=BACKENDS if FULL_SIZE else CI_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


@pytest.fixture
def workers(database_url: str, tmp_path: Path) -> Iterator[Workers]:
    made = Workers(
        database_url,
        tmp_path,
        measured=False,  # killed by SIGKILL: coverage would only slow it down
        extra_env={
            "MOORLINE_BULK_BATCH_SIZE": str(BATCH),
            "MOORLINE_BULK_PAUSE": "0.05",
            "MOORLINE_BULK_INTERVAL": "0.2",
        },
    )
    yield made
    made.kill_all()


async def test_a_bulk_retry_survives_its_processor_killed_mid_job(
    db: DatabaseManager, tenants: Tenants, workers: Workers
) -> None:
    tenant_id = await tenants.new()
    new = [
        NewRun(tenant_id=tenant_id, workflow="echo", input={"i": i}, lane=UNSERVED_LANE)
        for i in range(RUNS)
    ]
    for offset in range(0, RUNS, 1000):
        await RunsRepo(db).submit_many(new[offset : offset + 1000])
    async with db.transaction() as conn:
        await conn.execute(
            update(runs)
            .where(runs.c.tenant_id == tenant_id)
            .values(status=RunStatus.FAILED.value, attempt=3, finished_at=datetime.now(UTC))
        )
    jobs = BulkJobsRepo(db)
    job, _ = await jobs.create(
        scope=tenant_id,
        action=BulkAction.RETRY,
        where=RunFilter(status=RunStatus.FAILED),
        filters={"status": "failed"},
        tenant_id=tenant_id,
    )
    assert job.total == RUNS
    try:
        first = workers.start()

        async def under_way() -> BulkJob | None:
            found = await jobs.get(job.job_id)
            return found if found.done >= RUNS // 10 else None

        at_kill = await wait_for(under_way, timeout_s=60, message="the job to be under way")
        assert at_kill is not None
        first.kill()  # SIGKILL, mid-job: its lease and its open batch are left behind
        first.wait()
        killed = await jobs.get(job.job_id)
        assert killed.state is BulkState.RUNNING and killed.done < RUNS, "killed too late"
        assert killed.done >= at_kill.done
        workers.start()

        async def finished() -> BulkJob | None:
            found = await jobs.get(job.job_id)
            return found if found.state is BulkState.FINISHED else None

        done = await wait_for(finished, timeout_s=120, message="the job to finish")
        assert done is not None
        assert (done.done, done.failed) == (RUNS, 0)
        retried = (
            select(events.c.run_id, func.count().label("n"))
            .join(runs, runs.c.id == events.c.run_id)
            .where(runs.c.tenant_id == tenant_id, events.c.type == "retried")
            .group_by(events.c.run_id)
        )
        async with db.connect() as conn:
            counts = [row.n for row in await conn.execute(retried)]
            states = (
                await conn.execute(
                    select(runs.c.status, runs.c.resumes, func.count())
                    .where(runs.c.tenant_id == tenant_id)
                    .group_by(runs.c.status, runs.c.resumes)
                )
            ).all()
        assert len(counts) == RUNS and set(counts) == {1}  # each run retried exactly once
        assert [tuple(row) for row in states] == [("queued", 3, RUNS)]  # a fresh budget each
    finally:
        workers.kill_all()
        async with db.transaction() as conn:
            await conn.execute(delete(bulk_jobs).where(bulk_jobs.c.id == job.job_id))
