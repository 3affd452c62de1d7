"""A runtime store that hangs when an attempt starts, or at a step, delays the run by a bounded
time only.

Behind a network that drops packets, a Redis call answers nothing until the client's connect
timeouts and retries give up: about 20 s in the partition test (docs/reliability.md P6). The
attempt runs on without the store in any case (its conversation lease and interactive window
are coordination, the database fences every write), so it must not wait that long first.
"""

import asyncio
from collections.abc import AsyncIterator

import pytest

from moorline import Context
from moorline.db.manager import DatabaseManager
from moorline.engine import conversations
from moorline.runtime.base import LeaseAcquisition
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.types import RunId
from tests.contract.queue_helpers import Tenants
from tests.engine.harness import EngineHarness

BOUND_S = 0.3
"""The store-call bound for this test (``STORE_CALL_TIMEOUT_S`` is 5 s)."""


class HangingStore(InMemoryRuntimeStore):
    """The in-memory store, except that taking a lease, opening a window or a step boundary's
    cancel check never answers; ``hung`` lists the calls made, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.hung: list[str] = []

    async def acquire_lease(
        self, conversation_id: str, holder: str, ttl_s: float
    ) -> LeaseAcquisition:
        await self._hang("acquire_lease")
        raise AssertionError("unreachable")

    async def mark_interactive(self, conversation_id: str, run_id: RunId, ttl_s: float) -> None:
        await self._hang("mark_interactive")

    async def is_cancelled(self, run_id: RunId) -> bool:
        await self._hang("is_cancelled")
        raise AssertionError("unreachable")

    async def _hang(self, call: str) -> None:
        self.hung.append(call)
        await asyncio.Event().wait()


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


@pytest.mark.parametrize(
    ("conversation_id", "first_call"), [("c1", "acquire_lease"), (None, "mark_interactive")]
)
async def test_an_attempt_starts_when_the_store_hangs_past_its_bound(
    db: DatabaseManager,
    tenants: Tenants,
    monkeypatch: pytest.MonkeyPatch,
    conversation_id: str | None,
    first_call: str,
) -> None:
    monkeypatch.setattr(conversations, "STORE_CALL_TIMEOUT_S", BOUND_S)
    store = HangingStore()
    engine = EngineHarness(db, store, tenants)

    @engine.app.workflow("chatty")
    async def chatty(ctx: Context) -> str:
        # The attempt's first write waits for its window's open (one that returns before
        # writing anything withdraws the open unsent).
        await ctx.emit("said", {})
        return "answered"

    await engine.new_run("chatty", conversation_id=conversation_id)
    # Before the bound, the attempt waited for the store for ever (here) or for the client's
    # own timeouts (behind a partition).
    assert await asyncio.wait_for(engine.runner.run(await engine.claim()), 10) == "answered"
    # Given up as unreachable, and so was the event's cancel check: the attempt ran on.
    assert sorted(store.hung) == sorted([first_call, "is_cancelled"])
    await store.close()


async def test_a_step_runs_when_its_cancel_check_hangs_past_the_bound(
    db: DatabaseManager, tenants: Tenants, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(conversations, "STORE_CALL_TIMEOUT_S", BOUND_S)
    store = HangingStore()
    engine = EngineHarness(db, store, tenants)

    @engine.app.workflow("stepping")
    async def stepping(ctx: Context) -> str:
        await ctx.step("one", lambda: 1)
        await ctx.step("two", lambda: 2)
        return "stepped"

    await engine.new_run("stepping")
    # Before the bound, each step boundary waited for the store as long as it hung.
    assert await asyncio.wait_for(engine.runner.run(await engine.claim()), 10) == "stepped"
    # The window and the first step's check, which hang together (the workflow does not wait
    # for its window; its first write does), then the second step's check, each given up.
    assert sorted(store.hung[:2]) == ["is_cancelled", "mark_interactive"]
    assert store.hung[2:] == ["is_cancelled"]
    await store.close()
