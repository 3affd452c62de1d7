"""What LLM governance adds to a model call (issue 18): the limiter's latency, the accounting.

``measure()`` (the provider limiter): what a governed call spends in the limiter when capacity
is there (the usual case): :meth:`ProviderLimiter.acquire` before the call and
:meth:`ProviderLimiter.settle` after it (the real usage differing from the estimate, so settle
writes), one call after another, on the in-memory backend and on Redis (a fresh key prefix,
deleted afterwards), beside a Redis PING from the same process (the floor of any round trip on
this machine right now). Target (issue 18): p50 <= 0.5 ms on Redis.

``accounting_overhead()``: the cost of counting a call. One run, through the real runner on a
claimed run (in-memory store), makes ``--steps`` checkpointed steps that call no model, then as
many that each report one call (``ctx.record_usage``, as a model of ``moorline.llm`` reports):
the step's usage is summed, priced and written in its checkpoint's transaction with the run's
counters and the tenant day's ``llm_usage`` row. The difference of the two per-step figures
(wall and process CPU) is the accounting's cost per call; a real call's own latency (hundreds of
milliseconds) is not in either.

    .venv/bin/python bench/llm_governance.py [--calls 5000] [--redis redis://127.0.0.1:6379/0]
        [--backends sqlite,postgresql] [--steps 1000] [--warmup 50] [--only limiter|accounting]

Figures move with whatever else the machine runs: compare the lines of one run.
"""

import argparse
import asyncio
import statistics
import time
import uuid

from redis.asyncio import Redis

from moorline.benchmarks.common import on_fresh_database, seed_tenant
from moorline.benchmarks.engine import CAPS, LANE, with_manager, with_store
from moorline.db.manager import DatabaseManager
from moorline.db.repos.queue import QueueRepo
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.engine.runner import WorkflowRunner
from moorline.llm.limiter import (
    LimiterBackend,
    MemoryLimiter,
    ModelLimits,
    ProviderLimiter,
    RedisLimiter,
)
from moorline.runtime.base import RuntimeStore
from moorline.runtime.keys import RedisKeys
from moorline.settings import Settings
from moorline.types import JSONValue

# Far above what the loop can ask for: the figures are the limiter's cost, never a wait.
ROOMY = ModelLimits(rpm=10_000_000, tpm=10_000_000_000)


def p50_p99(samples: list[float]) -> str:
    return (
        f"p50 {statistics.median(samples):.3f} ms  "
        f"p99 {statistics.quantiles(samples, n=100)[98]:.3f} ms"
    )


async def limiter_latency(backend: LimiterBackend, calls: int) -> dict[str, list[float]]:
    """Per call, in ms: acquire, settle and both, uncontended, on ``backend``."""
    limiter = ProviderLimiter(backend)
    found: dict[str, list[float]] = {"acquire": [], "settle": [], "call": []}
    for index in range(calls + calls // 10):
        started = time.perf_counter()
        await limiter.acquire("bench-model", ROOMY, tenant=f"t{index % 4}", weight=10, tokens=600)
        acquired = time.perf_counter()
        await limiter.settle("bench-model", reserved=600, used=420)
        settled = time.perf_counter()
        if index >= calls // 10:  # the first tenth warms up (connections, script loads)
            found["acquire"].append((acquired - started) * 1000)
            found["settle"].append((settled - acquired) * 1000)
            found["call"].append((settled - started) * 1000)
    return found


async def ping_latency(redis_url: str, calls: int) -> list[float]:
    """Per PING, in ms: the floor of any Redis round trip from this process, right now."""
    client = Redis.from_url(redis_url, decode_responses=True)
    samples = []
    try:
        for _ in range(calls):
            started = time.perf_counter()
            await client.ping()
            samples.append((time.perf_counter() - started) * 1000)
    finally:
        await client.aclose()
    return samples


async def measure(calls: int, redis_url: str) -> None:
    for kind, samples in (await limiter_latency(MemoryLimiter(), calls)).items():
        print(f"memory  {kind:8} {p50_p99(samples)}")
    prefix = f"bench_{uuid.uuid4().hex[:8]}"
    backend = RedisLimiter(
        Redis.from_url(redis_url, decode_responses=True), RedisKeys(prefix).limiter
    )
    try:
        on_redis = await limiter_latency(backend, calls)
    finally:
        await backend.close()
        cleanup = Redis.from_url(redis_url, decode_responses=True)
        keys = [key async for key in cleanup.scan_iter(match=f"{prefix}:*")]
        if keys:
            await cleanup.delete(*keys)
        await cleanup.aclose()
    for kind, samples in on_redis.items():
        print(f"redis   {kind:8} {p50_p99(samples)}")
    print(f"redis   PING     {p50_p99(await ping_latency(redis_url, calls))}  (the floor)")
    print(f"({calls} calls each; acquire is the wait before a call, settle the write after it)")


app = Moorline(Settings())


@app.workflow("accounting")
async def accounting(ctx: Context, count: int, warmup: int) -> JSONValue:
    """``count`` steps without a model call, then ``count`` with one; ms per step of each."""

    def plain() -> None:
        return None

    def counted() -> None:
        ctx.record_usage("bench-model", 1200, 300, cached_tokens=400)

    figures: dict[str, JSONValue] = {}
    for name, fn in (("plain", plain), ("counted", counted)):
        for index in range(warmup):
            await ctx.step(f"{name}:warm:{index}", fn)
        started, cpu = time.perf_counter(), time.process_time()
        for index in range(count):
            await ctx.step(f"{name}:{index}", fn)
        figures[f"{name}_wall_ms"] = (time.perf_counter() - started) * 1000 / count
        figures[f"{name}_cpu_ms"] = (time.process_time() - cpu) * 1000 / count
    return figures


async def accounting_round(url: str, steps: int, warmup: int) -> dict[str, float]:
    """One run of :func:`accounting` on the empty database at ``url``."""

    async def work(db: DatabaseManager) -> JSONValue:
        async def run(store: RuntimeStore) -> JSONValue:
            runner = WorkflowRunner(app, db=db, store=store, settings=Settings())
            tenant = await seed_tenant(db)
            new = NewRun(
                tenant_id=tenant,
                workflow="accounting",
                input={"count": steps, "warmup": warmup},
                lane=LANE,
            )
            await RunsRepo(db).submit_many([new])
            [claim] = await QueueRepo(db).claim_batch(
                LANE, "bench", limit=1, lease_ttl_s=600.0, tenant_caps=CAPS
            )
            return await runner.run(claim)

        return await with_store("memory", run)

    found = await with_manager(url, work)
    assert isinstance(found, dict)
    return {name: float(value) for name, value in found.items() if isinstance(value, int | float)}


def accounting_overhead(backends: list[str], steps: int, warmup: int) -> None:
    """Print, per backend, a step's cost without and with one counted model call."""
    print("accounting overhead per model call (steps through the real runner)")
    for backend in backends:
        figures = asyncio.run(
            on_fresh_database(backend, lambda url: accounting_round(url, steps, warmup))
        )
        wall = figures["counted_wall_ms"] - figures["plain_wall_ms"]
        cpu = figures["counted_cpu_ms"] - figures["plain_cpu_ms"]
        print(
            f"  {backend:<11} step without a call {figures['plain_wall_ms']:.3f} ms "
            f"(CPU {figures['plain_cpu_ms']:.3f}), with one {figures['counted_wall_ms']:.3f} ms "
            f"(CPU {figures['counted_cpu_ms']:.3f}): accounting +{wall:.3f} ms wall, "
            f"+{cpu:.3f} ms CPU per call"
        )


def main() -> None:
    """Parse the options and print every figure this file measures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--backends", default="sqlite")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--only", choices=["limiter", "accounting"], default=None)
    args = parser.parse_args()
    if args.only != "accounting":
        asyncio.run(measure(args.calls, args.redis))
    if args.only != "limiter":
        accounting_overhead(args.backends.split(","), args.steps, args.warmup)


if __name__ == "__main__":
    main()
