"""Injected messages on every backend: seq per run, tenant and status checks, fenced drains.

The drain is a checkpoint: these tests pin that a replayed drain returns the recorded batch,
that a message is never delivered by two drains, and that a stale attempt takes nothing.
"""

import asyncio
from collections.abc import AsyncIterator

import pytest

from moorline.db.manager import DatabaseManager
from moorline.db.repos.events import EventsRepo
from moorline.db.repos.messages import MessagesRepo, drain_step_key
from moorline.db.repos.queue import Claim, QueueRepo
from moorline.db.repos.records import Fence
from moorline.db.repos.steps import LeaseLost, StepMismatch, StepsRepo
from moorline.errors import LimitExceeded, RunNotFound, RunNotInteractive
from moorline.types import RunId, TenantId
from tests.contract.queue_helpers import NO_CAP, Tenants, add_runs, finish, requeue_all, unique

TTL_S = 30.0


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


async def running_run(db: DatabaseManager, tenant: TenantId) -> tuple[str, Claim]:
    lane = unique("lane")
    await add_runs(db, tenant, lane, 1)
    return lane, await claim_one(db, lane)


async def claim_one(db: DatabaseManager, lane: str) -> Claim:
    [claim] = await QueueRepo(db).claim_batch(
        lane, unique("owner"), limit=1, lease_ttl_s=TTL_S, tenant_caps=NO_CAP
    )
    return claim


async def contents(repo: MessagesRepo, fence: Fence, position: int) -> list[str]:
    return [message.content for message in (await repo.drain(fence, position)).messages]


async def test_messages_get_a_seq_per_run_and_each_drain_takes_the_waiting_ones(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = MessagesRepo(db)
    tenant = await tenants.new()
    _, first = await running_run(db, tenant)
    _, second = await running_run(db, tenant)
    run_id = first.fence.run_id
    posted = [(await repo.post(tenant, run_id, text)).message for text in ("one", "two", "three")]
    assert [m.seq for m in posted] == [1, 2, 3]
    assert (await repo.post(tenant, second.fence.run_id, "elsewhere")).message.seq == 1

    drained = await repo.drain(first.fence, 1)
    assert [(m.seq, m.content) for m in drained.messages] == [(1, "one"), (2, "two"), (3, "three")]
    assert {m.delivered_attempt for m in drained.messages} == {first.fence.attempt}
    assert not drained.replay
    # One message_received event per message, after the run's earlier events.
    assert [(e.seq, e.type, e.data) for e in drained.events] == [
        (2, "message_received", {"seq": 1, "content": "one"}),
        (3, "message_received", {"seq": 2, "content": "two"}),
        (4, "message_received", {"seq": 3, "content": "three"}),
    ]
    assert await EventsRepo(db).list(run_id, after_seq=1) == drained.events
    assert await contents(repo, first.fence, 2) == []
    await repo.post(tenant, run_id, "four")
    assert await contents(repo, first.fence, 3) == ["four"]
    listed = await repo.list(run_id)
    assert [m.content for m in listed] == ["one", "two", "three", "four"]
    assert all(m.delivered_at is not None for m in listed)
    assert [m.seq for m in await repo.list(run_id, after_seq=2, limit=1)] == [3]
    assert await contents(repo, second.fence, 1) == ["elsewhere"]


async def test_a_replayed_drain_returns_its_batch_and_a_stale_attempt_takes_nothing(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = MessagesRepo(db)
    tenant = await tenants.new()
    lane, claim = await running_run(db, tenant)
    run_id = claim.fence.run_id
    for text in ("m1", "m2"):
        await repo.post(tenant, run_id, text)
    assert await contents(repo, claim.fence, 1) == ["m1", "m2"]
    await repo.post(tenant, run_id, "m3")
    # The worker dies before its next checkpoint; the next attempt replays drain 1.
    await requeue_all(db, tenant)
    successor = await claim_one(db, lane)
    replayed = await repo.drain(successor.fence, 1)
    assert replayed.replay and replayed.events == []
    assert [m.content for m in replayed.messages] == ["m1", "m2"]
    with pytest.raises(LeaseLost):
        await repo.drain(claim.fence, 2)
    assert await contents(repo, successor.fence, 2) == ["m3"]
    received = [e for e in await EventsRepo(db).list(run_id) if e.type == "message_received"]
    assert [e.data for e in received] == [
        {"seq": 1, "content": "m1"},
        {"seq": 2, "content": "m2"},
        {"seq": 3, "content": "m3"},
    ]
    assert [m.delivered_attempt for m in await repo.list(run_id)] == [
        claim.fence.attempt,
        claim.fence.attempt,
        successor.fence.attempt,
    ]


async def test_a_post_needs_the_tenants_running_run_and_room(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = MessagesRepo(db, max_waiting=3)
    tenant, other = await tenants.new(), await tenants.new()
    _, claim = await running_run(db, tenant)
    run_id = claim.fence.run_id
    with pytest.raises(RunNotFound):
        await repo.post(other, run_id, "not yours")
    with pytest.raises(RunNotFound):
        await repo.post(tenant, RunId("no-such-run"), "hello")
    [queued] = await add_runs(db, tenant, unique("lane"), 1)
    with pytest.raises(RunNotInteractive, match="queued"):
        await repo.post(tenant, queued, "too early")
    for text in ("a", "b", "c"):
        await repo.post(tenant, run_id, text)
    with pytest.raises(LimitExceeded, match="3 messages waiting"):
        await repo.post(tenant, run_id, "d")
    assert await contents(repo, claim.fence, 1) == ["a", "b", "c"]
    await repo.post(tenant, run_id, "d")
    assert await finish(db, claim.fence)
    with pytest.raises(RunNotInteractive, match="succeeded"):
        await repo.post(tenant, run_id, "too late")
    assert [m.content for m in await repo.list(run_id)] == ["a", "b", "c", "d"]


async def test_concurrent_posts_and_drains_deliver_each_message_once_in_order(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = MessagesRepo(db)
    tenant = await tenants.new()
    _, claim = await running_run(db, tenant)
    run_id = claim.fence.run_id
    batches: list[list[int]] = []
    posting = True

    async def post(index: int) -> int:
        return (await repo.post(tenant, run_id, f"m{index}")).message.seq

    async def drain_while_posting() -> None:
        position = 0
        while posting:
            position += 1
            batches.append([m.seq for m in (await repo.drain(claim.fence, position)).messages])
        batches.append([m.seq for m in (await repo.drain(claim.fence, position + 1)).messages])

    drainer = asyncio.create_task(drain_while_posting())
    seqs = await asyncio.gather(*(post(index) for index in range(60)))
    posting = False
    await drainer
    assert sorted(seqs) == list(range(1, 61))
    delivered = [seq for batch in batches for seq in batch]
    assert delivered == list(range(1, 61)), "each once, in seq order, across the drains"


async def test_a_step_key_that_collides_with_a_drain_is_refused(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = MessagesRepo(db)
    tenant = await tenants.new()
    _, claim = await running_run(db, tenant)
    await StepsRepo(db).start(claim.fence, drain_step_key(1), "user.fn", "h")
    with pytest.raises(StepMismatch, match=r"moorline\.drain:1"):
        await repo.drain(claim.fence, 1)
