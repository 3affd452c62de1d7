"""No tenant fills its lane on the default deployment: another tenant's run starts at once.

A lane's default slots exceed the largest tenant cap of the plans routed to it, so a tenant
running at its cap (long runs) leaves a slot that only another tenant's run can take.
"""

import asyncio
from collections.abc import AsyncIterator, Mapping

import pytest

from moorline import Context
from moorline.db.manager import DatabaseManager
from moorline.plans import DEFAULT_PLANS, default_lane_slots, tenant_caps
from moorline.runtime.base import RuntimeStore
from moorline.types import JSONValue, RunStatus
from tests.contract.queue_helpers import Tenants
from tests.engine.harness import EngineHarness


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


async def default_caps() -> Mapping[str, int]:
    return tenant_caps(DEFAULT_PLANS)


async def test_a_tenant_at_its_cap_leaves_a_slot_for_another_tenant(
    db: DatabaseManager, store: RuntimeStore, tenants: Tenants
) -> None:
    team = DEFAULT_PLANS["team"]
    slots = default_lane_slots(DEFAULT_PLANS)[team.lane]
    engine = EngineHarness(db, store, tenants)
    running = 0
    flooding = asyncio.Event()
    release = asyncio.Event()

    @engine.app.workflow("long")
    async def long(ctx: Context) -> JSONValue:
        nonlocal running
        running += 1
        if running == team.tenant_concurrency:
            flooding.set()
        await release.wait()
        return None

    @engine.app.workflow("echo")
    async def echo(ctx: Context) -> JSONValue:
        return "echo"

    engine.tenant = await tenants.new("team")
    flood = [await engine.new_run("long") for _ in range(2 * slots)]
    async with engine.worker(slots=slots, tenant_caps=default_caps):
        await asyncio.wait_for(flooding.wait(), 10)
        engine.tenant = await tenants.new("team")
        other = await engine.new_run("echo")
        # Within one claim, not after the flood's runs end (they wait for `release`).
        await engine.until_status(other, RunStatus.SUCCEEDED, timeout_s=10)
        assert running == team.tenant_concurrency, "the flooding tenant stayed at its cap"
        release.set()
        for run_id in flood:
            await engine.until_status(run_id, RunStatus.SUCCEEDED)
