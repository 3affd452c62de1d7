"""Interrupts on every backend: idempotent open, first-writer-wins resolve, expiry, fencing."""

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select

from moorline.db.manager import DatabaseManager
from moorline.db.repos.interrupts import InterruptMismatch, InterruptResolved, InterruptsRepo
from moorline.db.repos.queue import QueueRepo
from moorline.db.repos.records import DecisionReason, Fence, Interrupt, InterruptStatus
from moorline.db.repos.steps import LeaseLost
from moorline.db.schema import interrupts
from moorline.errors import Conflict, NotFound
from moorline.types import Attempt, JSONObject, RunId
from tests.contract.queue_helpers import NO_CAP, Tenants, add_runs, set_lease_expiry, unique
from tests.contract.statements import data_statements
from tests.helpers import wait_for

TTL_S = 30.0
TRIALS = 50
DATA: JSONObject = {"pr": 7, "comment": "LGTM ✓"}


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


async def new_run(db: DatabaseManager, tenants: Tenants) -> tuple[str, Fence]:
    lane = unique("lane")
    await add_runs(db, await tenants.new(), lane, 1)
    [claim] = await QueueRepo(db).claim_batch(
        lane, "worker", limit=1, lease_ttl_s=TTL_S, tenant_caps=NO_CAP
    )
    return lane, claim.fence


async def reclaim(db: DatabaseManager, lane: str, fence: Fence) -> Fence:
    queue = QueueRepo(db)
    await set_lease_expiry(db, [fence.run_id], -1.0)
    assert fence.run_id in [r.run_id for r in await queue.reap_expired(limit=1_000)]
    [claim] = await wait_for(
        lambda: queue.claim_batch(lane, "next", limit=1, lease_ttl_s=TTL_S, tenant_caps=NO_CAP),
        message=f"claim of run {fence.run_id}",
    )
    return claim.fence


async def rows(db: DatabaseManager, run_id: str) -> list[dict[str, Any]]:
    async with db.connect() as conn:
        result = await conn.execute(select(interrupts).where(interrupts.c.run_id == run_id))
        return [dict(row) for row in result.mappings()]


async def approve(repo: InterruptsRepo, interrupt: Interrupt, data: Any = None) -> Interrupt:
    return await repo.resolve(
        interrupt.run_id, interrupt.interrupt_id, approved=True, reason="approved", data=data
    )


async def deny(repo: InterruptsRepo, interrupt: Interrupt, reason: str = "denied") -> Interrupt:
    return await repo.resolve(
        interrupt.run_id, interrupt.interrupt_id, approved=False, reason=reason, data=None
    )


async def test_open_is_idempotent_per_key_across_attempts(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = InterruptsRepo(db)
    lane, fence = await new_run(db, tenants)
    opened = await repo.open(fence, "perm:0", "post_comment", DATA, 300.0)
    assert opened.is_pending and not opened.approved
    assert (opened.run_id, opened.key, opened.action, opened.data) == (
        fence.run_id,
        "perm:0",
        "post_comment",
        DATA,
    )
    assert (opened.status, opened.reason, opened.decision) == (InterruptStatus.PENDING, None, None)
    assert opened.attempt == fence.attempt and opened.resolved_at is None
    window = opened.expires_at - opened.created_at
    assert timedelta(seconds=299) < window <= timedelta(seconds=301)
    assert await repo.open(fence, "perm:0", "post_comment", DATA, 300.0) == opened
    assert await repo.pending_for_run(fence.run_id) == [opened]
    # Resolved while the worker was away; the next attempt's replay gets the same decision
    # and the original deadline.
    resolved = await approve(repo, opened, {"note": "go"})
    successor = await reclaim(db, lane, fence)
    replayed = await repo.open(successor, "perm:0", "post_comment", {"other": "data"}, 5.0)
    assert replayed == resolved
    assert replayed.approved and replayed.decision == {"note": "go"}
    assert replayed.expires_at == opened.expires_at
    assert len(await rows(db, fence.run_id)) == 1
    assert await repo.pending_for_run(fence.run_id) == []
    assert await repo.get(opened.interrupt_id) == resolved
    assert await repo.get(str(uuid.uuid4())) is None


async def test_a_replay_for_another_action_is_refused(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = InterruptsRepo(db)
    _, fence = await new_run(db, tenants)
    await repo.open(fence, "perm:0", "post_comment", DATA, 300.0)
    with pytest.raises(InterruptMismatch, match="delete_repo"):
        await repo.open(fence, "perm:0", "delete_repo", DATA, 300.0)


async def test_a_stale_fence_opens_nothing(db: DatabaseManager, tenants: Tenants) -> None:
    repo = InterruptsRepo(db)
    for stale in ["other attempt", "other owner", "reaped"]:
        _, fence = await new_run(db, tenants)
        existing = await repo.open(fence, "perm:0", "post_comment", DATA, 300.0)
        if stale == "other attempt":
            fence = replace(fence, attempt=Attempt(fence.attempt + 1))
        elif stale == "other owner":
            fence = replace(fence, owner="impostor")
        else:
            await set_lease_expiry(db, [fence.run_id], -1.0)
            await QueueRepo(db).reap_expired(limit=1_000)
        for key in ["perm:0", "perm:1"]:
            with pytest.raises(LeaseLost):
                await repo.open(fence, key, "post_comment", DATA, 300.0)
        assert await repo.pending_for_run(fence.run_id) == [existing], stale


async def test_resolve_is_idempotent_and_refuses_a_different_decision(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = InterruptsRepo(db)
    _, fence = await new_run(db, tenants)
    opened = await repo.open(fence, "perm:0", "post_comment", DATA, 300.0)
    resolved = await approve(repo, opened, {"note": "ok"})
    assert (resolved.status, resolved.reason, resolved.decision) == (
        InterruptStatus.APPROVED,
        DecisionReason.APPROVED,
        {"note": "ok"},
    )
    assert resolved.resolved_at is not None and resolved.approved and not resolved.is_pending
    assert await approve(repo, opened, {"note": "ok"}) == resolved
    for conflicting in [
        deny(repo, opened),
        approve(repo, opened, {"note": "changed"}),
        deny(repo, opened, "timeout"),
        deny(repo, opened, "cancelled"),
    ]:
        with pytest.raises(InterruptResolved, match="already resolved: approved") as caught:
            await conflicting
        assert isinstance(caught.value, Conflict) and caught.value.code == "interrupt_resolved"
    assert await repo.get(opened.interrupt_id) == resolved


async def test_resolve_of_an_unknown_or_foreign_interrupt_is_not_found(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = InterruptsRepo(db)
    _, fence = await new_run(db, tenants)
    _, other = await new_run(db, tenants)
    opened = await repo.open(fence, "perm:0", "post_comment", DATA, 300.0)
    with pytest.raises(NotFound):
        await approve(repo, replace(opened, interrupt_id=str(uuid.uuid4())))
    with pytest.raises(NotFound):
        await approve(repo, replace(opened, run_id=other.run_id))
    with pytest.raises(ValueError, match="contradicts"):
        await repo.resolve(
            fence.run_id, opened.interrupt_id, approved=True, reason="denied", data=None
        )
    with pytest.raises(ValueError):
        await repo.resolve(fence.run_id, opened.interrupt_id, approved=False, reason="x", data=None)
    assert (await repo.get(opened.interrupt_id)) == opened


async def test_concurrent_conflicting_resolutions_have_exactly_one_winner(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = InterruptsRepo(db)
    _, fence = await new_run(db, tenants)
    wins = {"approve": 0, "deny": 0}
    for trial in range(TRIALS):
        opened = await repo.open(fence, f"perm:{trial}", "post_comment", DATA, 300.0)
        # Alternate who starts first, so both sides get to win.
        racers = [approve(repo, opened), deny(repo, opened)]
        if trial % 2:
            racers.reverse()
        outcomes = await asyncio.gather(*racers, return_exceptions=True)
        won = [o for o in outcomes if isinstance(o, Interrupt)]
        lost = [o for o in outcomes if isinstance(o, InterruptResolved)]
        assert (len(won), len(lost)) == (1, 1), f"trial {trial}: {outcomes}"
        stored = await repo.get(opened.interrupt_id)
        assert stored == won[0]
        wins["approve" if stored.approved else "deny"] += 1
    assert wins["approve"] > 0 and wins["deny"] > 0, wins


async def test_expire_due_denies_overdue_interrupts_once(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = InterruptsRepo(db)
    _, fence = await new_run(db, tenants)
    overdue = await repo.open(fence, "perm:old", "post_comment", DATA, -1.0)
    waiting = await repo.open(fence, "perm:new", "post_comment", DATA, 300.0)
    first, second = await asyncio.gather(repo.expire_due(), repo.expire_due())
    mine = [i for i in first + second if i.run_id == fence.run_id]
    assert [i.interrupt_id for i in mine] == [overdue.interrupt_id]
    [expired] = mine
    assert (expired.status, expired.reason, expired.decision) == (
        InterruptStatus.DENIED,
        DecisionReason.TIMEOUT,
        None,
    )
    assert expired.resolved_at is not None
    assert all(i.run_id != fence.run_id for i in await repo.expire_due())
    assert await repo.pending_for_run(fence.run_id) == [waiting]
    with pytest.raises(InterruptResolved, match="denied"):
        await approve(repo, overdue)
    # The worker's own timeout is the same decision again, so it is accepted.
    assert await deny(repo, overdue, "timeout") == expired


async def test_a_late_approval_is_refused_and_expires_the_interrupt(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = InterruptsRepo(db)
    _, fence = await new_run(db, tenants)
    overdue = await repo.open(fence, "perm:0", "post_comment", DATA, -1.0)
    with pytest.raises(InterruptResolved, match="expired"):
        await approve(repo, overdue)
    stored = await repo.get(overdue.interrupt_id)
    assert stored is not None
    assert (stored.status, stored.reason) == (InterruptStatus.DENIED, DecisionReason.TIMEOUT)
    # The worker's shutdown or cancel before the deadline is recorded as given.
    pending = await repo.open(fence, "perm:1", "post_comment", DATA, 300.0)
    shut = await deny(repo, pending, "shutdown")
    assert (shut.status, shut.reason) == (InterruptStatus.DENIED, DecisionReason.SHUTDOWN)
    assert await repo.pending_for_run(RunId(fence.run_id)) == []


async def test_resolve_writes_and_returns_the_decision_in_one_statement_where_it_can(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = InterruptsRepo(db)
    _, fence = await new_run(db, tenants)
    opened = await repo.open(fence, "perm:0", "post_comment", DATA, 300.0)
    with data_statements(db, "interrupts") as sent:
        resolved = await approve(repo, opened, {"note": "ok"})
    # UPDATE … RETURNING; MySQL/MariaDB have no UPDATE … RETURNING and read the row back.
    assert len(sent) == (1 if db.backend.capabilities.update_returning else 2), sent
    assert resolved == await repo.get(opened.interrupt_id)
