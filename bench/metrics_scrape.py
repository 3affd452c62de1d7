"""Time of one ``GET /metrics`` scrape with a large run history, per backend.

Stores ``--runs`` runs over three lanes (all but one in 50 ended ``succeeded``, the rest
queued), refreshes the planner's statistics, then scrapes ``/metrics`` through the ASGI app
(``--scrapes`` times) and prints the median, 95th percentile and largest time in ms. A scrape
reads runs per (lane, status), the lane loads and the pending interrupts from the database.

    .venv/bin/python bench/metrics_scrape.py [--runs 100000] [--scrapes 50]
        [--backends sqlite,postgresql,mysql]
"""

import argparse
import asyncio
import statistics
import time

import httpx
from common import analyze, on_fresh_database, percentile, seed_tenant
from sqlalchemy import select, update

from moorline.api.app import create_app
from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.db.schema import runs
from moorline.settings import Settings
from moorline.types import RunStatus

LANES = ("workflow_sandbox", "workflow_team", "workflow_professional")
BATCH = 2000


async def measure(url: str, count: int, scrapes: int) -> list[float]:
    db = DatabaseManager(Settings(database_url=url))
    await upgrade(db)
    await db.initialize()
    tenant = await seed_tenant(db)
    repo = RunsRepo(db)
    for start in range(0, count, BATCH):
        await repo.submit_many(
            [
                NewRun(tenant_id=tenant, workflow="echo", input={}, lane=LANES[n % len(LANES)])
                for n in range(start, min(count, start + BATCH))
            ]
        )
    ids = await _ids(db)
    ended = [run_id for index, run_id in enumerate(ids) if index % 50]
    for start in range(0, len(ended), BATCH):
        async with db.transaction() as conn:
            await conn.execute(
                update(runs)
                .where(runs.c.id.in_(ended[start : start + BATCH]))
                .values(status=RunStatus.SUCCEEDED.value)
            )
    await analyze(db)
    app = create_app(Settings(database_url=url), db)
    timings: list[float] = []
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
        for _ in range(scrapes):
            started = time.perf_counter()
            response = await client.get("/metrics")
            timings.append((time.perf_counter() - started) * 1000)
            assert response.status_code == 200, response.text
    await db.dispose()
    return timings


async def _ids(db: DatabaseManager) -> list[str]:
    async with db.connect() as conn:
        return list((await conn.execute(select(runs.c.id))).scalars())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--scrapes", type=int, default=50)
    parser.add_argument("--backends", default="sqlite")
    args = parser.parse_args()
    for backend in args.backends.split(","):
        timings = asyncio.run(
            on_fresh_database(backend, lambda url: measure(url, args.runs, args.scrapes))
        )
        print(
            f"{backend:10} {args.runs} runs: /metrics median {statistics.median(timings):.1f} ms, "
            f"p95 {percentile(timings, 0.95):.1f} ms, max {max(timings):.1f} ms"
        )


if __name__ == "__main__":
    main()
