"""One ``moorline worker`` at its defaults draining a backlog, against another tree (issue 19).

Public surfaces only: ``--runs`` runs are queued with ``app.submit_many`` (the shipped
``professional`` plan, its quota and rate limit raised out of the way, its tenant cap and lane
slots as they ship), then ``moorline worker`` (no options: the plans' slots) drains them. The
clock runs from the worker's "serving" line to the last run ``succeeded`` (the database is
read every 20 ms). Prints runs/s, the worker's CPU per run over the drain, and on PostgreSQL
the database sessions opened meanwhile (a pool that closes and reopens connections shows
here). ``--baseline DIR`` drains the same way with the worker from another source tree (``git
archive COMMIT | tar -x -C DIR``), in turn with this one, so both see the same machine. A
backend ``X+redis`` adds Redis (counters, wake-ups, the runtime store) under a fresh key prefix,
deleted after.

    PYTHONPATH=. .venv/bin/python bench/drain_worker.py [--runs 3000] [--rounds 2]
        [--workflows noop,one_step] [--backends postgresql,postgresql+redis]
        [--baseline DIR]
"""

import argparse
import asyncio
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "peers")]

from api import SOURCE_ROOT, WITH_REDIS, cpu_seconds, redis_beside, upgrade_with  # noqa: E402
from common import on_fresh_database, seed_tenant  # noqa: E402
from latency import start_worker, stop  # noqa: E402
from moorline_driver import PLAN, plans_yaml  # noqa: E402
from sqlalchemy import func, select, text  # noqa: E402

from moorline import Context, Moorline, Settings, Submission  # noqa: E402
from moorline.db.manager import DatabaseManager  # noqa: E402
from moorline.db.schema import runs  # noqa: E402
from moorline.plans import DEFAULT_PLANS  # noqa: E402

BATCH = 1000
POLL_S = 0.02


async def sessions(db: DatabaseManager) -> int | None:
    """Sessions the database has had so far (PostgreSQL's counter), else None."""
    if db.backend.name != "postgresql":
        return None
    async with db.connect() as conn:
        stmt = text("SELECT sessions FROM pg_stat_database WHERE datname = current_database()")
        return int(await conn.scalar(stmt) or 0)


async def succeeded(db: DatabaseManager) -> int:
    async with db.connect() as conn:
        stmt = select(func.count()).select_from(runs).where(runs.c.status == "succeeded")
        return int(await conn.scalar(stmt) or 0)


async def drain(backend: str, source: Path, workflow: str, count: int) -> str:
    """Queue ``count`` runs of ``workflow``, drain them with ``source``'s worker: one line."""

    async def on(url: str) -> str:
        with tempfile.TemporaryDirectory() as folder:
            plan = replace(DEFAULT_PLANS[PLAN], daily_quota=10**9, rate_limit="1000000/second")
            (Path(folder) / "plans.yaml").write_text(plans_yaml(plan))
            env = {
                "MOORLINE_DATABASE_URL": url,
                "MOORLINE_PLANS_FILE": str(Path(folder) / "plans.yaml"),
                "MOORLINE_APP": "moorline_app:app",
                **redis,
            }
            await upgrade_with(source, url)
            db = DatabaseManager(Settings(database_url=url))
            try:
                tenant = await seed_tenant(db, PLAN)
                for name in [name for name in os.environ if name.startswith("MOORLINE_")]:
                    del os.environ[name]  # a round before may have set Redis
                os.environ.update(env)  # the app's settings, as a user's app reads them
                app = Moorline()

                @app.workflow(workflow)
                async def queued(ctx: Context) -> None:
                    """Stands for the worker's workflow of the same name: only its name counts."""

                async with app:
                    for first in range(0, count, BATCH):
                        items = [Submission(workflow=workflow)] * min(BATCH, count - first)
                        await app.submit_many(items, tenant=tenant)
                worker_env = env | {
                    "PYTHONPATH": os.pathsep.join([str(source), str(HERE / "peers")])
                }
                worker = await start_worker(worker_env, source, Path(folder) / "worker.log")
                opened, cpu = await sessions(db), cpu_seconds(worker.pid)
                started = time.perf_counter()
                try:
                    while await succeeded(db) < count:  # noqa: ASYNC110 - the measurement
                        await asyncio.sleep(POLL_S)
                    wall = time.perf_counter() - started
                    cpu = cpu_seconds(worker.pid) - cpu
                finally:
                    await stop(worker)
                after = await sessions(db)
            finally:
                await db.dispose()
        new = "" if opened is None or after is None else f", {after - opened} sessions opened"
        return f"{count / wall:7.0f} runs/s, worker CPU {cpu * 1000 / count:.2f} ms/run{new}"

    async with redis_beside(backend, "bench-drain") as redis:
        return await on_fresh_database(backend.removesuffix(WITH_REDIS), on)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workflows", type=lambda s: s.split(","), default=["noop", "one_step"])
    parser.add_argument("--backends", type=lambda s: s.split(","), default=["postgresql"])
    parser.add_argument("--baseline", type=Path, default=None, help="Another source tree.")
    args = parser.parse_args()
    trees = [("this tree", SOURCE_ROOT)]
    if args.baseline is not None:
        trees.append(("baseline", args.baseline.resolve()))
    for round_ in range(1, args.rounds + 1):
        for backend in args.backends:
            for workflow in args.workflows:
                for name, source in trees:
                    line = await drain(backend, source, workflow, args.runs)
                    print(f"round {round_} {backend:16} {workflow:8} {name:9} {line}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
