"""At most one active run per conversation, decided by the database at admission.

A second run of a conversation is refused with ``conversation_busy`` naming the active run,
while that run is pending, queued or running; the conversation is free again once it ends.
Concurrent submissions to one conversation are serialised: exactly one wins.
"""

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from moorline.db.manager import DatabaseManager
from moorline.db.repos.queue import QueueRepo
from moorline.db.repos.records import Run
from moorline.db.repos.runs import NewRun, RunsRepo, Succeeded
from moorline.dispatch.submit import Submitter
from moorline.errors import Conflict, ConversationBusy
from moorline.types import RunId, TenantId
from tests.contract.queue_helpers import NO_CAP, Tenants, unique

RACERS = 20


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


def new_run(tenant: TenantId, lane: str, conversation_id: str | None, **extra: str) -> NewRun:
    return NewRun(
        tenant_id=tenant,
        workflow="chat",
        input={},
        lane=lane,
        conversation_id=conversation_id,
        run_id=RunId(extra["run_id"]) if "run_id" in extra else None,
    )


async def test_a_conversation_has_one_active_run_until_it_ends(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo, queue = RunsRepo(db), QueueRepo(db)
    tenant, other_tenant = await tenants.new(), await tenants.new()
    lane = unique("lane")
    [active] = await repo.submit_many([new_run(tenant, lane, "chat-1")])
    with pytest.raises(ConversationBusy) as refused:
        await repo.submit_many([new_run(tenant, lane, "chat-1")])
    assert refused.value.code == "conversation_busy"
    assert (refused.value.conversation_id, refused.value.active_run_id) == ("chat-1", active.run_id)
    # Conversations are the tenant's own; runs without one are never refused.
    await repo.submit_many([new_run(other_tenant, lane, "chat-1")])
    await repo.submit_many([new_run(tenant, lane, "chat-2"), new_run(tenant, lane, None)])
    # Still busy while running; free once the run ended.
    [claim] = await queue.claim_batch(lane, "worker", limit=1, lease_ttl_s=30.0, tenant_caps=NO_CAP)
    assert claim.fence.run_id == active.run_id
    with pytest.raises(ConversationBusy):
        await repo.insert_pending([new_run(tenant, lane, "chat-1")])
    assert await repo.finish_many([Succeeded(fence=claim.fence, output=None)]) == [True]
    [pending] = await repo.insert_pending([new_run(tenant, lane, "chat-1")])
    # A pending run holds the conversation too, until admission refuses it.
    with pytest.raises(ConversationBusy, match=pending.run_id):
        await repo.submit_many([new_run(tenant, lane, "chat-1")])
    assert await repo.mark_rate_limited(pending.run_id, {"code": "quota_exceeded"})
    await repo.submit_many([new_run(tenant, lane, "chat-1")])


async def test_one_batch_cannot_start_a_conversation_twice(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = RunsRepo(db)
    tenant = await tenants.new()
    lane = unique("lane")
    first = str(uuid.uuid4())
    with pytest.raises(ConversationBusy) as refused:
        await repo.submit_many(
            [new_run(tenant, lane, "c", run_id=first), new_run(tenant, lane, "c")]
        )
    assert refused.value.active_run_id == first
    assert await repo.get(RunId(first)) is None, "nothing of the batch was written"
    # Through the group-commit submitter only the second caller is refused.
    submitter = Submitter(repo)
    outcomes = await asyncio.gather(
        submitter.submit(new_run(tenant, lane, "d")),
        submitter.submit(new_run(tenant, lane, "d")),
        submitter.submit(new_run(tenant, lane, "e")),
        return_exceptions=True,
    )
    await submitter.close()
    stored = [o for o in outcomes if isinstance(o, Run)]
    busy = [o for o in outcomes if isinstance(o, ConversationBusy)]
    assert len(stored) == 2 and len(busy) == 1
    assert busy[0].active_run_id in {run.run_id for run in stored}


async def test_concurrent_submissions_to_one_conversation_admit_exactly_one(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = RunsRepo(db)
    tenant = await tenants.new()
    lane = unique("lane")
    outcomes = await asyncio.gather(
        *(repo.submit_many([new_run(tenant, lane, "raced")]) for _ in range(RACERS)),
        return_exceptions=True,
    )
    winners = [outcome[0] for outcome in outcomes if isinstance(outcome, list)]
    losers = [outcome for outcome in outcomes if isinstance(outcome, ConversationBusy)]
    assert len(winners) == 1, outcomes
    assert len(losers) == RACERS - 1
    assert {loser.active_run_id for loser in losers} == {winners[0].run_id}


async def test_a_resubmitted_run_is_not_refused_by_its_own_conversation(
    db: DatabaseManager, tenants: Tenants
) -> None:
    """A batch retried after a lost commit finds its own runs, not a busy conversation."""
    repo = RunsRepo(db)
    tenant = await tenants.new()
    run_id = str(uuid.uuid4())
    lane = unique("lane")
    await repo.submit_many([new_run(tenant, lane, "mine", run_id=run_id)])
    with pytest.raises(Conflict) as again:
        await repo.submit_many([new_run(tenant, lane, "mine", run_id=run_id)])
    assert not isinstance(again.value, ConversationBusy)
    assert "run id already exists" in str(again.value)
