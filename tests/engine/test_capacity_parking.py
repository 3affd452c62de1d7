"""A model call that would wait long for provider capacity parks its run (issue 18, item 4).

Real Workers run a workflow whose model call goes through the worker's
:class:`~moorline.worker.governor.Governor` and a provider limiter (in memory here; the
limiter's own suite holds Redis to the same answers). The model is paused, as a provider's
429 with ``Retry-After`` pauses it: a pause longer than ``park_after`` parks the run
(``waiting`` for ``capacity``, holding no slot) until the limiter's answer, after which the
timer sweep re-queues it and the replay makes the call once; a shorter pause is slept through.
"""

from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime

import pytest

from moorline import Context
from moorline.db.manager import DatabaseManager
from moorline.dispatch.budgets import DatabaseBudgetStore
from moorline.llm import Message, SimulatedLLM, complete
from moorline.llm.governance import CallRequest
from moorline.llm.limiter import MemoryLimiter, ModelLimits, ProviderLimiter
from moorline.plans import Plan
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.types import JSONValue, RunStatus, TenantId
from moorline.usage import Usage
from moorline.worker.governor import Governor
from tests.contract.queue_helpers import Tenants
from tests.engine.harness import EngineHarness
from tests.helpers import wait_for

PARK_AFTER_S = 0.2
PAUSE_S = 2.0
"""The provider's ``Retry-After``: ten times ``park_after``, short enough for a test."""

MODEL = SimulatedLLM().model


@pytest.fixture
async def harness(db: DatabaseManager) -> AsyncIterator[EngineHarness]:
    tenants = Tenants(db)
    store = InMemoryRuntimeStore()
    yield EngineHarness(db, store, tenants, park_after_s=PARK_AFTER_S)
    await store.close()
    await tenants.purge()


class Calls:
    """The governor's usage sink: the time of every finished call."""

    def __init__(self) -> None:
        self.at: list[datetime] = []

    async def __call__(self, request: CallRequest, usage: Usage | None) -> None:
        self.at.append(datetime.now(UTC))


def govern(
    harness: EngineHarness,
    limiter: ProviderLimiter,
    calls: Calls,
    before_call: Callable[[], Awaitable[None]] | None = None,
) -> None:
    async def plan_of(tenant_id: TenantId) -> Plan | None:
        return None

    async def limits(model: str) -> ModelLimits | None:
        return ModelLimits(rpm=6_000) if model == MODEL else None

    governor = Governor(
        budgets=DatabaseBudgetStore(harness.db),
        plan_of=plan_of,
        limiter=limiter,
        limits=limits,
        on_usage=calls,
    )
    harness.use_call_hook(governor)

    llm = SimulatedLLM(first_token_s=0.0, word_interval_s=0.0)

    @harness.app.workflow("ask")
    async def ask(ctx: Context) -> JSONValue:
        if before_call is not None:
            await before_call()
        reply = await complete(llm, [Message.user(f"hello from {ctx.run_id}")])
        return reply.text[:10]

    @harness.app.workflow("quick")
    async def quick(ctx: Context) -> JSONValue:
        return "done"


async def test_a_long_wait_for_capacity_parks_the_run_until_the_limiter_answers(
    harness: EngineHarness,
) -> None:
    limiter, calls = ProviderLimiter(MemoryLimiter()), Calls()
    paused: list[datetime] = []

    async def pause_once() -> None:
        # The provider's 429 comes as the run is about to call: the run meets the whole pause
        # however late a loaded machine started it (paused before, it once slept through a
        # pause it met with less than park_after left). Its replay calls at once.
        if not paused:
            paused.append(datetime.now(UTC))
            await limiter.pause(MODEL, PAUSE_S)

    govern(harness, limiter, calls, before_call=pause_once)
    timers = harness.timer_sweep()
    async with harness.worker(slots=1):
        run_id = await harness.new_run("ask")
        await harness.until_status(run_id, RunStatus.WAITING)
        [paused_at] = paused
        wait = await harness.waiting_for(run_id)
        assert wait["kind"] == "capacity"
        assert wait["model"] == MODEL  # which provider's limits the run waits for
        until = datetime.fromisoformat(str(wait["until"]))
        assert PAUSE_S * 0.5 < (until - paused_at).total_seconds() <= PAUSE_S + 1.0
        # The waiting run holds no slot: the only slot runs another run meanwhile.
        other = await harness.new_run("quick")
        await harness.until_status(other, RunStatus.SUCCEEDED)
        assert calls.at == []
        [moved] = await wait_for(timers.tick, timeout_s=10, message="the capacity timer")
        assert moved.run_id == run_id and moved.status is RunStatus.QUEUED
        await harness.until_status(run_id, RunStatus.SUCCEEDED)
    # One call, made once the pause was over.
    assert len(calls.at) == 1 and (calls.at[0] - paused_at).total_seconds() >= PAUSE_S
    [resumed] = await harness.stored(run_id, "resumed")
    assert resumed.data == {"reason": "timer", "waited_for": "capacity"}


async def test_a_wait_shorter_than_park_after_is_slept_through(harness: EngineHarness) -> None:
    limiter, calls = ProviderLimiter(MemoryLimiter()), Calls()
    govern(harness, limiter, calls)
    paused_at = datetime.now(UTC)
    await limiter.pause(MODEL, PARK_AFTER_S / 2)
    run_id = await harness.new_run("ask")
    async with harness.worker(slots=1):
        await harness.until_status(run_id, RunStatus.SUCCEEDED)
    assert await harness.stored(run_id, "waiting") == []
    assert len(calls.at) == 1 and (calls.at[0] - paused_at).total_seconds() >= PARK_AFTER_S / 2
