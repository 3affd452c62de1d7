"""Injected messages and conversations, end to end through the runner, on both stores.

Messages are accepted only while the workflow code runs, delivered exactly once and in order
across a crash between a drain and the next checkpoint; a conversation's lease is held from the
attempt's start until its outcome is written, renewed by the worker's heartbeat.
"""

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import update

from moorline import Context
from moorline.db.manager import DatabaseManager
from moorline.db.repos.runs import NewRun, Succeeded
from moorline.db.schema import runs
from moorline.engine import runner as runner_module
from moorline.engine.conversations import lease_holder
from moorline.errors import ConversationBusy, InvalidInput, RunNotFound, RunNotInteractive
from moorline.runtime.base import RuntimeStore, WindowChange, conversation_key
from moorline.settings import Settings
from moorline.types import JSONValue, RunId, RunStatus
from tests.contract.queue_helpers import Tenants
from tests.engine.harness import CountingStore, EngineHarness
from tests.helpers import until_interactive, wait_for

HEARTBEAT_LEASE_S = 1.2
"""Lease TTL of the heartbeat test: renewals every 0.4 s, self-fencing at 1.0 s."""


def conv_key(engine: EngineHarness) -> str:
    """The store's key of the conversation "conv" of the harness's tenant."""
    assert engine.tenant is not None
    return conversation_key(engine.tenant, "conv")


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


@pytest.fixture
def engine(db: DatabaseManager, store: RuntimeStore, tenants: Tenants) -> EngineHarness:
    return EngineHarness(db, store, tenants)


async def test_messages_are_accepted_only_while_the_workflow_code_runs(
    engine: EngineHarness,
) -> None:
    entered, gate = gated_chat(engine)

    run_id = await engine.new_run("chat")
    assert engine.tenant is not None
    tenant = engine.tenant
    with pytest.raises(RunNotInteractive):
        await engine.inbox.post_message(tenant, run_id, "too early: the run is queued")
    claim = await engine.claim()
    task = asyncio.create_task(engine.runner.run(claim))
    await asyncio.wait_for(entered.wait(), 10)
    # The code runs without waiting for its window, which opens a round trip later even if
    # the code writes nothing.
    await until_interactive(engine.store, run_id, run_id)
    assert (await engine.inbox.post_message(tenant, run_id, "hello")).seq == 1
    assert (await engine.inbox.post_message(tenant, run_id, "again")).seq == 2
    with pytest.raises(RunNotFound):
        await engine.inbox.post_message(await engine.tenants.new(), run_id, "not my run")
    with pytest.raises(InvalidInput):
        await engine.inbox.post_message(tenant, run_id, "")
    gate.set()
    assert await asyncio.wait_for(task, 10) == ["hello", "again"]
    # The outcome is not written yet (the run is still running), but the workflow code is
    # over: nothing could drain a message any more.
    assert await engine.status(run_id) is RunStatus.RUNNING
    with pytest.raises(RunNotInteractive):
        await engine.inbox.post_message(tenant, run_id, "too late")
    await engine.runner.release(claim)
    listed = await engine.inbox.list_messages(tenant, run_id)
    assert [(m.content, m.delivered_attempt) for m in listed] == [("hello", 1), ("again", 1)]


async def test_a_run_that_returns_before_its_window_is_sent_never_opens_it(
    db: DatabaseManager, tenants: Tenants
) -> None:
    store = CountingStore()
    engine = EngineHarness(db, store, tenants)

    @engine.app.workflow("quick")
    async def quick(ctx: Context) -> int:
        return 1

    await engine.new_run("quick")
    claim = await engine.claim()
    assert await engine.runner.run(claim) == 1
    await engine.runner.release(claim)
    assert store.batches == [], "no open to send, so no close either"
    await store.close()


async def test_the_code_starts_before_its_window_opens_and_its_first_write_waits_for_it(
    db: DatabaseManager, tenants: Tenants
) -> None:
    store = CountingStore()
    store.gate = asyncio.Event()
    engine = EngineHarness(db, store, tenants)
    started, emitted, gate = asyncio.Event(), asyncio.Event(), asyncio.Event()

    @engine.app.workflow("chat")
    async def chat(ctx: Context) -> list[str]:
        started.set()
        await ctx.emit("ready", {})
        emitted.set()
        await gate.wait()
        return await ctx.drain_messages()

    run_id = await engine.new_run("chat")
    assert engine.tenant is not None
    task = asyncio.create_task(engine.runner.run(claim := await engine.claim()))
    await asyncio.wait_for(started.wait(), 10)
    assert store.batches == [[WindowChange(run_id, run_id, opens=True)]]
    # The open is held in the store: the event waits for it, unwritten.
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(emitted.wait(), 0.2)
    assert await engine.stored(run_id, "ready") == []
    store.gate.set()
    await asyncio.wait_for(emitted.wait(), 10)
    # Whoever saw the event finds the window open.
    assert [event.type for event in await engine.stored(run_id, "ready")] == ["ready"]
    assert (await engine.inbox.post_message(engine.tenant, run_id, "hello")).seq == 1
    gate.set()
    assert await asyncio.wait_for(task, 10) == ["hello"]
    await engine.runner.release(claim)
    await store.close()


def gated_chat(engine: EngineHarness) -> tuple[asyncio.Event, asyncio.Event]:
    """Register ``chat``: it sets the first event, waits for the second, then drains its
    messages and returns them."""
    entered, gate = asyncio.Event(), asyncio.Event()

    @engine.app.workflow("chat")
    async def chat(ctx: Context) -> list[str]:
        entered.set()
        await gate.wait()
        return await ctx.drain_messages()

    return entered, gate


async def until_refused(caplog: pytest.LogCaptureFixture, run_id: RunId) -> None:
    """Wait until ``run_id``'s attempt has heard that the store refused its lease or its
    window's open: it logs so, after which a heartbeat finds the window closed."""

    async def refused() -> bool:
        return f"run {run_id}: runtime store unreachable" in caplog.text

    await wait_for(refused, message=f"run {run_id} to hear that the store is unreachable")


@pytest.mark.parametrize("conversation", [None, "conv"])
async def test_a_window_the_store_refused_at_the_start_is_opened_by_a_heartbeat(
    db: DatabaseManager,
    tenants: Tenants,
    conversation: str | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store unreachable as the attempt starts leaves it without lease or window; once the
    store answers, the heartbeat takes them, until the code returns, and never after."""
    store = CountingStore()
    store.unreachable = True
    engine = EngineHarness(db, store, tenants)
    entered, gate = gated_chat(engine)

    run_id = await engine.new_run("chat", conversation_id=conversation)
    assert engine.tenant is not None
    key = run_id if conversation is None else conv_key(engine)
    task = asyncio.create_task(engine.runner.run(claim := await engine.claim()))
    await asyncio.wait_for(entered.wait(), 10)
    await until_refused(caplog, run_id)
    await engine.runner.renew([claim])  # a heartbeat while the store is still down
    with pytest.raises(RunNotInteractive):
        await engine.inbox.post_message(engine.tenant, run_id, "lost in the outage")

    store.unreachable = False
    await engine.runner.renew([claim])
    assert await store.is_interactive(key, run_id)
    if conversation is not None:
        assert await store.get_lease_holder(key) == f"{run_id}#1"
    assert (await engine.inbox.post_message(engine.tenant, run_id, "hello")).seq == 1
    gate.set()
    assert await asyncio.wait_for(task, 10) == ["hello"]
    await engine.runner.renew([claim])  # the code is over: no heartbeat opens it again
    assert not await store.is_interactive(key, run_id)
    await engine.runner.release(claim)
    assert await store.get_lease_holder(key) is None
    await store.close()


async def test_a_conversation_another_run_holds_is_said_once_and_taken_once_free(
    db: DatabaseManager, tenants: Tenants, caplog: pytest.LogCaptureFixture
) -> None:
    """An attempt that could not take its conversation's lease at its start asks again at every
    heartbeat. While another live run holds it, one warning says so, not one a heartbeat; once
    it is free, the heartbeat takes it and opens the window."""
    caplog.set_level(logging.DEBUG, logger="moorline.engine.conversations")
    store = CountingStore()
    store.unreachable = True
    engine = EngineHarness(db, store, tenants)
    entered, gate = gated_chat(engine)

    run_id = await engine.new_run("chat", conversation_id="conv")
    task = asyncio.create_task(engine.runner.run(claim := await engine.claim()))
    await asyncio.wait_for(entered.wait(), 10)
    await until_refused(caplog, run_id)
    # While the store was away, another run that is live took the conversation.
    assert engine.tenant is not None
    [other] = await engine.runs.submit_many(
        [NewRun(tenant_id=engine.tenant, workflow="chat", input={}, lane=engine.lane)]
    )
    holder = await engine.claim()
    assert holder.fence.run_id == other.run_id
    store.unreachable = False
    assert (await store.acquire_lease(conv_key(engine), lease_holder(holder), 30.0)).acquired

    for _ in range(3):
        await engine.runner.renew([claim])
    told = [r.levelname for r in caplog.records if "the conversation is held" in r.message]
    assert told == ["WARNING", "DEBUG", "DEBUG"]
    with pytest.raises(RunNotInteractive):
        await engine.inbox.post_message(engine.tenant, run_id, "while it is held")

    await store.release_lease(conv_key(engine), lease_holder(holder))
    await engine.runner.renew([claim])
    assert await store.get_lease_holder(conv_key(engine)) == f"{run_id}#1"
    assert f"run {run_id}: conversation lease taken by the heartbeat" in caplog.text
    assert (await engine.inbox.post_message(engine.tenant, run_id, "hello")).seq == 1

    # The store loses the lease (a restart) and the other run takes it: said once again.
    await store.release_lease(conv_key(engine), f"{run_id}#1")
    assert (await store.acquire_lease(conv_key(engine), lease_holder(holder), 30.0)).acquired
    for _ in range(2):
        await engine.runner.renew([claim])
    told = [r.levelname for r in caplog.records if "is now held by" in r.message]
    assert told == ["WARNING", "DEBUG"]
    await store.release_lease(conv_key(engine), lease_holder(holder))
    gate.set()
    assert await asyncio.wait_for(task, 10) == ["hello"]
    await engine.runner.release(claim)
    assert await store.get_lease_holder(conv_key(engine)) is None
    await store.close()


async def test_a_store_outage_is_said_once_by_a_worker_not_at_every_heartbeat(
    db: DatabaseManager, tenants: Tenants, caplog: pytest.LogCaptureFixture
) -> None:
    """While the store is down every heartbeat's bookkeeping fails, for every attempt: one
    warning says so (the rest at debug level), and one line when it answers again."""
    caplog.set_level(logging.DEBUG, logger="moorline.engine.conversations")
    store = CountingStore()
    engine = EngineHarness(db, store, tenants)
    _, gate = gated_chat(engine)

    run_ids = [await engine.new_run("chat") for _ in range(2)]
    claims = [await engine.claim() for _ in run_ids]
    tasks = [asyncio.create_task(engine.runner.run(claim)) for claim in claims]
    for run_id in run_ids:
        await until_interactive(store, run_id, run_id)

    store.unreachable = True
    for _ in range(3):
        await engine.runner.renew(claims)
    failed = [r.levelname for r in caplog.records if "bookkeeping failed" in r.message]
    assert failed == ["WARNING"] + ["DEBUG"] * 5
    assert "answers again" not in caplog.text

    store.unreachable = False
    await engine.runner.renew(claims)
    await engine.runner.renew(claims)
    again = [r.levelname for r in caplog.records if "bookkeeping answers again" in r.message]
    assert again == ["INFO"]
    assert engine.tenant is not None
    assert (await engine.inbox.post_message(engine.tenant, run_ids[0], "hello")).seq == 1
    gate.set()
    assert await asyncio.wait_for(asyncio.gather(*tasks), 10) == [["hello"], []]
    for claim in claims:
        await engine.runner.release(claim)
    await store.close()


async def test_a_cancel_watch_the_store_refuses_is_said_once_not_each_retry(
    db: DatabaseManager,
    tenants: Tenants,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each attempt's cancel watcher asks the store again after a pause while it is down: one
    warning for the worker's outage, the retries of every watcher at debug level."""
    monkeypatch.setattr(runner_module, "CANCEL_WATCH_RETRY_S", 0.02)
    caplog.set_level(logging.DEBUG, logger=runner_module.__name__)
    store = CountingStore()
    store.unreachable = True
    engine = EngineHarness(db, store, tenants)
    gate = asyncio.Event()

    @engine.app.workflow("wait")
    async def wait(ctx: Context) -> None:
        await gate.wait()

    run_ids = [await engine.new_run("wait") for _ in range(2)]
    claims = [await engine.claim() for _ in run_ids]
    tasks = [asyncio.create_task(engine.runner.run(claim)) for claim in claims]

    def unreadable() -> list[logging.LogRecord]:
        return [
            r
            for r in caplog.records
            if r.name == runner_module.__name__ and "cancel flag unreadable" in r.message
        ]

    async def retried() -> bool:
        return all(sum(run_id in r.message for r in unreadable()) >= 3 for run_id in run_ids)

    await wait_for(retried, message="each attempt's cancel watcher to fail three times")
    assert [r.levelname for r in unreadable()].count("WARNING") == 1
    store.unreachable = False
    gate.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    for claim in claims:
        await engine.runner.release(claim)
    await store.close()


async def test_a_heartbeats_open_under_way_as_the_code_returns_is_closed_behind_it(
    db: DatabaseManager, tenants: Tenants, caplog: pytest.LogCaptureFixture
) -> None:
    store = CountingStore()
    store.unreachable = True
    engine = EngineHarness(db, store, tenants)
    gate = asyncio.Event()

    @engine.app.workflow("chat")
    async def chat(ctx: Context) -> None:
        await gate.wait()

    run_id = await engine.new_run("chat")
    task = asyncio.create_task(engine.runner.run(claim := await engine.claim()))

    await until_refused(caplog, run_id)
    store.unreachable, store.gate = False, asyncio.Event()
    heartbeat = asyncio.create_task(engine.runner.renew([claim]))

    async def retake_sent() -> bool:
        return len(store.batches) == 2

    await wait_for(retake_sent, message="the heartbeat's open to reach the store")
    gate.set()  # the code returns while the store holds that open
    with pytest.raises(TimeoutError):  # its close waits behind the open, and the run for it
        await asyncio.wait_for(asyncio.shield(task), 0.2)
    store.gate.set()
    await asyncio.wait_for(asyncio.gather(task, heartbeat), 10)
    assert store.batches[1:] == [
        [WindowChange(run_id, run_id, opens=True)],
        [WindowChange(run_id, run_id, opens=False)],
    ]
    assert not await store.is_interactive(run_id, run_id)
    await engine.runner.release(claim)
    await store.close()


async def test_a_replay_gets_the_same_messages_from_the_same_drain(engine: EngineHarness) -> None:
    entered = {1: asyncio.Event(), 2: asyncio.Event()}
    gates = {1: asyncio.Event(), 2: asyncio.Event()}

    @engine.app.workflow("chat")
    async def chat(ctx: Context) -> list[list[str]]:
        entered[ctx.attempt].set()
        await gates[ctx.attempt].wait()
        first = await ctx.drain_messages()
        if ctx.attempt == 1:
            raise ConnectionError("the worker died between the drain and its next checkpoint")
        return [first, await ctx.drain_messages()]

    run_id = await engine.new_run("chat")
    assert engine.tenant is not None
    first_try = asyncio.create_task(engine.runner.run(await engine.claim()))
    await asyncio.wait_for(entered[1].wait(), 10)
    await until_interactive(engine.store, run_id, run_id)
    for text in ("m1", "m2"):
        await engine.inbox.post_message(engine.tenant, run_id, text)
    gates[1].set()
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(first_try, 10)

    second_try = asyncio.create_task(engine.runner.run(await engine.reclaim()))
    await asyncio.wait_for(entered[2].wait(), 10)
    await until_interactive(engine.store, run_id, run_id)
    await engine.inbox.post_message(engine.tenant, run_id, "m3")
    gates[2].set()
    # The replayed first drain returns its recorded batch, not m3; the next one takes m3.
    assert await asyncio.wait_for(second_try, 10) == [["m1", "m2"], ["m3"]]
    received = await engine.stored(run_id, "message_received")
    assert [(e.data, e.attempt) for e in received] == [
        ({"seq": 1, "content": "m1"}, 1),
        ({"seq": 2, "content": "m2"}, 1),
        ({"seq": 3, "content": "m3"}, 2),
    ]


async def test_the_conversation_lease_lives_until_the_outcome_is_written(
    engine: EngineHarness,
) -> None:
    entered, gate = asyncio.Event(), asyncio.Event()

    @engine.app.workflow("turn")
    async def turn(ctx: Context) -> JSONValue:
        entered.set()
        await gate.wait()
        return ctx.conversation_id

    store = engine.store
    run_id = await engine.new_run("turn", conversation_id="conv")
    async with engine.worker():
        await asyncio.wait_for(entered.wait(), 10)
        assert await store.get_lease_holder(conv_key(engine)) == f"{run_id}#1"
        await until_interactive(store, conv_key(engine), run_id)
        with pytest.raises(ConversationBusy) as busy:
            await engine.new_run("turn", conversation_id="conv")
        assert busy.value.active_run_id == run_id
        gate.set()

        async def released() -> bool:
            return await store.get_lease_holder(conv_key(engine)) is None

        await wait_for(released, message="the conversation lease to be released")
        assert await engine.status(run_id) is RunStatus.SUCCEEDED, "released after the outcome"
        assert not await store.is_interactive(conv_key(engine), run_id)
        # The conversation is free: its next run is admitted and runs.
        following = await engine.new_run("turn", conversation_id="conv")
        await engine.until_status(following, RunStatus.SUCCEEDED)


async def test_the_heartbeat_keeps_the_lease_and_the_window_alive(
    store: RuntimeStore, tmp_path: Path
) -> None:
    """On both stores; the database is beside the point, so this one uses SQLite only."""
    db = DatabaseManager(Settings(database_url=f"sqlite+aiosqlite:///{tmp_path}/heartbeat.db"))
    await db.initialize()
    tenants = Tenants(db)
    engine = EngineHarness(db, store, tenants, lease_ttl_s=HEARTBEAT_LEASE_S)
    entered, gate = asyncio.Event(), asyncio.Event()

    @engine.app.workflow("turn")
    async def turn(ctx: Context) -> JSONValue:
        entered.set()
        await gate.wait()
        return None

    try:
        run_id = await engine.new_run("turn", conversation_id="conv")
        async with engine.worker():
            await asyncio.wait_for(entered.wait(), 10)
            # Time passing is what is tested: without renewals both would expire.
            await asyncio.sleep(1.5 * HEARTBEAT_LEASE_S)
            assert await store.get_lease_holder(conv_key(engine)) == f"{run_id}#1"
            assert await store.is_interactive(conv_key(engine), run_id)
            gate.set()
            await engine.until_status(run_id, RunStatus.SUCCEEDED)
    finally:
        await db.dispose()


async def test_a_stale_holder_is_replaced_and_a_live_one_refuses(engine: EngineHarness) -> None:
    @engine.app.workflow("turn")
    async def turn(ctx: Context) -> JSONValue:
        return await engine.store.get_lease_holder(conv_key(engine))

    # An earlier run of the conversation ended, but its worker died before releasing.
    ended = await engine.new_run("turn", conversation_id="conv")
    ended_claim = await engine.claim()
    assert await engine.runs.finish_many([Succeeded(fence=ended_claim.fence, output=None)])
    await engine.store.acquire_lease(conv_key(engine), lease_holder(ended_claim), 30.0)
    current = await engine.new_run("turn", conversation_id="conv")
    claim = await engine.claim()
    assert claim.fence.run_id == current and ended_claim.fence.run_id == ended
    assert await engine.runner.run(claim) == f"{current}#1"
    await engine.runner.release(claim)
    assert await engine.store.get_lease_holder(conv_key(engine)) is None

    # A run stored behind admission's back while another of the conversation is live.
    await engine.store.acquire_lease(conv_key(engine), f"{current}#1", 30.0)
    assert engine.tenant is not None
    [intruder] = await engine.runs.submit_many(
        [NewRun(tenant_id=engine.tenant, workflow="turn", input={}, lane=engine.lane)]
    )
    async with engine.db.transaction() as conn:
        await conn.execute(
            update(runs).where(runs.c.id == intruder.run_id).values(conversation_id="conv")
        )
    assert await engine.status(current) is RunStatus.RUNNING, "its outcome was never written"
    intruding = await engine.claim()
    with pytest.raises(ConversationBusy) as busy:
        await engine.runner.run(intruding)
    assert busy.value.active_run_id == RunId(current)
    assert await engine.store.get_lease_holder(conv_key(engine)) == f"{current}#1"


async def test_two_tenants_may_use_the_same_conversation_id_at_once(
    engine: EngineHarness,
) -> None:
    """Conversation ids are each tenant's own names: their leases and windows never meet."""
    entered = {1: asyncio.Event(), 2: asyncio.Event()}
    gate = asyncio.Event()

    @engine.app.workflow("turn")
    async def turn(ctx: Context) -> JSONValue:
        entered[1 if ctx.tenant_id == first_tenant else 2].set()
        await gate.wait()
        return ctx.attempt

    first = await engine.new_run("turn", conversation_id="conv")
    assert engine.tenant is not None
    first_tenant = engine.tenant
    engine.tenant = await engine.tenants.new()
    second = await engine.new_run("turn", conversation_id="conv")
    async with engine.worker():
        # Both workflows execute together: neither run was refused by the other's lease.
        await asyncio.wait_for(asyncio.gather(entered[1].wait(), entered[2].wait()), 10)
        await until_interactive(engine.store, conversation_key(first_tenant, "conv"), first)
        await until_interactive(engine.store, conv_key(engine), second)
        gate.set()
        await engine.until_status(first, RunStatus.SUCCEEDED)
        await engine.until_status(second, RunStatus.SUCCEEDED)
    # One attempt each: neither was refused with ConversationBusy and retried.
    assert [e.attempt for e in await engine.stored(first, "started")] == [1]
    assert [e.attempt for e in await engine.stored(second, "started")] == [1]
