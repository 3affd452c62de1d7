"""A worker's resident memory over many runs, with the Redis (or in-memory) runtime store.

One in-process Worker on a fresh PostgreSQL database runs ``--runs`` runs of a workflow with
three checkpointed steps (``--step-s`` each, so that the run lives past the runner's cancel
watcher delay and waits on the store, as the soak's runs do). Every ``--every`` finished runs
it prints the process's RSS and what might hold memory: open file descriptors, asyncio tasks,
Python objects the garbage collector tracks, the Redis command pool's connections, and the
store's Pub/Sub bookkeeping (channels in the hub and in redis-py's ``PubSub``).

A leak shows as RSS still climbing over the last thousands of runs (the first ones warm
caches and pools up); the figures beside it say where. Issue 7's soak allows 5 % growth after
warm-up; the last line prints the growth from the first report after ``--warmup`` runs.

    .venv/bin/python bench/memory.py [--runs 10000] [--every 1000] [--store redis|memory]
        [--slots 32] [--step-s 0.04] [--redis redis://127.0.0.1:6379/0] [--no-pin]

Like ``moorline worker`` it first pins glibc's mmap threshold
(:func:`moorline.worker.process.pin_mmap_threshold`); ``--no-pin`` leaves it dynamic, as
before that fix: ``malloc_free`` (heap memory glibc keeps free) then climbs with the RSS while
``malloc_used`` and the Python objects stay flat.

It creates its own database (``moorline_mem_*``, dropped at the end) and Redis key prefix
(every key under it deleted at the end).
"""

import argparse
import asyncio
import ctypes
import gc
import os
import sys
import tempfile
import time
import uuid
from collections import Counter
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from sqlalchemy.engine import make_url

from moorline.benchmarks.common import ADMIN, admin_sql, seed_tenant
from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.dispatch.retry import RetryPolicy
from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.engine.runner import WorkflowRunner
from moorline.runtime.base import RuntimeStore
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.runtime.redis import RedisRuntimeStore
from moorline.settings import Settings
from moorline.types import TenantId
from moorline.worker.process import pin_mmap_threshold
from moorline.worker.worker import Worker

LANE = "memory"

app = Moorline()


async def work(index: int, seconds: float) -> int:
    """A step's stand-in work (an LLM call): a short wait."""
    await asyncio.sleep(seconds)
    return index


@app.workflow("three_steps")
async def three_steps(ctx: Context, step_s: float) -> int:
    """Three checkpointed steps, as the soak's workflow."""
    total = 0
    for index in range(3):
        total += int(await ctx.step(f"s{index}", work, index, step_s))  # type: ignore[arg-type]
    return total


async def no_caps() -> dict[str, int]:
    """No tenant concurrency cap."""
    return {"bench": 1_000_000}


def proc_status(field: str) -> int:
    """A number from this process's ``/proc/<pid>/status`` (``VmRSS`` in KiB, ``Threads``)."""
    with open(f"/proc/{os.getpid()}/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss_kib() -> int:
    """This process's resident set size (KiB)."""
    return proc_status("VmRSS")


CONNECTS = Counter[str]()
"""Redis connections established (handshakes), counted by wrapping redis-py's ``on_connect``."""


def count_connects() -> None:
    """Count every Redis connection set up from now on (a diagnostic: churn shows here)."""
    original = Connection._connect

    async def _connect(self: Connection) -> None:
        CONNECTS["redis"] += 1
        await original(self)  # type: ignore[no-untyped-call]

    Connection._connect = _connect  # type: ignore[method-assign]


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def malloc_figures() -> dict[str, float]:
    """glibc's heap (MiB): in use (``uordblks``), free but kept (``fordblks``), mmapped."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return {}
    info = libc.mallinfo2()
    mib = 1024 * 1024
    return {
        "malloc_used": info.uordblks / mib,
        "malloc_free": info.fordblks / mib,
        "mmapped": info.hblkhd / mib,
    }


def pymalloc_arenas() -> int:
    """pymalloc arenas allocated now, read from ``sys._debugmallocstats`` (written to fd 2)."""
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        try:
            sys.stderr.flush()
            os.dup2(sink.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        sink.seek(0)
        for line in sink.read().decode().splitlines():
            if line.startswith("# arenas allocated current"):
                return int(line.split("=")[1].replace(",", ""))
    return -1


def probe(store: RuntimeStore) -> dict[str, Any]:
    """What might hold memory now, beside the RSS."""
    figures: dict[str, Any] = {
        "rss_mib": rss_kib() / 1024,
        "fds": len(os.listdir(f"/proc/{os.getpid()}/fd")),
        "threads": proc_status("Threads"),
        "tasks": len(asyncio.all_tasks()),
        "gc_objects": len(gc.get_objects()),
        "arenas": pymalloc_arenas(),
        **malloc_figures(),
    }
    if isinstance(store, RedisRuntimeStore) and isinstance(store.client, Redis):
        pool: Any = store.client.connection_pool  # one server: this bench's only topology
        figures["pool_free"] = len(pool._available_connections)
        figures["pool_used"] = len(pool._in_use_connections)
        figures["connects"] = CONNECTS["redis"]
        link = store._hub._link
        figures["hub_channels"] = 0 if link is None else len(link.channels)
        if link is not None:
            pubsub = link.pubsub
            figures["ps_channels"] = len(pubsub.channels)
            figures["ps_pending_unsub"] = len(pubsub.pending_unsubscribe_channels)
    return figures


def type_histogram() -> Counter[str]:
    """Objects the garbage collector tracks, by type name."""
    return Counter(type(obj).__name__ for obj in gc.get_objects())


async def fill(runs: RunsRepo, tenant: TenantId, count: int, step_s: float) -> None:
    """Submit ``count`` runs in batches."""
    for offset in range(0, count, 500):
        batch = [
            NewRun(
                tenant_id=tenant,
                workflow="three_steps",
                input={"step_s": step_s},
                lane=LANE,
            )
            for _ in range(min(500, count - offset))
        ]
        await runs.submit_many(batch)


async def measure(url: str, args: argparse.Namespace) -> None:
    """Run the runs on the database at ``url`` and print the figures."""
    db = DatabaseManager(Settings(database_url=url))
    await upgrade(db)
    await db.initialize()
    prefix = f"moorline_mem_{uuid.uuid4().hex[:8]}"
    store: RuntimeStore
    if args.store == "redis":
        store = RedisRuntimeStore(args.redis, prefix=prefix, client_name=prefix)
    else:
        store = InMemoryRuntimeStore()
    try:
        tenant = await seed_tenant(db)
        runs = RunsRepo(db)
        settings = Settings()
        worker = Worker(
            db,
            WorkflowRunner(app, db=db, store=store, settings=settings),
            lanes={LANE: args.slots},
            lease_ttl_s=settings.lease_ttl,
            tenant_caps=no_caps,
            retry_policy=RetryPolicy(base_s=0.0, cap_s=0.0),
            poll_interval_s=0.05,
        )
        # Submitted ahead in chunks, so the queue never runs dry and never grows huge.
        ahead = max(2000, args.every)
        submitted = min(args.runs, ahead)
        await fill(runs, tenant, submitted, args.step_s)
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        print(
            f"memory: {args.runs} runs of 3 steps x {args.step_s}s, {args.slots} slots, "
            f"store {args.store}, pid {os.getpid()}"
        )
        started = time.perf_counter()
        baseline: float | None = None
        histogram: Counter[str] | None = None
        reported = 0
        while reported < args.runs:
            if task.done():
                await task  # the worker died: raise its error
            if submitted < args.runs and submitted - worker.finished < ahead // 2:
                more = min(ahead, args.runs - submitted)
                await fill(runs, tenant, more, args.step_s)
                submitted += more
            if worker.finished - reported < args.every:
                await asyncio.sleep(0.05)
                continue
            reported += args.every
            gc.collect()
            figures = probe(store)
            if baseline is None and reported >= args.warmup:
                baseline = figures["rss_mib"]
                if args.types:
                    histogram = type_histogram()
            shown = "  ".join(
                f"{name} {value:.1f}" if isinstance(value, float) else f"{name} {value}"
                for name, value in figures.items()
            )
            elapsed = time.perf_counter() - started
            print(f"{reported:>7} runs {elapsed:7.1f}s  {shown}", flush=True)
        stop.set()
        await task
        final = rss_kib() / 1024
        if baseline is not None:
            print(
                f"RSS after warm-up ({args.warmup} runs) {baseline:.1f} MiB, at the end "
                f"{final:.1f} MiB: {final / baseline - 1:+.1%}"
            )
        if histogram is not None:
            grown = type_histogram()
            grown.subtract(histogram)
            print("gc-tracked objects grown since warm-up:", grown.most_common(15))
    finally:
        await store.close()
        await db.dispose()
        if args.store == "redis":
            cleaner = Redis.from_url(args.redis)
            try:
                async for key in cleaner.scan_iter(match=f"{prefix}*", count=1000):
                    await cleaner.delete(key)
            finally:
                await cleaner.aclose()


def main() -> None:
    """``python bench/memory.py``: RSS every ``--every`` runs."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=2000, help="runs before the baseline")
    parser.add_argument("--store", choices=("redis", "memory"), default="redis")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--step-s", type=float, default=0.04)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="leave glibc's mmap threshold dynamic (as before the fix; `moorline worker` pins it)",
    )
    parser.add_argument(
        "--types", action="store_true", help="print the gc object types grown since warm-up"
    )
    args = parser.parse_args()
    count_connects()
    if not args.no_pin:
        pin_mmap_threshold()  # as `moorline worker` does
    name = f"moorline_mem_{uuid.uuid4().hex[:10]}"
    admin_sql("postgresql", f"CREATE DATABASE {name}")
    try:
        url = make_url(ADMIN["postgresql"]).set(database=name)
        asyncio.run(measure(url.render_as_string(hide_password=False), args))
    finally:
        admin_sql("postgresql", f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


if __name__ == "__main__":
    main()
