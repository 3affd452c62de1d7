"""Retention beside the hot path: the drain and dispatch latency with and without cleanup.

On a fresh database per backend, stores ``--runs`` runs that ended 40 days ago (each with a
step and two events), then measures, in the same process and the same run of the script:

- **without cleanup**: the drain rate of ``--drain-runs`` pre-enqueued no-op runs (one worker,
  ``--slots`` slots) and the dispatch latency (``started_at - created_at``, database clock) of
  runs arriving at ``--rate`` per second for ``--latency-seconds``;
- **with cleanup**: the same two figures while the retention cleaner deletes the old runs
  beside them (batches of ``--batch``, ``--pause`` seconds between batches at least), in the
  same process, as the leader of a ``moorline serve`` or ``moorline worker`` process would.

``--rounds`` rounds of each, in turn (the machine's load changes; in turn it falls on both
sides). It prints the medians, their ratios (issue 20 asks drain >= 80 % and p99 <= 2x of the
figures without cleanup) and each round's pair, the runs the cleaner deleted meanwhile (it
must still have had work at the end, or a phase was partly without cleanup), and on SQLite the
file's size before and after, once ``--finish`` lets the cleaner end its work.

    .venv/bin/python bench/retention.py [--runs 50000] [--backends sqlite,postgresql]
        [--full]   # 1,000,000 runs (make bench-retention)
"""

import argparse
import asyncio
import os
import sqlite3
import statistics
import time
import uuid
from contextlib import closing
from datetime import timedelta
from typing import Any

from sqlalchemy import func, insert, select
from sqlalchemy.engine import make_url

from moorline.benchmarks.common import analyze, on_fresh_database, percentile, seed_tenant
from moorline.benchmarks.dispatch import drain_rate, latencies_ms, on_fresh_manager
from moorline.db.manager import DatabaseManager
from moorline.db.repos.queue import QueueRepo
from moorline.db.repos.retention import RetentionPolicy
from moorline.db.schema import events, runs, steps
from moorline.db.types import utcnow
from moorline.dispatch.leader import LeaderElector, new_holder_id
from moorline.dispatch.retention import LEADER_LEASE, RetentionCleaner
from moorline.types import RunStatus, TenantId

FULL_RUNS = 1_000_000
LOAD_CHUNK = 5000
POLICY = RetentionPolicy(default_days=30.0)


async def load_old_runs(db: DatabaseManager, tenant: TenantId, count: int) -> None:
    """``count`` runs that ended 40 days ago, each with a step and two events."""
    ended = utcnow() - timedelta(days=40)
    for offset in range(0, count, LOAD_CHUNK):
        ids = [str(uuid.uuid4()) for _ in range(min(LOAD_CHUNK, count - offset))]
        run_rows = [
            _old_run(run_id, tenant, ended + timedelta(microseconds=offset + n))
            for n, run_id in enumerate(ids)
        ]
        async with db.transaction() as conn:
            await conn.execute(insert(runs), run_rows)
            await conn.execute(
                insert(steps),
                [
                    {
                        "run_id": run_id,
                        "key": "llm",
                        "status": "succeeded",
                        "attempt": 1,
                        "function": "ask",
                        "call_hash": "0" * 64,
                        "output": {"text": "x" * 200},
                        "started_at": ended,
                        "finished_at": ended,
                        "seq": 1,
                    }
                    for run_id in ids
                ],
            )
            await conn.execute(
                insert(events),
                [
                    {
                        "run_id": run_id,
                        "seq": seq,
                        "type": "t",
                        "attempt": 1,
                        "data": {},
                        "created_at": ended,
                    }
                    for run_id in ids
                    for seq in (1, 2)
                ],
            )


def _old_run(run_id: str, tenant: TenantId, ended: Any) -> dict[str, Any]:
    return {
        "id": run_id,
        "tenant_id": tenant,
        "workflow": "noop",
        "status": RunStatus.SUCCEEDED.value,
        "lane": "workflow",
        "priority": 0,
        "attempt": 1,
        "max_attempts": 3,
        "not_before": ended,
        "input_hash": "0" * 64,
        "input": {"n": 1},
        "output": {"ok": True},
        "created_at": ended,
        "updated_at": ended,
        "started_at": ended,
        "finished_at": ended,
    }


async def old_runs_left(db: DatabaseManager) -> int:
    cutoff = utcnow() - timedelta(days=30)
    async with db.connect() as conn:
        stmt = select(func.count()).where(runs.c.finished_at < cutoff)
        return int((await conn.execute(stmt)).scalar_one())


async def figures(
    db: DatabaseManager, tenant: TenantId, args: argparse.Namespace
) -> dict[str, float]:
    drain = await drain_rate(db, tenant, args.drain_runs, args.slots)
    lat = await latencies_ms(db, tenant, args.rate, args.latency_seconds, args.slots)
    return {"drain": drain, "p50": percentile(lat, 0.5), "p99": percentile(lat, 0.99)}


def sqlite_size(db: DatabaseManager) -> int | None:
    """The SQLite file's bytes once the whole log is copied back; None for a server."""
    path = make_url(db.urls[0]).database
    if db.backend.name != "sqlite" or path is None:
        return None
    with closing(sqlite3.connect(path, isolation_level=None, timeout=10)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return os.path.getsize(path)


async def measure(url: str, args: argparse.Namespace) -> None:
    db = await on_fresh_manager(url)
    try:
        tenant = await seed_tenant(db)
        started = time.perf_counter()
        await load_old_runs(db, tenant, args.runs)
        await analyze(db)
        size_before = sqlite_size(db)
        print(f"  loaded {args.runs} old runs in {time.perf_counter() - started:.1f} s")
        without: list[dict[str, float]] = []
        beside: list[dict[str, float]] = []
        deleted, busy_s = 0, 0.0
        for _ in range(args.rounds):
            # In turn, so that a change in the machine's load falls on both sides.
            without.append(await figures(db, tenant, args))
            left_before = await old_runs_left(db)
            stop = asyncio.Event()
            task = asyncio.create_task(make_cleaner(db, args).run(stop))
            began = time.perf_counter()
            beside.append(await figures(db, tenant, args))
            busy_s += time.perf_counter() - began
            stop.set()
            await task
            deleted += left_before - await old_runs_left(db)
        left = await old_runs_left(db)
        report(without, beside)
        print(
            f"  cleanup    {deleted} runs deleted in {busy_s:.1f} s beside the drain "
            f"({deleted / busy_s:.0f} runs/s); {left} old runs still left at the end"
            + ("" if left else "  <- cleanup ended early: use more --runs")
        )
        if size_before is not None and args.finish:
            stop = asyncio.Event()
            await _finish(asyncio.create_task(make_cleaner(db, args).run(stop)), stop, db)
            size_after = sqlite_size(db)
            assert size_after is not None
            print(
                f"  sqlite     file {size_before / 2**20:.1f} MiB before, "
                f"{size_after / 2**20:.1f} MiB after the cleanup finished"
            )
    finally:
        await db.dispose()


def make_cleaner(db: DatabaseManager, args: argparse.Namespace) -> RetentionCleaner:
    """A cleaner that leads (its lease is free) and passes once an hour."""
    elector = LeaderElector(QueueRepo(db), name=LEADER_LEASE, holder=new_holder_id(), ttl_s=60.0)

    async def policy() -> RetentionPolicy:
        return POLICY

    return RetentionCleaner(
        db, elector, policy, interval_s=3600.0, batch=args.batch, pause_s=args.pause
    )


def report(without: list[dict[str, float]], beside: list[dict[str, float]]) -> None:
    """Medians of the rounds, their ratio, and every round's figures."""
    for key, unit in (("drain", "runs/s"), ("p50", "ms"), ("p99", "ms")):
        a = statistics.median(r[key] for r in without)
        b = statistics.median(r[key] for r in beside)
        rounds = ", ".join(
            f"{x[key]:.0f}/{y[key]:.0f}" for x, y in zip(without, beside, strict=True)
        )
        print(
            f"  {key:6} {a:8.1f} {unit} without, {b:8.1f} with cleanup: {b / a:5.0%} "
            f"(rounds without/with: {rounds})"
        )


async def _finish(task: "asyncio.Task[None]", stop: asyncio.Event, db: DatabaseManager) -> None:
    while await old_runs_left(db):  # noqa: ASYNC110 - a count, read once a second
        await asyncio.sleep(1.0)
    stop.set()
    await task


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=50_000, help="old finished runs stored")
    parser.add_argument("--full", action="store_true", help=f"{FULL_RUNS:,} old runs")
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--drain-runs", type=int, default=5000)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--latency-seconds", type=float, default=10.0)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--pause", type=float, default=0.2)
    parser.add_argument("--rounds", type=int, default=3, help="rounds without and with, in turn")
    parser.add_argument("--finish", action="store_true", help="let the cleanup end, then size")
    args = parser.parse_args()
    if args.full:
        args.runs = FULL_RUNS
    print(
        f"retention: {args.runs} old runs; drain {args.drain_runs} runs ({args.slots} slots), "
        f"latency at {args.rate:.0f} runs/s for {args.latency_seconds:.0f} s; cleaner batch "
        f"{args.batch}, pause {args.pause} s"
    )
    for backend in args.backends.split(","):
        print(backend, flush=True)
        asyncio.run(on_fresh_database(backend, lambda url: measure(url, args)))


if __name__ == "__main__":
    main()
