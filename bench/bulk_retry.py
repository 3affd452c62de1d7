"""How fast a bulk retry goes: 10,000 failed runs, one job, per backend.

On a fresh database of each backend, ``--runs`` failed runs are stored directly; then the
timed part: the job is created as ``POST /v1/runs/bulk/retry`` creates it (the ``INSERT …
SELECT`` of its runs) and processed by one bulk processor as a worker process runs it, with
the settings' batch size and with ``--pause`` between batches. Prints the creation time, the
processing time and the rate in runs per second, median of ``--rounds``.

    .venv/bin/python bench/bulk_retry.py [--runs 10000] [--rounds 3]
        [--backends sqlite,postgresql,mysql] [--batch 200] [--pause 0.02]
"""

import argparse
import asyncio
import statistics
import time
from datetime import UTC, datetime

from sqlalchemy import update

from moorline.benchmarks.common import on_fresh_database, seed_tenant
from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.db.repos.bulk_jobs import BulkAction, BulkJobsRepo, BulkState
from moorline.db.repos.listing import RunFilter
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.db.schema import runs
from moorline.dispatch.bulk import make_bulk_processor
from moorline.settings import Settings
from moorline.types import RunStatus


async def one_round(url: str, count: int, batch: int, pause_s: float) -> tuple[float, float]:
    settings = Settings(database_url=url, bulk_batch_size=batch, bulk_pause=pause_s)
    db = DatabaseManager(settings)
    try:
        await upgrade(db)
        await db.initialize()
        tenant = await seed_tenant(db)
        new = [NewRun(tenant_id=tenant, workflow="w", input={}, lane="l") for _ in range(count)]
        for offset in range(0, count, 1000):
            await RunsRepo(db).submit_many(new[offset : offset + 1000])
        async with db.transaction() as conn:
            await conn.execute(
                update(runs).values(
                    status=RunStatus.FAILED.value, attempt=1, finished_at=datetime.now(UTC)
                )
            )
        started = time.perf_counter()
        job, _ = await BulkJobsRepo(db).create(
            scope=tenant,
            action=BulkAction.RETRY,
            where=RunFilter(status=RunStatus.FAILED),
            filters={"status": "failed"},
            tenant_id=tenant,
        )
        created = time.perf_counter()
        processor = make_bulk_processor(settings, db)
        await processor.tick()
        done = time.perf_counter()
        finished = await BulkJobsRepo(db).get(job.job_id)
        assert finished.state is BulkState.FINISHED and finished.done == count, finished
        return created - started, done - created
    finally:
        await db.dispose()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default="sqlite,postgresql,mysql")
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--pause", type=float, default=0.02)
    args = parser.parse_args()
    print(f"bulk retry of {args.runs} failed runs, batches of {args.batch}, pause {args.pause}s")
    print(f"{'backend':<11} {'create (s)':>10} {'process (s)':>11} {'runs/s':>9}")
    for backend in args.backends.split(","):
        results = [
            await on_fresh_database(
                backend, lambda url: one_round(url, args.runs, args.batch, args.pause)
            )
            for _ in range(args.rounds)
        ]
        create = statistics.median(r[0] for r in results)
        process = statistics.median(r[1] for r in results)
        print(f"{backend:<11} {create:>10.2f} {process:>11.2f} {args.runs / process:>9.0f}")


if __name__ == "__main__":
    asyncio.run(main())
