"""A heartbeat that finds a run parked by its own attempt does not call it a lost lease.

Between the park's commit and the end of the attempt, the workflow's ``finally`` blocks and the
runner's wind-down still run (RunParked propagates like ``CancelledError``). A heartbeat in
that window renews nothing for the run, which is ``waiting`` now; the worker must not take
that for a lease taken over: no ``lease lost`` warning, no lease-loss count, and no cancel of
the attempt's clean-up code.
"""

import asyncio
from collections.abc import AsyncIterator

import pytest

from moorline.db.manager import DatabaseManager
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.dispatch.retry import RetryPolicy
from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.engine.runner import WorkflowRunner
from moorline.observability.metrics import Metrics
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.settings import Settings
from moorline.types import RunStatus
from moorline.worker.worker import Worker
from tests.contract.queue_helpers import Tenants, no_caps, statuses, unique
from tests.helpers import sampled, wait_for

LEASE_TTL_S = 6.0
"""Heartbeats every 2 s. Until a heartbeat finds the run parked, the attempt's self-fence still
runs from the last renewal before the park (5/6 of the TTL): that heartbeat may come up to 3 s
late before the clean-up is cut short. With 3 s (1.5 s of slack) a loaded CI run once lost."""
CLEANUP_S = 4.0
"""The workflow's clean-up after a park: two heartbeat intervals, within a lease."""
SETTLE_S = 40.0


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


async def test_a_heartbeat_during_a_parked_attempts_cleanup_loses_no_lease(
    db: DatabaseManager, tenants: Tenants
) -> None:
    settings = Settings(park_after=0.0, lease_ttl=LEASE_TTL_S)
    app = Moorline(settings)
    cleanups: list[str] = []

    @app.workflow("tidy")
    async def tidy(ctx: Context) -> bool:
        try:
            decision = await ctx.request_permission("go", {}, timeout=600)
        finally:
            await asyncio.sleep(CLEANUP_S)  # closing a browser session, say
            cleanups.append("done")
        return decision.approved

    lane = unique("lane")
    metrics = Metrics()
    store = InMemoryRuntimeStore()
    worker = Worker(
        db,
        WorkflowRunner(app, db=db, store=store, settings=settings),
        lanes={lane: 2},
        lease_ttl_s=LEASE_TTL_S,
        tenant_caps=no_caps,
        retry_policy=RetryPolicy(base_s=0.0, cap_s=0.0),
        poll_interval_s=0.05,
        metrics=metrics,
    )
    tenant = await tenants.new()
    [run] = await RunsRepo(db).submit_many(
        [NewRun(tenant_id=tenant, workflow="tidy", input={}, lane=lane)]
    )
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:

        async def settled(status: RunStatus) -> bool:
            found = await statuses(db, [run.run_id])
            return found[run.run_id][0] == status.value and worker.in_flight == 0

        await wait_for(lambda: settled(RunStatus.WAITING), timeout_s=SETTLE_S, message="the park")
        assert cleanups == ["done"], "the parked attempt's clean-up was cut short"
        assert sampled(metrics.lease_losses, "moorline_lease_losses_total") == 0
        assert sampled(metrics.parks, "moorline_parks_total") == 1
        interrupts = InterruptsRepo(db)
        [pending] = await interrupts.pending_for_run(run.run_id)
        await interrupts.resolve(
            run.run_id, pending.interrupt_id, approved=True, reason="approved", data=None
        )
        await wait_for(lambda: settled(RunStatus.SUCCEEDED), timeout_s=SETTLE_S, message="the end")
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await store.close()
    assert cleanups == ["done", "done"]
    assert sampled(metrics.lease_losses, "moorline_lease_losses_total") == 0
