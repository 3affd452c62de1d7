"""CPU per claimed run, with and without the served-workflows filter (issue 15, item 1).

The drain figure of ``moorline bench`` moves with whatever else the machine runs; the CPU this
process spends claiming (SQLite runs in this process, so its work counts too; a server's does
not) moves far less. Each round claims ``--runs`` queued no-op runs of four tenants in batches
of ``--batch`` on a fresh database, in turn without the filter (``plain``) and with it
(``filtered``: the worker serves ``noop`` and one other name, as ``moorline worker`` passes its
app's names):

    PYTHONPATH=. .venv/bin/python bench/claim_filter.py [--backend sqlite] [--runs 5000]
        [--rounds 5] [--drain]

Run against an older checkout it measures ``plain`` only (its claim takes no filter). Prints the
median CPU and wall seconds per mode, and claims per wall second. ``--drain`` measures instead
the CPU of ``moorline bench``'s drain (one worker, 10,000 no-op runs, SQLite in this process),
as that tree's worker claims. ``PYTHONPATH=.`` makes the checkout in the current directory the
one imported, whatever the virtualenv has installed.
"""

import argparse
import asyncio
import inspect
import statistics
import time
from typing import Any

from moorline.benchmarks import dispatch
from moorline.benchmarks.common import analyze, on_fresh_database, seed_tenant
from moorline.benchmarks.dispatch import LANE, new_run
from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.db.repos.queue import QueueRepo
from moorline.db.repos.runs import RunsRepo
from moorline.settings import Settings

TENANTS = 4
CAPS = {"bench": 1_000_000}


async def claim_all(url: str, runs: int, batch: int, filtered: bool) -> tuple[float, float]:
    """CPU and wall seconds to claim ``runs`` runs on a new database at ``url``."""
    db = DatabaseManager(Settings(database_url=url))
    await upgrade(db)
    await db.initialize()
    try:
        repo = RunsRepo(db)
        for _ in range(TENANTS):
            tenant = await seed_tenant(db)
            for offset in range(0, runs // TENANTS, 1000):
                count = min(1000, runs // TENANTS - offset)
                await repo.submit_many([new_run(tenant, LANE) for _ in range(count)])
        await analyze(db)
        queue = QueueRepo(db)
        extra: dict[str, Any] = {"workflows": ["noop", "other"]} if filtered else {}
        cpu, wall, claimed = time.process_time(), time.perf_counter(), 0
        while claimed < runs // TENANTS * TENANTS:
            batch_claims = await queue.claim_batch(
                LANE, "bench", limit=batch, lease_ttl_s=90.0, tenant_caps=CAPS, **extra
            )
            claimed += len(batch_claims)
        return time.process_time() - cpu, time.perf_counter() - wall
    finally:
        await db.dispose()


async def drain_cpu(url: str) -> tuple[float, float]:
    """CPU seconds and runs/s of one drain of 10,000 runs at ``url``."""
    db = await dispatch.on_fresh_manager(url)
    try:
        tenant = await seed_tenant(db)
        cpu = time.process_time()
        rate = await dispatch.drain_rate(db, tenant, 10_000, 20)
        return time.process_time() - cpu, rate
    finally:
        await db.dispose()


async def drains(backend: str, rounds: int) -> None:
    measured = [await on_fresh_database(backend, drain_cpu) for _ in range(rounds)]
    cpu = statistics.median(c for c, _ in measured)
    rate = statistics.median(r for _, r in measured)
    print(
        f"{backend} drain: CPU {cpu:.2f} s per 10,000 runs, {rate:,.0f} runs/s; "
        f"CPU per round {[round(c, 2) for c, _ in measured]}"
    )


async def main(backend: str, runs: int, batch: int, rounds: int) -> None:
    modes = ["plain"]
    if "workflows" in inspect.signature(QueueRepo.claim).parameters:
        modes.append("filtered")
    results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    for _ in range(rounds):
        for mode in modes:
            filtered = mode == "filtered"

            async def work(url: str, filtered: bool = filtered) -> tuple[float, float]:
                return await claim_all(url, runs, batch, filtered)

            results[mode].append(await on_fresh_database(backend, work))
    for mode, measured in results.items():
        cpu = statistics.median(c for c, _ in measured)
        wall = statistics.median(w for _, w in measured)
        print(
            f"{backend} {mode}: CPU {cpu:.3f} s, wall {wall:.3f} s for {runs} claims "
            f"({runs / wall:,.0f}/s); CPU per round {[round(c, 3) for c, _ in measured]}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="sqlite", choices=["sqlite", "postgresql", "mysql"])
    parser.add_argument("--runs", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--drain", action="store_true")
    args = parser.parse_args()
    if args.drain:
        asyncio.run(drains(args.backend, args.rounds))
    else:
        asyncio.run(main(args.backend, args.runs, args.batch, args.rounds))
