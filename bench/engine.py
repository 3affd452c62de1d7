"""Engine figures (issue 4): checkpoint overhead, interrupt resume latency, event stream rate.

Each figure is the median of ``--rounds`` rounds (min and max beside it), each round on a fresh
database, with the runner called directly on a claimed run (no worker loop in between):

- **step**: overhead of one checkpointed no-op step (an ``async def`` that returns None), in
  ms: a workflow runs ``--steps`` steps and times them; the store is in-memory. Targets:
  SQLite ≤ 1 ms, PostgreSQL ≤ 2 ms.
- **resume**: an interrupt resolved as the API does (the decision stored in the database, then
  signalled through the store) until ``request_permission`` returns in the workflow, in ms;
  the median of ``--interrupts`` in a row. Printed twice: from the start of the resolve (its
  database commit included) and from the store signal. SQLite with the in-memory store,
  PostgreSQL with Redis. Targets: memory ≤ 5 ms, Redis ≤ 10 ms.
- **events**: ``delta`` events per second from one run's ``ctx.emit`` to its readers through
  :class:`~moorline.engine.streams.EventStream` (what the SSE route reads), with 1 and with
  100 readers; the rate of the slowest reader. Same pairings. Targets: ≥ 10,000/s to one
  reader, ≥ 1,000/s to each of 100.

    .venv/bin/python bench/engine.py [--rounds 3] [--only step,resume,events]
"""

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from common import on_fresh_database, seed_tenant, summary

from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.queue import Claim, QueueRepo
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.engine.runner import WorkflowRunner
from moorline.engine.streams import EventStreams
from moorline.runtime.base import RuntimeStore
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.runtime.redis import RedisRuntimeStore
from moorline.settings import Settings
from moorline.types import JSONObject, TenantId

LANE = "bench"
CAPS = {"bench": 1_000_000}
REDIS_URL = "redis://127.0.0.1:6379/0"
PAIRINGS = {"memory": "sqlite", "redis": "postgresql"}
"""Store → database of the resume and events figures: the embedded and the scaled-out setup."""

app = Moorline()
resumed: dict[int, asyncio.Event] = {}
resumed_at: dict[int, float] = {}


async def nothing() -> None:
    """The no-op step."""


@app.workflow("steps")
async def steps(ctx: Context, count: int) -> float:
    """``count`` checkpointed no-op steps; returns their mean duration in ms."""
    started = time.perf_counter()
    for index in range(count):
        await ctx.step(f"noop:{index}", nothing)
    return (time.perf_counter() - started) * 1000 / count


@app.workflow("asks")
async def asks(ctx: Context, count: int) -> None:
    """Asks for permission ``count`` times and notes when each answer arrives."""
    for index in range(count):
        await ctx.request_permission("act", {"index": index}, timeout=60)
        resumed_at[index] = time.perf_counter()
        resumed[index].set()


@app.workflow("streams")
async def streams(ctx: Context, count: int) -> None:
    """Emits ``count`` deltas as fast as it can."""
    for index in range(count):
        await ctx.emit("delta", {"text": "token", "index": index})


def make_store(kind: str, prefix: str) -> RuntimeStore:
    if kind == "redis":
        return RedisRuntimeStore(REDIS_URL, prefix=prefix)
    return InMemoryRuntimeStore()


async def claimed_run(db: DatabaseManager, tenant: TenantId, workflow: str, count: int) -> Claim:
    await RunsRepo(db).submit_many(
        [NewRun(tenant_id=tenant, workflow=workflow, input={"count": count}, lane=LANE)]
    )
    [claim] = await QueueRepo(db).claim_batch(
        LANE, "bench", limit=1, lease_ttl_s=600.0, tenant_caps=CAPS
    )
    return claim


async def step_ms(db: DatabaseManager, store: RuntimeStore, count: int) -> float:
    runner = WorkflowRunner(app, db=db, store=store, settings=Settings())
    claim = await claimed_run(db, await seed_tenant(db), "steps", count)
    output = await runner.run(claim)
    assert isinstance(output, float)
    return output


async def resume_ms(
    db: DatabaseManager, store: RuntimeStore, count: int, *, from_signal: bool
) -> float:
    """Median latency of ``count`` interrupts in a row, each resolved as the API does.

    Measured from the start of the resolve, or (``from_signal``) from the store signal.
    """
    runner = WorkflowRunner(app, db=db, store=store, settings=Settings())
    interrupts = InterruptsRepo(db)
    resumed.clear()
    resumed_at.clear()
    for index in range(count):
        resumed[index] = asyncio.Event()
    claim = await claimed_run(db, await seed_tenant(db), "asks", count)
    run_id = claim.fence.run_id
    task = asyncio.create_task(runner.run(claim))
    latencies = []
    for index in range(count):
        [interrupt] = await poll(lambda: interrupts.pending_for_run(run_id))
        interrupt_id = interrupt.interrupt_id
        # Wait until the workflow is parked in the store, as a person's click would find it.
        await poll(partial(store.get_interrupt, run_id, interrupt_id))
        began = time.perf_counter()
        await interrupts.resolve(run_id, interrupt_id, approved=True, reason="approved", data=None)
        if from_signal:
            began = time.perf_counter()
        decision: JSONObject = {"approved": True, "reason": "approved"}
        await store.resolve_interrupt(run_id, interrupt_id, decision)
        await resumed[index].wait()
        latencies.append((resumed_at[index] - began) * 1000)
    await task
    return statistics.median(latencies)


async def poll(check: Callable[[], Awaitable[Any]]) -> Any:
    """Poll until ``check`` returns something truthy (1 ms cadence; not part of any figure)."""
    deadline = time.monotonic() + 30
    while not (found := await check()):
        if time.monotonic() > deadline:
            raise TimeoutError("the workflow did not get there in 30 s")
        await asyncio.sleep(0.001)
    return found


async def events_per_s(db: DatabaseManager, store: RuntimeStore, count: int, readers: int) -> float:
    """Deltas per second to the slowest of ``readers`` streams of one run."""
    runner = WorkflowRunner(app, db=db, store=store, settings=Settings())
    tenant = await seed_tenant(db)
    claim = await claimed_run(db, tenant, "streams", count)
    run_id = claim.fence.run_id
    opened = EventStreams(db, store)
    readers_streams = [await opened.open(tenant, run_id) for _ in range(readers)]
    finished: list[float] = []

    async def read(stream: Any) -> None:
        seen = 0
        async for event in stream:
            if event.type == "delta":
                seen += 1
                if seen == count:
                    break
        finished.append(time.perf_counter())
        await stream.close()

    reading = [asyncio.create_task(read(stream)) for stream in readers_streams]
    began = time.perf_counter()
    await runner.run(claim)
    await asyncio.gather(*reading)
    return count / (max(finished) - began)


async def one_round(backend: str, work: Callable[[DatabaseManager], Awaitable[float]]) -> float:
    async def on(url: str) -> float:
        db = DatabaseManager(Settings(database_url=url))
        await upgrade(db)
        await db.initialize()
        try:
            return await work(db)
        finally:
            await db.dispose()

    return await on_fresh_database(backend, on)


def with_store(
    kind: str, measure: Callable[[DatabaseManager, RuntimeStore], Awaitable[float]]
) -> Callable[[DatabaseManager], Awaitable[float]]:
    async def work(db: DatabaseManager) -> float:
        store = make_store(kind, f"bench_{time.monotonic_ns()}")
        try:
            return await measure(db, store)
        finally:
            await store.close()

    return work


def rounds(args: argparse.Namespace, backend: str, work: Any) -> list[float]:
    return [asyncio.run(one_round(backend, work)) for _ in range(args.rounds)]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="step,resume,events")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--interrupts", type=int, default=50)
    parser.add_argument("--deltas", type=int, default=20_000)
    parser.add_argument("--fanout-deltas", type=int, default=5_000)
    args = parser.parse_args()
    only = set(args.only.split(","))
    print(f"engine: median of {args.rounds} rounds (min, max)")
    if "step" in only:
        for backend in ("sqlite", "postgresql"):
            work = with_store("memory", lambda db, s: step_ms(db, s, args.steps))
            print(f"  no-op step   {backend:10} {summary(rounds(args, backend, work), ' ms')}")
            sys.stdout.flush()
    if "resume" in only:
        for kind, backend in PAIRINGS.items():
            label = f"{kind}+{backend}"
            for signal_only, name in ((False, "resolve→resume"), (True, "signal→resume ")):
                work = with_store(
                    kind,
                    partial(resume_ms, count=args.interrupts, from_signal=signal_only),
                )
                print(f"  {name} {label:17} {summary(rounds(args, backend, work), ' ms')}")
                sys.stdout.flush()
    if "events" in only:
        for kind, backend in PAIRINGS.items():
            label = f"{kind}+{backend}"
            one = with_store(kind, lambda db, s: events_per_s(db, s, args.deltas, 1))
            many = with_store(kind, lambda db, s: events_per_s(db, s, args.fanout_deltas, 100))
            print(f"  events x1    {label:17} {summary(rounds(args, backend, one), ' /s')}")
            print(f"  events x100  {label:17} {summary(rounds(args, backend, many), ' /s each')}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
