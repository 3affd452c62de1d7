"""Waiting runs cost no capacity: a capped tenant and a small worker with many parked runs.

Issue 16's scale check, with a real in-process :class:`Worker` on every backend (SQLite with
the in-memory RuntimeStore, the servers with Redis):

* a sandbox-like tenant (cap 2) with 50 runs waiting for approval still runs 2 other runs at
  once;
* a worker with 4 slots holds N runs waiting for approval (1,000 at full size, 200 in CI) and
  still executes new runs, about as fast as with none waiting; approving them all lets every
  one finish exactly once.
"""

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager

import pytest
from sqlalchemy import func, select

from moorline.db.manager import DatabaseManager
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.db.schema import events, runs
from moorline.dispatch.retry import RetryPolicy
from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.engine.runner import WorkflowRunner
from moorline.runtime.base import RuntimeStore
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.settings import Settings
from moorline.types import RunId, RunStatus, TenantId
from moorline.worker.worker import Worker
from tests.contract.queue_helpers import Tenants, no_caps, unique
from tests.helpers import FULL_SIZE, wait_for
from tests.runtime.conftest import make_redis_store

logger = logging.getLogger(__name__)

CAPPED_PLAN = "sandbox_like"
CAP = 2
CAPPED_WAITING = 50
WAITING_RUNS = 1_000 if FULL_SIZE else 200
SLOTS = 4
NEW_RUNS = 40
"""No-op runs timed with none and with ``WAITING_RUNS`` runs waiting."""
SLOWER_AT_MOST = 3.0
"""How much slower the new runs may drain with the waiting runs stored (a shared CI machine
times noisily; the bench measures the ratio, this only catches waiting runs that block)."""
SETTLE_S = 120.0 if FULL_SIZE else 60.0


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


@pytest.fixture
async def store(backend: str, redis_prefix: str) -> AsyncIterator[RuntimeStore]:
    """SQLite with the in-memory store; the servers with Redis, as they are deployed."""
    made: RuntimeStore = (
        InMemoryRuntimeStore() if backend == "sqlite" else make_redis_store(redis_prefix)
    )
    try:
        yield made
    finally:
        await made.close()


class Scale:
    """One lane, the workflows, and a count of every step call (side effects, in memory)."""

    def __init__(self, db: DatabaseManager, store: RuntimeStore) -> None:
        self.db = db
        self.lane = unique("lane")
        self.calls: Counter[tuple[str, str]] = Counter()
        self.running = 0
        self.most_running = 0
        self.both_in = asyncio.Event()
        settings = Settings(park_after=0.0, lease_ttl=30.0)
        self.app = Moorline(settings)
        self.runner = WorkflowRunner(self.app, db=db, store=store, settings=settings)
        self._register()

    def _register(self) -> None:
        def effect(run_id: str, key: str) -> str:
            self.calls[(run_id, key)] += 1
            return key

        @self.app.workflow("approve", max_attempts=3)
        async def approve(ctx: Context) -> bool:
            await ctx.step("before", effect, ctx.run_id, "before")
            decision = await ctx.request_permission("go", {}, timeout=600)
            await ctx.step("after", effect, ctx.run_id, "after")
            return decision.approved

        @self.app.workflow("together", max_attempts=1)
        async def together(ctx: Context) -> int:
            """Ends once a second run of it is running at the same time (or fails in 10 s)."""
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            try:
                if self.running >= CAP:
                    self.both_in.set()
                async with asyncio.timeout(10):
                    await self.both_in.wait()
            finally:
                self.running -= 1
            return self.most_running

        @self.app.workflow("noop", max_attempts=1)
        async def noop(ctx: Context) -> None:
            return None

    async def submit(self, tenant: TenantId, workflow: str, count: int) -> list[RunId]:
        new = [
            NewRun(tenant_id=tenant, workflow=workflow, input={}, lane=self.lane)
            for _ in range(count)
        ]
        return [run.run_id for run in await RunsRepo(self.db).submit_many(new)]

    @asynccontextmanager
    async def worker(
        self, tenant_caps: Callable[[], Awaitable[Mapping[str, int]]] = no_caps
    ) -> AsyncIterator[Worker]:
        worker = Worker(
            self.db,
            self.runner,
            lanes={self.lane: SLOTS},
            lease_ttl_s=30.0,
            tenant_caps=tenant_caps,
            retry_policy=RetryPolicy(base_s=0.0, cap_s=0.0),
            poll_interval_s=0.05,
            grace_s=5.0,
        )
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        try:
            yield worker
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)

    async def count(self, run_ids: list[RunId], status: RunStatus) -> int:
        async with self.db.connect() as conn:
            found: int = (
                await conn.execute(
                    select(func.count()).where(
                        runs.c.id.in_(run_ids), runs.c.status == status.value
                    )
                )
            ).scalar_one()
        return found

    async def until(self, run_ids: list[RunId], status: RunStatus) -> None:
        async def reached() -> bool:
            return await self.count(run_ids, status) == len(run_ids)

        await wait_for(
            reached, timeout_s=SETTLE_S, interval_s=0.05, message=f"{len(run_ids)} {status}"
        )

    async def drain_time_s(self, tenant: TenantId) -> float:
        """Seconds from submitting :data:`NEW_RUNS` no-op runs to their all succeeding."""
        started = time.perf_counter()
        fresh = await self.submit(tenant, "noop", NEW_RUNS)
        await self.until(fresh, RunStatus.SUCCEEDED)
        return time.perf_counter() - started

    async def approve_all(self, run_ids: list[RunId]) -> None:
        repo = InterruptsRepo(self.db)
        for run_id in run_ids:
            [pending] = await repo.pending_for_run(run_id)
            await repo.resolve(
                run_id, pending.interrupt_id, approved=True, reason="approved", data=None
            )

    async def check_finished_once(self, run_ids: list[RunId]) -> None:
        """Every run succeeded through one terminal event, each step called once."""
        async with self.db.connect() as conn:
            ended = Counter(
                (
                    await conn.execute(
                        select(events.c.run_id).where(
                            events.c.run_id.in_(run_ids),
                            events.c.type.in_(["succeeded", "failed", "cancelled", "timed_out"]),
                        )
                    )
                ).scalars()
            )
        assert ended == Counter(dict.fromkeys(run_ids, 1)), "a run ended twice or never"
        for run_id in run_ids:
            assert self.calls[(run_id, "before")] == 1, f"{run_id}: before ran again"
            assert self.calls[(run_id, "after")] == 1, f"{run_id}: after ran again"


async def test_a_capped_tenant_with_50_waiting_runs_still_runs_two_at_once(
    db: DatabaseManager, store: RuntimeStore, tenants: Tenants
) -> None:
    scale = Scale(db, store)
    tenant = await tenants.new(CAPPED_PLAN)

    async def caps() -> Mapping[str, int]:
        return {CAPPED_PLAN: CAP}

    async with scale.worker(caps):
        waiting = await scale.submit(tenant, "approve", CAPPED_WAITING)
        await scale.until(waiting, RunStatus.WAITING)
        # The waiting runs hold no unit of the cap: two more of the tenant run together.
        pair = await scale.submit(tenant, "together", CAP)
        await scale.until(pair, RunStatus.SUCCEEDED)
        assert scale.most_running == CAP
        assert await scale.count(waiting, RunStatus.WAITING) == CAPPED_WAITING
        await scale.approve_all(waiting)
        await scale.until(waiting, RunStatus.SUCCEEDED)
    await scale.check_finished_once(waiting)


async def test_a_four_slot_worker_holds_many_waiting_runs_and_runs_new_ones(
    db: DatabaseManager, store: RuntimeStore, tenants: Tenants
) -> None:
    scale = Scale(db, store)
    tenant = await tenants.new()
    async with scale.worker() as worker:
        alone_s = await scale.drain_time_s(tenant)
        waiting = await scale.submit(tenant, "approve", WAITING_RUNS)
        await scale.until(waiting, RunStatus.WAITING)

        async def slots_free() -> bool:
            return worker.in_flight == 0

        # A parked run's attempt ends just after its row says waiting (the lease and the Redis
        # keys are let go after the commit): a slot held past that is what this catches.
        await wait_for(slots_free, timeout_s=10.0, message="a waiting run to let its slot go")
        beside_s = await scale.drain_time_s(tenant)
        logger.info(
            "%d no-op runs on %d slots: %.3f s alone, %.3f s beside %d waiting runs",
            NEW_RUNS,
            SLOTS,
            alone_s,
            beside_s,
            WAITING_RUNS,
        )
        assert beside_s <= SLOWER_AT_MOST * alone_s + 1.0, (alone_s, beside_s)
        await scale.approve_all(waiting)
        await scale.until(waiting, RunStatus.SUCCEEDED)
    await scale.check_finished_once(waiting)
