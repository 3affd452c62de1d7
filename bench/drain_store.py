"""Drain on PostgreSQL with the in-memory and with the Redis runtime store (issue 19, item 5).

Does PostgreSQL + Redis drain slower than PostgreSQL alone? One worker of this process (8
slots, the default) drains ``--runs`` pre-enqueued no-op runs from a fresh PostgreSQL database,
with each store in turn; everything else is equal. ``redis-nowindow`` is an experiment, not a
configuration: the Redis store with its interactive-window changes (each run's open as it
starts and close as its workflow returns, all sent through ``change_windows``) made no-ops, to
measure what they cost. Prints runs/s and this process's CPU per run.

    PYTHONPATH=. .venv/bin/python bench/drain_store.py [--runs 3000] [--rounds 2]
        [--stores memory,redis,redis-nowindow]
"""

import argparse
import asyncio
import time
import uuid

from common import analyze, on_fresh_database, seed_tenant

from moorline.benchmarks import dispatch
from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.db.repos.runs import RunsRepo
from moorline.engine.runner import WorkflowRunner
from moorline.runtime.base import RuntimeStore
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.runtime.redis import RedisRuntimeStore
from moorline.settings import Settings
from moorline.worker.worker import Worker

REDIS_URL = "redis://127.0.0.1:6379/0"
SLOTS = 8


def make_store(kind: str, prefix: str) -> RuntimeStore:
    if kind == "memory":
        return InMemoryRuntimeStore()
    store = RedisRuntimeStore(REDIS_URL, prefix=prefix)
    if kind == "redis-nowindow":

        async def skipped(changes: list[object], *_args: object, **_kwargs: object) -> list[bool]:
            return [True] * len(changes)

        # The experiment: the window's round trips made no-ops on this instance only.
        store.change_windows = skipped  # type: ignore[method-assign,assignment]
    return store


async def drain(kind: str, runs: int) -> tuple[float, float]:
    """(runs/s, CPU ms per run) of one worker draining ``runs`` no-op runs."""

    async def on(url: str) -> tuple[float, float]:
        db = DatabaseManager(Settings(database_url=url))
        await upgrade(db)
        tenant = await seed_tenant(db)
        repo = RunsRepo(db)
        for offset in range(0, runs, 1000):
            count = min(1000, runs - offset)
            await repo.submit_many([dispatch.new_run(tenant, dispatch.LANE) for _ in range(count)])
        await analyze(db)
        store = make_store(kind, f"bench_{uuid.uuid4().hex[:10]}")
        runner = WorkflowRunner(dispatch.app, db=db, store=store, settings=Settings())
        worker = Worker(
            db,
            runner,
            lanes={dispatch.LANE: SLOTS},
            lease_ttl_s=90.0,
            tenant_caps=dispatch.caps,
            poll_interval_s=0.5,
            workflows=[workflow.name for workflow in dispatch.app],
        )
        stop = asyncio.Event()
        cpu, wall = time.process_time(), time.perf_counter()
        task = asyncio.create_task(worker.run(stop))
        while worker.finished < runs:  # noqa: ASYNC110 - a counter, read to within 5 ms
            await asyncio.sleep(0.005)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        stop.set()
        await task
        await store.close()
        await db.dispose()
        return runs / wall, cpu * 1000 / runs

    return await on_fresh_database("postgresql", on)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--stores",
        type=lambda text: text.split(","),
        default=["memory", "redis", "redis-nowindow"],
    )
    args = parser.parse_args()
    for round_ in range(args.rounds):
        for kind in args.stores:  # in turn, so each round sees the same moment of the machine
            rate, cpu_ms = await drain(kind, args.runs)
            print(
                f"round {round_ + 1}  {kind:15} {rate:6.0f} runs/s  CPU {cpu_ms:.2f} ms per run",
                flush=True,
            )


if __name__ == "__main__":
    asyncio.run(main())
