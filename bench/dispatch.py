"""Dispatch figures per backend: enqueue rate, drain rate, dispatch latency (issue 3).

Each figure is the median of ``--rounds`` rounds (min and max beside it), each round on a fresh
database:

- **enqueue**: ``--producers`` concurrent coroutines in one process submit ``--enqueue-runs``
  runs through the group-commit ``Submitter`` (as an API process under load does);
- **drain**: ``--drain-runs`` pre-enqueued no-op runs executed by one worker (this process)
  with ``--slots`` slots, from its start to the last outcome written; the planner statistics
  are refreshed after the load, as autovacuum would within a minute on a live system;
- **latency**: runs submitted at ``--rate`` per second while the worker waits on in-process
  wake-ups; latency is ``started_at - created_at``, both from the database clock.

    .venv/bin/python bench/dispatch.py [--rounds 3] [--backends sqlite,postgresql,mysql]
"""

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass

from common import BACKENDS, analyze, on_fresh_database, percentile, seed_tenant, summary
from sqlalchemy import select

from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.db.schema import runs
from moorline.dispatch.submit import Submitter
from moorline.dispatch.wakeups import LocalWakeups
from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.engine.runner import WorkflowRunner
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.settings import Settings
from moorline.types import TenantId
from moorline.worker.worker import Worker

LANE = "workflow"
CAPS = {"bench": 100_000}


async def caps() -> dict[str, int]:
    return CAPS


app = Moorline()


@app.workflow("noop")
async def noop(ctx: Context) -> None:
    """Does nothing: the benchmark measures Moorline, not the workflow."""


@dataclass
class Round:
    enqueue: float
    drain: float
    p50_ms: float
    p99_ms: float


def new_run(tenant: TenantId, lane: str) -> NewRun:
    return NewRun(tenant_id=tenant, workflow="noop", input={}, lane=lane)


async def enqueue_rate(db: DatabaseManager, tenant: TenantId, count: int, producers: int) -> float:
    submitter = Submitter(RunsRepo(db))
    remaining = count

    async def producer() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await submitter.submit(new_run(tenant, "enqueue-only"))

    started = time.perf_counter()
    await asyncio.gather(*(producer() for _ in range(producers)))
    elapsed = time.perf_counter() - started
    await submitter.close()
    return count / elapsed


def make_worker(db: DatabaseManager, slots: int, wakeups: LocalWakeups | None = None) -> Worker:
    runner = WorkflowRunner(app, db=db, store=InMemoryRuntimeStore(), settings=Settings())
    return Worker(
        db,
        runner,
        lanes={LANE: slots},
        lease_ttl_s=90.0,
        tenant_caps=caps,
        waiter=wakeups,
        poll_interval_s=0.5,
    )


async def drain_rate(db: DatabaseManager, tenant: TenantId, count: int, slots: int) -> float:
    runs_repo = RunsRepo(db)
    for offset in range(0, count, 1000):
        await runs_repo.submit_many(
            [new_run(tenant, LANE) for _ in range(min(1000, count - offset))]
        )
    await analyze(db)
    worker = make_worker(db, slots)
    stop = asyncio.Event()
    started = time.perf_counter()
    task = asyncio.create_task(worker.run(stop))
    while worker.finished < count:  # noqa: ASYNC110 - a counter, read to within 5 ms
        await asyncio.sleep(0.005)
    elapsed = time.perf_counter() - started
    stop.set()
    await task
    return count / elapsed


async def latencies_ms(
    db: DatabaseManager, tenant: TenantId, rate: float, seconds: float, slots: int
) -> list[float]:
    wakeups = LocalWakeups()
    await wakeups.start()
    background: set[asyncio.Future[None]] = set()
    submitter = Submitter(
        RunsRepo(db),
        on_enqueued=lambda lanes: background.add(asyncio.ensure_future(wakeups.notify(lanes))),
    )
    worker = make_worker(db, slots, wakeups)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    count = int(rate * seconds)
    ids = []
    began = time.perf_counter()
    for index in range(count):
        # Open-loop arrivals at a fixed rate, each submitted without waiting for the last.
        delay = began + index / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        ids.append(asyncio.ensure_future(submitter.submit(new_run(tenant, LANE))))
    stored = await asyncio.gather(*ids)
    while worker.finished < count:  # noqa: ASYNC110 - a counter, read to within 10 ms
        await asyncio.sleep(0.01)
    stop.set()
    await task
    await submitter.close()
    await wakeups.close()
    run_ids = [run.run_id for run in stored]
    async with db.connect() as conn:
        rows = await conn.execute(
            select(runs.c.created_at, runs.c.started_at).where(runs.c.id.in_(run_ids))
        )
        return [(row.started_at - row.created_at).total_seconds() * 1000 for row in rows]


async def one_round(url: str, args: argparse.Namespace) -> Round:
    db = DatabaseManager(Settings(database_url=url))
    await upgrade(db)
    await db.initialize()
    try:
        tenant = await seed_tenant(db)
        enqueue = await enqueue_rate(db, tenant, args.enqueue_runs, args.producers)
        drain_tenant = await seed_tenant(db)
        drain = await drain_rate(db, drain_tenant, args.drain_runs, args.slots)
        latency_tenant = await seed_tenant(db)
        lat = await latencies_ms(db, latency_tenant, args.rate, args.latency_seconds, args.slots)
        return Round(enqueue, drain, percentile(lat, 0.5), percentile(lat, 0.99))
    finally:
        await db.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--enqueue-runs", type=int, default=10_000)
    parser.add_argument("--producers", type=int, default=64)
    parser.add_argument("--drain-runs", type=int, default=10_000)
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--latency-seconds", type=float, default=5.0)
    args = parser.parse_args()
    print(
        f"dispatch: enqueue {args.enqueue_runs} runs by {args.producers} producers; drain "
        f"{args.drain_runs} no-op runs, one worker, {args.slots} slots; latency at "
        f"{args.rate:.0f} runs/s for {args.latency_seconds:.0f} s; median of {args.rounds}"
    )
    for backend in args.backends.split(","):
        rounds = [
            asyncio.run(on_fresh_database(backend, lambda url: one_round(url, args)))
            for _ in range(args.rounds)
        ]
        print(f"{backend}")
        print(f"  enqueue      {summary([r.enqueue for r in rounds], ' runs/s')}")
        print(f"  drain        {summary([r.drain for r in rounds], ' runs/s')}")
        print(f"  latency p50  {summary([r.p50_ms for r in rounds], ' ms')}")
        print(f"  latency p99  {summary([r.p99_ms for r in rounds], ' ms')}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
