"""Do stored waiting runs slow dispatch? Claim latency and drain rate with 0 and N of them.

Issue 16 lets a worker hold thousands of parked runs: they stay rows of ``runs`` in their lane,
status ``waiting``, and every claim walks that lane. The figures (internal path: the
repositories and a :class:`~moorline.worker.worker.Worker` of this process, as
:mod:`~moorline.benchmarks.dispatch` measures them) are taken twice per round, each time on a
fresh database: once with no waiting run, once after ``N`` waiting rows were inserted in bulk
into the same lane, for the same tenant (setup, not measured: rows as a parked permission wait
leaves them, timer a day ahead). Then:

- **claim**: ``--claims`` runs are queued, then claimed one per transaction
  (:meth:`~moorline.db.repos.queue.QueueRepo.claim`, limit 1); p50 and p99 in ms;
- **drain**: ``--drain-runs`` no-op runs executed by one worker with ``--slots`` slots (what
  :func:`~moorline.benchmarks.dispatch.drain_rate` measures), runs/s;
- **drain CPU**: this process's CPU per drained run (the whole path on SQLite, the client
  side of the database on the servers): steadier than the rate on a loaded machine;
- **ratio**: drain rate with N waiting / without (target >= 0.9), drain CPU without / with,
  and claim p50 without / with (1 means no slowdown);
- **bytes per waiting row**: the bulk rows' storage (:mod:`~moorline.benchmarks.sizes`)
  divided by N: the run row and its index entries, without events or interrupt.
"""

import asyncio
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import insert

from moorline.benchmarks.common import analyze, percentile, seed_tenant
from moorline.benchmarks.dispatch import CAPS, LANE, make_worker, new_run, on_fresh_manager
from moorline.benchmarks.sizes import stored_bytes
from moorline.db.manager import DatabaseManager
from moorline.db.repos.queue import QueueRepo
from moorline.db.repos.runs import RunsRepo
from moorline.db.schema import runs
from moorline.db.types import utcnow
from moorline.types import RunStatus, TenantId

INSERT_BATCH = 1000
CLAIM_LANE = "bench_claim"
"""Lane of the claim figure's runs; the waiting rows are in both lanes (half in each)."""


@dataclass(frozen=True)
class LoadSizes:
    """How much work one round of the waiting-load figures does."""

    waiting_rows: int = 10_000
    claims: int = 500
    drain_runs: int = 2_000
    slots: int = 64


QUICK = LoadSizes(waiting_rows=1_000, claims=100, drain_runs=300, slots=32)


def waiting_row(tenant: TenantId, lane: str, now: Any) -> dict[str, Any]:
    """A run row as a permission wait parks it: ``waiting``, attempt 1, timer a day ahead."""
    run_id = str(uuid.uuid4())
    until = now + timedelta(days=1)
    return {
        "id": run_id,
        "tenant_id": tenant,
        "workflow": "noop",
        "status": RunStatus.WAITING.value,
        "lane": lane,
        "priority": 0,
        "attempt": 1,
        "max_attempts": 3,
        "not_before": now,
        "input_hash": "0" * 64,
        "input": {},
        "created_at": now,
        "updated_at": now,
        "started_at": now,
        "waiting_for": {
            "kind": "permission",
            "until": until.isoformat(),
            "interrupt_id": str(uuid.uuid4()),
        },
        "wake_at": until,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "resumes": 0,
    }


async def insert_waiting(db: DatabaseManager, tenant: TenantId, count: int) -> None:
    """``count`` waiting rows, half in the drain lane and half in the claim lane (setup)."""
    now = utcnow()
    for start in range(0, count, INSERT_BATCH):
        rows = [
            waiting_row(tenant, LANE if index % 2 else CLAIM_LANE, now)
            for index in range(start, min(count, start + INSERT_BATCH))
        ]
        async with db.transaction() as conn:
            await conn.execute(insert(runs), rows)


async def settle(db: DatabaseManager) -> None:
    """Do now the upkeep a bulk load leaves for later, so the figures after it do not pay it.

    Stored over hours, the waiting runs of a live system have long been checkpointed and
    vacuumed. Loaded a second ago, they are not: SQLite's WAL holds every page of them until a
    checkpoint (which then lands in the drain), PostgreSQL's autovacuum starts on the table
    during the drain, and the visibility map is empty, so index-only scans visit the heap.
    Done for both cases (with and without waiting rows), so each pays the same.
    """
    name = db.backend.name
    async with db.engine.connect() as conn:
        if name == "sqlite":
            await conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
        elif name == "postgresql":
            auto = await conn.execution_options(isolation_level="AUTOCOMMIT")
            await auto.exec_driver_sql("VACUUM ANALYZE")
            await auto.exec_driver_sql("CHECKPOINT")
    await analyze(db)


async def claim_latencies_ms(db: DatabaseManager, tenant: TenantId, count: int) -> list[float]:
    """Durations in ms of ``count`` single-run claims from a lane of ``count`` queued runs."""
    repo = RunsRepo(db)
    for start in range(0, count, INSERT_BATCH):
        batch = min(INSERT_BATCH, count - start)
        await repo.submit_many([new_run(tenant, CLAIM_LANE) for _ in range(batch)])
    await analyze(db)
    queue = QueueRepo(db)
    latencies = []
    for _ in range(count):
        began = time.perf_counter()
        batch_claimed = await queue.claim(
            CLAIM_LANE, "bench", limit=1, lease_ttl_s=600.0, tenant_caps=CAPS
        )
        latencies.append((time.perf_counter() - began) * 1000)
        assert len(batch_claimed.claims) == 1
    return latencies


@dataclass(frozen=True)
class Drained:
    """One drain: runs finished per second, and this process's CPU per run (ms)."""

    rate: float
    cpu_ms: float


async def drain(db: DatabaseManager, tenant: TenantId, count: int, slots: int) -> Drained:
    """``count`` pre-enqueued no-op runs executed by one worker of this process.

    As :func:`~moorline.benchmarks.dispatch.drain_rate`, with the worker's CPU beside the
    rate: on a machine other processes load, the rate swings with them; the CPU this process
    spends per run (all of it on SQLite, the client side on the servers) hardly does.
    """
    repo = RunsRepo(db)
    for start in range(0, count, INSERT_BATCH):
        await repo.submit_many(
            [new_run(tenant, LANE) for _ in range(min(INSERT_BATCH, count - start))]
        )
    await analyze(db)
    worker = make_worker(db, slots)
    stop = asyncio.Event()
    began, cpu_began = time.perf_counter(), time.process_time()
    task = asyncio.create_task(worker.run(stop))
    while worker.finished < count:  # noqa: ASYNC110 - a counter, read to within 5 ms
        await asyncio.sleep(0.005)
    elapsed, cpu_s = time.perf_counter() - began, time.process_time() - cpu_began
    stop.set()
    await task
    return Drained(rate=count / elapsed, cpu_ms=cpu_s * 1000 / count)


async def load_round(url: str, waiting: int, sizes: LoadSizes) -> dict[str, float]:
    """Claim and drain figures on the empty database at ``url`` after ``waiting`` rows."""
    db = await on_fresh_manager(url)
    try:
        tenant = await seed_tenant(db)
        found: dict[str, float] = {}
        if waiting:
            before = await stored_bytes(db)
            await insert_waiting(db, tenant, waiting)
            found["bytes_per_waiting_row"] = (await stored_bytes(db) - before) / waiting
        await settle(db)
        claims = await claim_latencies_ms(db, tenant, sizes.claims)
        found["claim_p50"] = percentile(claims, 0.5)
        found["claim_p99"] = percentile(claims, 0.99)
        drained = await drain(db, tenant, sizes.drain_runs, sizes.slots)
        found["drain"], found["drain_cpu"] = drained.rate, drained.cpu_ms
        return found
    finally:
        await db.dispose()
