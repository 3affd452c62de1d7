"""Runs the no-op workload through Moorline, timed as the peers are (:mod:`timing`).

    .venv/bin/python bench/peers/moorline_driver.py RUNS PRODUCERS WORKERS CONCURRENCY

Prints one JSON object (``enqueue``, ``drain`` in tasks/s, and how they were measured) as its
last line. A fresh PostgreSQL database (default settings: ``synchronous_commit`` on) is made for
the run and dropped after it.

- enqueue: ``PRODUCERS`` coroutines of this process submit through the group-commit
  ``Submitter``, the API's own path: concurrent submissions share a transaction, and each call
  returns once its run is committed;
- drain: ``WORKERS`` ``moorline worker`` processes, ``CONCURRENCY`` slots each, run the queued
  no-op runs; done means the run's ``succeeded`` status is committed.
"""

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sqlalchemy import func, select
from timing import WARM_UP_PER_PRODUCER, DrainClock

from moorline.benchmarks.common import on_fresh_database, seed_tenant
from moorline.benchmarks.dispatch import LANE, new_run
from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.db.repos.runs import RunsRepo
from moorline.db.schema import runs
from moorline.dispatch.submit import Submitter
from moorline.settings import Settings
from moorline.types import TenantId

REPO_ROOT = Path(__file__).resolve().parents[2]
PLANS = """plans:
  bench:
    lane: workflow
    priority: 0
    daily_quota: 100000000
    rate_limit: "100000/second"
    tenant_concurrency: 100000
    lane_slots: 1000
"""


async def enqueue(db: DatabaseManager, tenant: TenantId, count: int, producers: int) -> float:
    """Tasks per second submitted by ``producers`` coroutines, after a warm-up."""
    submitter = Submitter(RunsRepo(db))

    async def produce(share: int) -> None:
        for _ in range(share):
            await submitter.submit(new_run(tenant, LANE))

    await asyncio.gather(*(produce(WARM_UP_PER_PRODUCER) for _ in range(producers)))
    shares = [count // producers + (index < count % producers) for index in range(producers)]
    started = time.perf_counter()
    await asyncio.gather(*(produce(share) for share in shares))
    elapsed = time.perf_counter() - started
    await submitter.close()
    return count / elapsed


def start_workers(
    url: str, folder: Path, workers: int, concurrency: int
) -> list[subprocess.Popen[bytes]]:
    plans = folder / "plans.yaml"
    plans.write_text(PLANS)
    env = dict(
        os.environ,
        MOORLINE_DATABASE_URL=url,
        MOORLINE_EDITION="community",
        MOORLINE_PLANS_FILE=str(plans),
        PYTHONPATH=str(REPO_ROOT),
    )
    for name in ("MOORLINE_DATABASE_URLS", "MOORLINE_REDIS_URL"):
        env.pop(name, None)
    command = [sys.executable, "-m", "moorline", "worker", "--app"]
    command += ["moorline.benchmarks.dispatch:app", "--lanes", f"{LANE}={concurrency}"]
    return [
        subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=(folder / f"worker-{index}.log").open("wb"),
        )
        for index in range(workers)
    ]


async def drain(url: str, total: int, workers: int, concurrency: int) -> dict[str, float]:
    db = DatabaseManager(Settings(database_url=url))
    query = select(func.count()).select_from(runs).where(runs.c.status == "succeeded")
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        procs = start_workers(url, Path(folder), workers, concurrency)
        clock = DrainClock(total, started)
        try:
            while True:
                async with db.connect() as conn:
                    measured = clock.see(int(await conn.scalar(query) or 0))
                if measured is not None:
                    return measured.as_dict()
                await asyncio.sleep(clock.poll_s)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(30)
            await db.dispose()


async def workload(
    url: str, count: int, producers: int, workers: int, concurrency: int
) -> dict[str, float]:
    db = DatabaseManager(Settings(database_url=url))
    try:
        await upgrade(db)
        tenant = await seed_tenant(db)
        rate = await enqueue(db, tenant, count, producers)
    finally:
        await db.dispose()
    total = count + WARM_UP_PER_PRODUCER * producers
    return {"enqueue": rate, **await drain(url, total, workers, concurrency)}


def main() -> None:
    count, producers, workers, concurrency = (int(arg) for arg in sys.argv[1:5])

    async def on(url: str) -> dict[str, float]:
        return await workload(url, count, producers, workers, concurrency)

    print(json.dumps(asyncio.run(on_fresh_database("postgresql", on))))


if __name__ == "__main__":
    main()
