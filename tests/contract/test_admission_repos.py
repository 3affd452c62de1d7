"""The repositories behind admission and the API, on every backend.

Quota counters must never pass their limit however many consume at once; refused runs are
stored in one statement; listings page by keyset through ties; webhooks find their tenant.
"""

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from sqlalchemy import func, select

from moorline.db.manager import DatabaseManager
from moorline.db.repos.listing import RunFilter, RunListing
from moorline.db.repos.queue import QueueRepo
from moorline.db.repos.quotas import QuotasRepo
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.db.repos.webhooks import WebhooksRepo
from moorline.db.schema import events
from moorline.errors import IdempotencyConflict, TenantNotFound
from moorline.types import JSONObject, RunStatus, TenantId
from tests.contract.queue_helpers import NO_CAP, Tenants, add_runs, statuses, unique

QUOTA_ERROR: JSONObject = {"code": "quota_exceeded"}
CONSUMERS = 60
LIMIT = 25


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


async def test_concurrent_consumes_take_exactly_the_limit(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = QuotasRepo(db)
    tenant = await tenants.new()
    taken = await asyncio.gather(
        *(repo.consume(tenant, "2030-01-01", LIMIT) for _ in range(CONSUMERS))
    )
    granted = sorted(used for used in taken if used is not None)
    assert granted == list(range(1, LIMIT + 1))  # each unit told to exactly one consumer
    assert await repo.used(tenant, "2030-01-01") == LIMIT
    assert await repo.consume(tenant, "2030-01-01", LIMIT) is None
    # Another day, another tenant: counters of their own.
    assert await repo.consume(tenant, "2030-01-02", LIMIT) == 1
    other = await tenants.new()
    assert await repo.used(other, "2030-01-01") == 0


async def test_release_gives_back_but_never_below_zero(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = QuotasRepo(db)
    tenant = await tenants.new()
    assert not await repo.release(tenant, "2030-02-01")  # nothing taken, nothing created
    assert await repo.consume(tenant, "2030-02-01", 1) == 1
    assert await repo.consume(tenant, "2030-02-01", 1) is None
    assert await repo.release(tenant, "2030-02-01")
    assert not await repo.release(tenant, "2030-02-01")
    assert await repo.used(tenant, "2030-02-01") == 0
    assert await repo.consume(tenant, "2030-02-01", 1) == 1
    assert await repo.consume(tenant, "2030-03-01", 0) is None  # a quota of 0 admits nothing


async def test_a_refused_run_is_stored_rate_limited_in_one_step(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = RunsRepo(db)
    tenant = await tenants.new()
    error: JSONObject = {"code": "quota_exceeded", "message": "used up"}
    refused = await repo.insert_rate_limited(
        NewRun(tenant_id=tenant, workflow="echo", input={"a": 1}, lane="l", delay_s=60), error
    )
    stored = await repo.get(refused.run_id)
    assert stored == refused
    assert stored.status is RunStatus.RATE_LIMITED
    assert stored.error == error
    assert stored.finished_at == stored.created_at
    async with db.connect() as conn:
        count = await conn.execute(select(func.count()).where(events.c.run_id == refused.run_id))
        assert count.scalar_one() == 0
    await repo.submit_many(
        [NewRun(tenant_id=tenant, workflow="echo", input={}, lane="l", idempotency_key="k")]
    )
    with pytest.raises(IdempotencyConflict):
        await repo.insert_rate_limited(
            NewRun(tenant_id=tenant, workflow="echo", input={}, lane="l", idempotency_key="k"),
            error,
        )


async def test_listing_pages_through_ties_newest_first(
    db: DatabaseManager, tenants: Tenants
) -> None:
    runs, listing = RunsRepo(db), RunListing(db)
    tenant, stranger = await tenants.new(), await tenants.new()
    # Two batches: each batch's runs share one created_at.
    older = await runs.submit_many(
        [NewRun(tenant_id=tenant, workflow="a", input={"i": i}, lane="l") for i in range(5)]
    )
    newer = await runs.submit_many(
        [
            NewRun(
                tenant_id=tenant, workflow="b", input={"i": i}, lane="l", conversation_id=f"c{i}"
            )
            for i in range(4)
        ]
    )
    await runs.submit_many([NewRun(tenant_id=stranger, workflow="a", input={}, lane="l")])
    expected = sorted(older + newer, key=lambda run: (run.created_at, run.run_id), reverse=True)

    seen = []
    page = await listing.page(tenant, where=RunFilter(), limit=2)
    seen += page.runs
    while page.next_cursor is not None:
        page = await listing.page(tenant, where=RunFilter(), limit=2, after=page.next_cursor)
        seen += page.runs
    assert [run.run_id for run in seen] == [run.run_id for run in expected]

    only_b = await listing.page(tenant, where=RunFilter(workflow="b"), limit=10)
    assert {run.run_id for run in only_b.runs} == {run.run_id for run in newer}
    in_c = await listing.page(tenant, where=RunFilter(conversation_id="c2"), limit=10)
    assert [run.run_id for run in in_c.runs] == [newer[2].run_id] and in_c.next_cursor is None
    running = await listing.page(tenant, where=RunFilter(status=RunStatus.RUNNING), limit=10)
    assert running.runs == []
    with pytest.raises(ValueError, match="limit"):
        await listing.page(tenant, where=RunFilter(), limit=0)


async def test_the_admins_listing_pages_every_tenant_by_lane_and_tenant(
    db: DatabaseManager, tenants: Tenants
) -> None:
    runs, listing = RunsRepo(db), RunListing(db)
    a, b = await tenants.new(), await tenants.new()
    lane = unique("lane")
    made = await runs.submit_many(
        [
            NewRun(tenant_id=t, workflow="w", input={"i": i}, lane=lane)
            for i, t in enumerate([a, b] * 3)
        ]
    )
    made += await runs.submit_many([NewRun(tenant_id=b, workflow="w", input={}, lane=lane)])
    expected = sorted(made, key=lambda run: (run.created_at, run.run_id), reverse=True)

    seen = []
    where = RunFilter(lane=lane)
    page = await listing.page_all_tenants(where=where, limit=3)
    seen += page.runs
    while page.next_cursor is not None:
        page = await listing.page_all_tenants(where=where, limit=3, after=page.next_cursor)
        seen += page.runs
    assert [run.run_id for run in seen] == [run.run_id for run in expected]
    only_a = await listing.page_all_tenants(where=where, limit=50, tenant_id=a)
    assert {run.tenant_id for run in only_a.runs} == {a} and len(only_a.runs) == 3
    queued = await listing.page_all_tenants(
        where=RunFilter(lane=lane, status=RunStatus.QUEUED, workflow="w"), limit=50
    )
    assert len(queued.runs) == 7
    # A tenant's own listing filtered on the lane shows its runs only.
    own = await listing.page(b, where=where, limit=50)
    assert {run.tenant_id for run in own.runs} == {b} and len(own.runs) == 4

    await QueueRepo(db).claim_batch(lane, "worker", limit=2, lease_ttl_s=30.0, tenant_caps=NO_CAP)
    counts = await listing.running_by_tenant([a, b])
    assert sum(counts.values()) == 2 and set(counts) == {a, b}
    assert await listing.running_by_tenant([]) == {}


async def test_quota_use_of_many_tenants_is_one_read(db: DatabaseManager, tenants: Tenants) -> None:
    repo = QuotasRepo(db)
    a, b, idle = await tenants.new(), await tenants.new(), await tenants.new()
    for tenant, units in ((a, 2), (b, 5)):
        for _ in range(units):
            await repo.consume(tenant, "2030-03-01", LIMIT)
    await repo.consume(a, "2030-03-02", LIMIT)  # another day's counter is not counted
    assert await repo.used_by([a, b, idle], "2030-03-01") == {a: 2, b: 5, idle: 0}
    assert await repo.used_by([], "2030-03-01") == {}


async def test_a_conversation_is_active_until_its_runs_end(
    db: DatabaseManager, tenants: Tenants
) -> None:
    runs, listing = RunsRepo(db), RunListing(db)
    tenant = await tenants.new()
    conversation = unique("conv")
    assert await listing.active_in_conversation(tenant, conversation) is None
    refused = await runs.insert_rate_limited(
        NewRun(tenant_id=tenant, workflow="a", input={}, lane="l", conversation_id=conversation),
        QUOTA_ERROR,
    )
    assert await listing.active_in_conversation(tenant, conversation) is None  # terminal
    [queued] = await runs.submit_many(
        [NewRun(tenant_id=tenant, workflow="a", input={}, lane="l", conversation_id=conversation)]
    )
    assert await listing.active_in_conversation(tenant, conversation) == queued.run_id
    assert await listing.active_in_conversation(tenant, conversation + " ") is None
    other = await tenants.new()
    assert await listing.active_in_conversation(other, conversation) is None
    assert refused.run_id != queued.run_id


async def test_lane_loads_count_queued_and_running_and_age_the_oldest(
    db: DatabaseManager, tenants: Tenants
) -> None:
    listing = RunListing(db)
    tenant = await tenants.new()
    lane, idle = unique("lane"), unique("idle")
    ids = await add_runs(db, tenant, lane, 3)
    [claim] = await QueueRepo(db).claim_batch(
        lane, "worker", limit=1, lease_ttl_s=30.0, tenant_caps=NO_CAP
    )
    assert (await statuses(db, [claim.fence.run_id]))[claim.fence.run_id][0] == "running"
    loads = {load.lane: load for load in await listing.lane_loads([idle])}
    assert (loads[lane].queued, loads[lane].running) == (2, 1)
    age = loads[lane].oldest_queued_age_s
    assert age is not None and timedelta(minutes=59) < timedelta(seconds=age) < timedelta(hours=2)
    assert (loads[idle].queued, loads[idle].running, loads[idle].oldest_queued_age_s) == (
        0,
        0,
        None,
    )
    assert len(ids) == 3


async def test_webhooks_are_found_by_id_and_belong_to_a_tenant(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = WebhooksRepo(db)
    tenant = await tenants.new()
    hook = await repo.create(tenant, "review", "s3cret-with-enough-length")
    assert await repo.get(hook.webhook_id) == hook
    assert (hook.tenant_id, hook.workflow, hook.secret) == (
        tenant,
        "review",
        "s3cret-with-enough-length",
    )
    assert await repo.get(str(uuid.uuid4())) is None
    assert await repo.get(hook.webhook_id + " ") is None
    with pytest.raises(TenantNotFound):
        await repo.create(TenantId(str(uuid.uuid4())), "review", "x" * 20)
