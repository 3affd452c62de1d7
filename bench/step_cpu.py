"""CPU per checkpointed no-op step, per thread, on one backend (issue 4).

The wall-clock step figure of ``bench/engine.py`` moves with whatever else the machine runs;
the CPU this process spends per step (from ``/proc/self/task/*/stat``, main thread and the
SQLite connection's thread apart) does far less. One run of ``--steps`` no-op ``async`` steps
(after ``--warmup`` more), through the real runner on a claimed run, the in-memory store:

    .venv/bin/python bench/step_cpu.py sqlite [--steps 2000] [--warmup 50]

Prints wall ms per step, process CPU ms per step, and CPU ms per step of each thread that used
any. Linux only.
"""

import argparse
import asyncio
import os
import threading
import time

from moorline.benchmarks.common import on_fresh_database, seed_tenant
from moorline.benchmarks.engine import CAPS, LANE, app, nothing, with_manager, with_store
from moorline.db.manager import DatabaseManager
from moorline.db.repos.queue import QueueRepo
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.engine.context import Context
from moorline.engine.runner import WorkflowRunner
from moorline.runtime.base import RuntimeStore
from moorline.settings import Settings
from moorline.types import JSONValue

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def thread_ticks() -> dict[str, int]:
    """CPU clock ticks (user + system) of each thread of this process, by thread id."""
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        ticks[tid] = int(fields[11]) + int(fields[12])
    return ticks


@app.workflow("cpu_steps")
async def cpu_steps(ctx: Context, count: int, warmup: int) -> JSONValue:
    """``warmup`` then ``count`` no-op steps; returns what the ``count`` steps cost."""
    for index in range(warmup):
        await ctx.step(f"warm:{index}", nothing)
    before, started, cpu = thread_ticks(), time.perf_counter(), time.process_time()
    for index in range(count):
        await ctx.step(f"noop:{index}", nothing)
    wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu
    after = thread_ticks()
    main = str(threading.get_native_id())
    threads = {
        ("main" if tid == main else f"thread {tid}"): (ticks - before.get(tid, 0))
        / TICKS_PER_S
        * 1000
        / count
        for tid, ticks in after.items()
        if ticks != before.get(tid, 0)
    }
    return {"wall_ms": wall_s * 1000 / count, "cpu_ms": cpu_s * 1000 / count, **threads}


async def measure(url: str, steps: int, warmup: int) -> JSONValue:
    """The figures of one run on the empty database at ``url``."""

    async def work(db: DatabaseManager) -> JSONValue:
        async def run(store: RuntimeStore) -> JSONValue:
            runner = WorkflowRunner(app, db=db, store=store, settings=Settings())
            tenant = await seed_tenant(db)
            await RunsRepo(db).submit_many(
                [
                    NewRun(
                        tenant_id=tenant,
                        workflow="cpu_steps",
                        input={"count": steps, "warmup": warmup},
                        lane=LANE,
                    )
                ]
            )
            [claim] = await QueueRepo(db).claim_batch(
                LANE, "bench", limit=1, lease_ttl_s=600.0, tenant_caps=CAPS
            )
            return await runner.run(claim)

        return await with_store("memory", run)

    return await with_manager(url, work)


def main() -> None:
    """Parse the options, measure, print."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("backend", help="sqlite, postgresql or mysql")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=50)
    args = parser.parse_args()
    found = asyncio.run(
        on_fresh_database(args.backend, lambda url: measure(url, args.steps, args.warmup))
    )
    assert isinstance(found, dict)
    print(
        f"{args.backend}: wall {found.pop('wall_ms'):.3f} ms/step, "
        f"process CPU {found.pop('cpu_ms'):.3f} ms/step"
    )
    for thread, ms in found.items():
        print(f"    {thread}: {ms:.3f} ms/step")


if __name__ == "__main__":
    main()
