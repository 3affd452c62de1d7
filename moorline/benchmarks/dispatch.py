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
        [--figures enqueue,drain,latency]

(or ``moorline bench --benchmarks enqueue,drain,latency`` for the report).
"""

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from functools import partial

from sqlalchemy import select

from moorline.benchmarks.common import (
    BACKENDS,
    analyze,
    on_fresh_database,
    percentile,
    seed_tenant,
    summary,
)
from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.db.schema import runs
from moorline.dispatch.submit import Submitter
from moorline.dispatch.wakeups import BackgroundNotifier, LocalWakeups
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
    """Every benchmark tenant may run as many runs at once as it likes."""
    return CAPS


app = Moorline()


@app.workflow("noop")
async def noop(ctx: Context) -> None:
    """Does nothing: the benchmark measures Moorline, not the workflow."""


def new_run(tenant: TenantId, lane: str) -> NewRun:
    """A no-op run of ``tenant`` on ``lane``."""
    return NewRun(tenant_id=tenant, workflow="noop", input={}, lane=lane)


async def enqueue_rate(db: DatabaseManager, tenant: TenantId, count: int, producers: int) -> float:
    """Runs stored per second by ``producers`` coroutines through one Submitter."""
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
    """A worker of this process on the benchmark lane, with an in-memory store."""
    runner = WorkflowRunner(app, db=db, store=InMemoryRuntimeStore(), settings=Settings())
    return Worker(
        db,
        runner,
        lanes={LANE: slots},
        lease_ttl_s=90.0,
        tenant_caps=caps,
        waiter=wakeups,
        poll_interval_s=0.5,
        # As ``moorline worker`` does: the claim filters on the app's workflows.
        workflows=[workflow.name for workflow in app],
    )


async def drain_rate(db: DatabaseManager, tenant: TenantId, count: int, slots: int) -> float:
    """Runs finished per second by one worker from ``count`` pre-enqueued no-op runs."""
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
    """Submit → start latencies (ms, database clock) of runs arriving at ``rate`` per second."""
    wakeups = LocalWakeups()
    await wakeups.start()
    # As ``moorline serve`` wires it: the submitter's hook wakes the worker's lane.
    notifier = BackgroundNotifier(wakeups)
    submitter = Submitter(RunsRepo(db), on_enqueued=notifier)
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
    await notifier.close()
    await wakeups.close()
    run_ids = [run.run_id for run in stored]
    async with db.connect() as conn:
        rows = await conn.execute(
            select(runs.c.created_at, runs.c.started_at).where(runs.c.id.in_(run_ids))
        )
        return [(row.started_at - row.created_at).total_seconds() * 1000 for row in rows]


@dataclass(frozen=True)
class DispatchSizes:
    """How much work one round of each dispatch figure does."""

    enqueue_runs: int = 10_000
    producers: int = 64
    drain_runs: int = 10_000
    slots: int = 256
    rate: float = 200.0
    latency_seconds: float = 5.0


QUICK = DispatchSizes(
    enqueue_runs=500, producers=16, drain_runs=500, slots=64, rate=100.0, latency_seconds=1.0
)


async def on_fresh_manager(url: str) -> DatabaseManager:
    """A manager of the database at ``url``, its schema created."""
    db = DatabaseManager(Settings(database_url=url))
    await upgrade(db)
    await db.initialize()
    return db


async def enqueue_round(url: str, sizes: DispatchSizes) -> dict[str, float]:
    """One round of the enqueue figure on the empty database at ``url``."""
    db = await on_fresh_manager(url)
    try:
        tenant = await seed_tenant(db)
        return {"enqueue": await enqueue_rate(db, tenant, sizes.enqueue_runs, sizes.producers)}
    finally:
        await db.dispose()


async def drain_round(url: str, sizes: DispatchSizes) -> dict[str, float]:
    """One round of the drain figure on the empty database at ``url``."""
    db = await on_fresh_manager(url)
    try:
        tenant = await seed_tenant(db)
        return {"drain": await drain_rate(db, tenant, sizes.drain_runs, sizes.slots)}
    finally:
        await db.dispose()


async def latency_round(url: str, sizes: DispatchSizes) -> dict[str, float]:
    """One round of the latency figures (p50 and p99) on the empty database at ``url``."""
    db = await on_fresh_manager(url)
    try:
        tenant = await seed_tenant(db)
        lat = await latencies_ms(db, tenant, sizes.rate, sizes.latency_seconds, sizes.slots)
        return {"latency_p50": percentile(lat, 0.5), "latency_p99": percentile(lat, 0.99)}
    finally:
        await db.dispose()


def main(argv: list[str] | None = None) -> None:
    """``python bench/dispatch.py``: the figures of every round, printed as a summary."""
    defaults = DispatchSizes()
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument(
        "--figures", default="enqueue,drain,latency", help="which figures to measure"
    )
    parser.add_argument("--enqueue-runs", type=int, default=defaults.enqueue_runs)
    parser.add_argument("--producers", type=int, default=defaults.producers)
    parser.add_argument("--drain-runs", type=int, default=defaults.drain_runs)
    parser.add_argument("--slots", type=int, default=defaults.slots)
    parser.add_argument("--rate", type=float, default=defaults.rate)
    parser.add_argument("--latency-seconds", type=float, default=defaults.latency_seconds)
    args = parser.parse_args(argv)
    sizes = DispatchSizes(
        enqueue_runs=args.enqueue_runs,
        producers=args.producers,
        drain_runs=args.drain_runs,
        slots=args.slots,
        rate=args.rate,
        latency_seconds=args.latency_seconds,
    )
    print(
        f"dispatch: enqueue {sizes.enqueue_runs} runs by {sizes.producers} producers; drain "
        f"{sizes.drain_runs} no-op runs, one worker, {sizes.slots} slots; latency at "
        f"{sizes.rate:.0f} runs/s for {sizes.latency_seconds:.0f} s; median of {args.rounds}"
    )
    rounds = {"enqueue": enqueue_round, "drain": drain_round, "latency": latency_round}
    chosen = args.figures.split(",")
    unknown = sorted(set(chosen) - set(rounds))
    if unknown:
        parser.error(f"unknown figures: {', '.join(unknown)}")
    units = {
        "enqueue": " runs/s",
        "drain": " runs/s",
        "latency_p50": " ms",
        "latency_p99": " ms",
    }
    for backend in args.backends.split(","):
        figures: dict[str, list[float]] = {}
        for figure in chosen:
            for _ in range(args.rounds):
                measure = rounds[figure]
                found = asyncio.run(on_fresh_database(backend, partial(measure, sizes=sizes)))
                for key, value in found.items():
                    figures.setdefault(key, []).append(value)
        print(f"{backend}")
        for key, values in figures.items():
            print(f"  {key.replace('_', ' '):12} {summary(values, units[key])}")
        sys.stdout.flush()
