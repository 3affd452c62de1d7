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
        [--step-backends sqlite,postgresql,mysql]

(or ``moorline bench --benchmarks step,resume,events`` for the report).
"""

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from moorline.benchmarks.common import on_fresh_database, seed_tenant, summary
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

T = TypeVar("T")

LANE = "bench"
CAPS = {"bench": 1_000_000}
REDIS_URL = "redis://127.0.0.1:6379/0"
STEP_BACKENDS = ("sqlite", "postgresql")
"""Databases of the step figure by default: those with a target (MariaDB on request)."""
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
    """A store of ``kind`` (Redis keys under ``prefix``)."""
    if kind == "redis":
        return RedisRuntimeStore(REDIS_URL, prefix=prefix)
    return InMemoryRuntimeStore()


async def claimed_run(db: DatabaseManager, tenant: TenantId, workflow: str, count: int) -> Claim:
    """A new run of ``workflow``, claimed as a worker would (so the runner can run it)."""
    await RunsRepo(db).submit_many(
        [NewRun(tenant_id=tenant, workflow=workflow, input={"count": count}, lane=LANE)]
    )
    [claim] = await QueueRepo(db).claim_batch(
        LANE, "bench", limit=1, lease_ttl_s=600.0, tenant_caps=CAPS
    )
    return claim


async def step_ms(db: DatabaseManager, store: RuntimeStore, count: int) -> float:
    """Mean duration of ``count`` checkpointed no-op steps of one run, in ms."""
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


@dataclass(frozen=True)
class EngineSizes:
    """How much work one round of each engine figure does."""

    steps: int = 2000
    interrupts: int = 50
    deltas: int = 20_000
    fanout_deltas: int = 5_000
    fanout_readers: int = 100


QUICK = EngineSizes(steps=100, interrupts=10, deltas=2_000, fanout_deltas=500)


async def with_manager(url: str, work: Callable[[DatabaseManager], Awaitable[T]]) -> T:
    """``work(db)`` on the database at ``url``, its schema created first."""
    db = DatabaseManager(Settings(database_url=url))
    await upgrade(db)
    await db.initialize()
    try:
        return await work(db)
    finally:
        await db.dispose()


async def with_store(kind: str, work: Callable[[RuntimeStore], Awaitable[T]]) -> T:
    """``work(store)`` on a new store of ``kind``, closed afterwards."""
    store = make_store(kind, f"bench_{time.monotonic_ns()}")
    try:
        return await work(store)
    finally:
        await store.close()


async def step_round(url: str, sizes: EngineSizes) -> dict[str, float]:
    """One round of the step overhead (in-memory store) on the empty database at ``url``."""

    async def work(db: DatabaseManager) -> dict[str, float]:
        return {"step": await with_store("memory", lambda store: step_ms(db, store, sizes.steps))}

    return await with_manager(url, work)


async def resume_round(url: str, store_kind: str, sizes: EngineSizes) -> dict[str, float]:
    """One round of both resume latencies through the ``store_kind`` store."""

    async def work(db: DatabaseManager) -> dict[str, float]:
        async def both(store: RuntimeStore) -> dict[str, float]:
            count = sizes.interrupts
            return {
                "resolve_resume": await resume_ms(db, store, count, from_signal=False),
                "signal_resume": await resume_ms(db, store, count, from_signal=True),
            }

        return await with_store(store_kind, both)

    return await with_manager(url, work)


async def events_round(url: str, store_kind: str, sizes: EngineSizes) -> dict[str, float]:
    """One round of the event stream rates (1 and 100 readers) through the ``store_kind`` store."""

    async def work(db: DatabaseManager) -> dict[str, float]:
        async def both(store: RuntimeStore) -> dict[str, float]:
            return {
                "events_x1": await events_per_s(db, store, sizes.deltas, 1),
                "events_x100": await events_per_s(
                    db, store, sizes.fanout_deltas, sizes.fanout_readers
                ),
            }

        return await with_store(store_kind, both)

    return await with_manager(url, work)


def rounds(
    count: int, backend: str, measure: Callable[[str], Awaitable[dict[str, float]]]
) -> dict[str, list[float]]:
    """``count`` rounds of ``measure``, each on a fresh database of ``backend``."""
    figures: dict[str, list[float]] = {}
    for _ in range(count):
        found = asyncio.run(on_fresh_database(backend, measure))
        for key, value in found.items():
            figures.setdefault(key, []).append(value)
    return figures


def main(argv: list[str] | None = None) -> None:
    """``python bench/engine.py``: the figures of every round, printed as a summary."""
    defaults = EngineSizes()
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="step,resume,events")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--interrupts", type=int, default=defaults.interrupts)
    parser.add_argument("--deltas", type=int, default=defaults.deltas)
    parser.add_argument("--fanout-deltas", type=int, default=defaults.fanout_deltas)
    parser.add_argument(
        "--step-backends",
        default=",".join(STEP_BACKENDS),
        help="databases of the step figure, of sqlite,postgresql,mysql",
    )
    args = parser.parse_args(argv)
    sizes = EngineSizes(args.steps, args.interrupts, args.deltas, args.fanout_deltas)
    only = set(args.only.split(","))
    print(f"engine: median of {args.rounds} rounds (min, max)")
    if "step" in only:
        for backend in args.step_backends.split(","):
            found = rounds(args.rounds, backend, partial(step_round, sizes=sizes))
            print(f"  no-op step   {backend:10} {summary(found['step'], ' ms')}")
            sys.stdout.flush()
    if "resume" in only:
        for kind, backend in PAIRINGS.items():
            label = f"{kind}+{backend}"
            found = rounds(
                args.rounds, backend, partial(resume_round, store_kind=kind, sizes=sizes)
            )
            print(f"  resolve→resume {label:17} {summary(found['resolve_resume'], ' ms')}")
            print(f"  signal→resume  {label:17} {summary(found['signal_resume'], ' ms')}")
            sys.stdout.flush()
    if "events" in only:
        for kind, backend in PAIRINGS.items():
            label = f"{kind}+{backend}"
            found = rounds(
                args.rounds, backend, partial(events_round, store_kind=kind, sizes=sizes)
            )
            print(f"  events x1    {label:17} {summary(found['events_x1'], ' /s')}")
            print(f"  events x100  {label:17} {summary(found['events_x100'], ' /s each')}")
            sys.stdout.flush()
