"""Property: a run that crashes anywhere resumes with exactly its unfinished steps (invariant 3).

Hypothesis draws workflows of 1-20 checkpointed steps (each sync, through the thread bridge, or
async) and up to four crash points, one per attempt:

- ``before k``: the attempt dies between steps, before step ``k`` (``k == n``: after the last
  step, before the workflow returns);
- ``inside k``: step ``k``'s function dies halfway (a ``BaseException``, as nothing in the
  engine may catch it);
- ``cut k``: step ``k``'s function returns, and the attempt's task is cancelled at that moment,
  so the engine dies inside the checkpoint write (the worker cancels an attempt this way when
  its lease is lost). The cancel lands before the write is sent, or after: a statement already
  handed to the database (its thread, or the server in autocommit) commits without its
  caller, as one whose acknowledgement was lost does. Both are correct; the model follows
  what the database shows the next attempt.

Each attempt runs through the real engine (``WorkflowRunner`` over the real repositories and a
real RuntimeStore); after a crash the run's lease is expired and the real reaper puts it back,
and the next claim replays it. Checked against a model and against the steps table:

- a step checkpointed before a crash never runs again;
- the steps that run in an attempt are exactly the unfinished ones, in order, up to its crash;
- every run of a step sees the same idempotency key, ``"<run id>:<step key>"``;
- the workflow's result is the same as without crashes, and every step is ``succeeded`` under
  the attempt that last ran it.

The embedded database runs with the in-memory store, server databases with Redis. CI runs
``CI_EXAMPLES`` examples per backend; ``MOORLINE_FULL=1`` runs ``FULL_EXAMPLES``.
"""

import asyncio
import os
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import update

from moorline import Context, Moorline
from moorline.db.manager import DatabaseManager
from moorline.db.repos.queue import Claim, QueueRepo
from moorline.db.repos.runs import RunsRepo, Succeeded
from moorline.db.repos.steps import StepsRepo
from moorline.db.schema import runs
from moorline.engine.runner import WorkflowRunner
from moorline.runtime.base import RuntimeStore
from moorline.settings import Settings
from moorline.types import JSONValue, RunId, RunStatus, StepStatus, TenantId
from tests.conftest import CAPABILITIES
from tests.contract.queue_helpers import NO_CAP, Tenants, add_runs, set_lease_expiry, unique
from tests.runtime.conftest import (  # noqa: F401 - fixtures, requested by name below
    memory_store,
    redis_client,
    redis_prefix,
    redis_store,
)

CI_EXAMPLES = 25
FULL_EXAMPLES = 300
EXAMPLES = FULL_EXAMPLES if os.environ.get("MOORLINE_FULL") == "1" else CI_EXAMPLES

MAX_STEPS = 20
MAX_CRASHES = 4
LEASE_TTL_S = 300.0
ATTEMPT_TIMEOUT_S = 30.0

Where = Literal["before", "inside", "cut"]


class WorkerDied(BaseException):
    """The attempt's process died here: nothing after this point happens in the attempt."""


@dataclass(frozen=True)
class Crash:
    where: Where
    step: int


@dataclass(frozen=True)
class Scenario:
    sync: tuple[bool, ...]
    """Per step: a sync function (run through the thread bridge) or an async one."""
    crashes: tuple[Crash, ...]
    """The crash of attempt 1, 2, …; later attempts run to the end."""

    @property
    def steps(self) -> int:
        return len(self.sync)


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    steps = draw(st.integers(1, MAX_STEPS))
    sync = draw(st.lists(st.booleans(), min_size=steps, max_size=steps))
    crash = st.one_of(
        st.builds(Crash, st.just("before"), st.integers(0, steps)),
        st.builds(Crash, st.sampled_from(["inside", "cut"]), st.integers(0, steps - 1)),
    )
    crashes = draw(st.lists(crash, max_size=MAX_CRASHES))
    return Scenario(tuple(sync), tuple(crashes))


def model(scenario: Scenario, landed: frozenset[int] = frozenset()) -> list[list[int]]:
    """The steps whose function each attempt calls, until an attempt gets to the end.

    A crash only happens where the attempt gets to: ``inside``/``cut`` of a step that is
    replayed (its function is not called) does not fire, and that attempt finishes the run.
    ``landed``: the attempts (0-based) whose ``cut`` step's checkpoint was recorded anyway.
    """
    done: set[int] = set()
    attempts: list[list[int]] = []
    for number in range(len(scenario.crashes) + 1):
        crash = scenario.crashes[number] if number < len(scenario.crashes) else None
        called: list[int] = []
        attempts.append(called)
        crashed = False
        for step in range(scenario.steps + 1):
            if crash == Crash("before", step):
                crashed = True
                break
            if step == scenario.steps:
                break
            if step in done:
                continue
            called.append(step)
            if crash is not None and crash.step == step and crash.where != "before":
                crashed = True
                if crash.where == "cut" and number in landed:
                    done.add(step)
                break
            done.add(step)
        if not crashed:
            return attempts
    raise AssertionError("unreachable: the last attempt has no crash")  # pragma: no cover


@dataclass(frozen=True)
class Call:
    attempt: int
    step: int
    idempotency_key: str


@dataclass
class Recorder:
    """What the step functions saw; appended to from bridge threads and the loop alike."""

    calls: list[Call] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, call: Call) -> None:
        with self.lock:
            self.calls.append(call)

    def steps_of(self, attempt: int) -> list[int]:
        return [call.step for call in self.calls if call.attempt == attempt]


def step_result(step: int) -> JSONValue:
    return {"step": step, "square": step * step}


def register(app: Moorline, name: str, scenario: Scenario, recorder: Recorder) -> None:
    @app.workflow(name, max_attempts=MAX_CRASHES + 2)
    async def crashing(ctx: Context) -> JSONValue:
        number = ctx.attempt - 1
        crash = scenario.crashes[number] if number < len(scenario.crashes) else None
        attempt_task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        assert attempt_task is not None

        def body(step: int) -> JSONValue:
            recorder.record(Call(ctx.attempt, step, ctx.idempotency_key()))
            if crash == Crash("inside", step):
                raise WorkerDied(f"inside step {step}")
            if crash == Crash("cut", step):
                # Lands before the result reaches the engine, or at its checkpoint's first
                # await: either way nothing of this step is recorded.
                loop.call_soon_threadsafe(attempt_task.cancel)
            return step_result(step)

        def sync_step(step: int) -> JSONValue:
            return body(step)

        async def async_step(step: int) -> JSONValue:
            return body(step)

        results: list[JSONValue] = []
        for step in range(scenario.steps):
            if crash == Crash("before", step):
                raise WorkerDied(f"before step {step}")
            fn = sync_step if scenario.sync[step] else async_step
            results.append(await ctx.step(f"s{step}", fn, step))
        if crash == Crash("before", scenario.steps):
            raise WorkerDied("after the last step")
        return results


class Crasher:
    """One tenant and lane; runs a scenario attempt by attempt through the real engine."""

    def __init__(
        self, db: DatabaseManager, store: RuntimeStore, settings: Settings, tenant: TenantId
    ) -> None:
        self.db = db
        self.store = store
        self.settings = settings
        self.tenant = tenant
        self.lane = unique("lane")
        self.queue = QueueRepo(db)
        self.steps = StepsRepo(db)

    async def new_run(self, workflow: str) -> RunId:
        [run_id] = await add_runs(self.db, self.tenant, self.lane, 1, max_attempts=MAX_CRASHES + 2)
        async with self.db.transaction() as conn:
            await conn.execute(update(runs).where(runs.c.id == run_id).values(workflow=workflow))
        return run_id

    async def claim(self, run_id: RunId) -> Claim:
        [claim] = await self.queue.claim_batch(
            self.lane, unique("worker"), limit=1, lease_ttl_s=LEASE_TTL_S, tenant_caps=NO_CAP
        )
        assert claim.fence.run_id == run_id
        return claim

    async def attempt(self, runner: WorkflowRunner, claim: Claim) -> JSONValue | None:
        """One attempt; its output, or None when it died."""
        task = asyncio.create_task(runner.run(claim))
        done, _ = await asyncio.wait([task], timeout=ATTEMPT_TIMEOUT_S)
        assert done, f"attempt {claim.fence.attempt} hung"
        # As the worker does after every attempt; for a dead process, the store's TTL does
        # the same before the reaper (same TTL, database clock) hands the run on.
        await runner.release(claim)
        if task.cancelled():
            return None
        error = task.exception()
        if isinstance(error, WorkerDied):
            return None
        if error is not None:
            raise error
        return task.result()

    async def reclaim(self, run_id: RunId) -> None:
        """The dead attempt's lease runs out and the reaper puts the run back in the queue."""
        await set_lease_expiry(self.db, [run_id], -60.0)
        reaped = await self.queue.reap_expired()
        assert [(r.run_id, r.status) for r in reaped] == [(run_id, RunStatus.QUEUED)]

    async def checkpointed(self, run_id: RunId) -> set[int]:
        return {
            int(step.key[1:])
            for step in await self.steps.list(run_id)
            if step.status is StepStatus.SUCCEEDED
        }


@pytest.fixture
def crash_store(backend: str, request: pytest.FixtureRequest) -> RuntimeStore:
    """The embedded database pairs with the in-memory store, a server database with Redis."""
    kind = "memory" if "embedded" in CAPABILITIES[backend] else "redis"
    store: RuntimeStore = request.getfixturevalue(f"{kind}_store")
    return store


@pytest.fixture
async def crasher(
    db: DatabaseManager, crash_store: RuntimeStore, settings: Settings
) -> AsyncIterator[Crasher]:
    tenants = Tenants(db)
    made = Crasher(db, crash_store, settings, await tenants.new())
    yield made
    await tenants.purge()


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(scenario=scenarios())
@example(scenario=Scenario((True,), ()))
@example(scenario=Scenario((True, False, True), (Crash("before", 0), Crash("inside", 0))))
@example(scenario=Scenario((False, True), (Crash("before", 2), Crash("cut", 1))))
@example(scenario=Scenario((True, False) * 10, (Crash("cut", 19), Crash("inside", 19))))
async def test_a_crashed_run_resumes_with_exactly_its_unfinished_steps(
    crasher: Crasher, scenario: Scenario
) -> None:
    recorder = Recorder()
    app = Moorline(crasher.settings)
    workflow = f"crashing_{uuid.uuid4().hex[:12]}"
    register(app, workflow, scenario, recorder)
    runner = WorkflowRunner(app, db=crasher.db, store=crasher.store, settings=crasher.settings)
    run_id = await crasher.new_run(workflow)

    output: JSONValue | None = None
    checkpointed_before: list[set[int]] = []  # what the database held when each attempt began
    while output is None:
        assert len(checkpointed_before) <= MAX_CRASHES, "more attempts than crashes"
        checkpointed_before.append(await crasher.checkpointed(run_id))
        claim = await crasher.claim(run_id)
        output = await crasher.attempt(runner, claim)
        if output is None:
            await crasher.reclaim(run_id)

    # A cut whose checkpoint landed shows as that step checkpointed before the next attempt.
    landed = frozenset(
        number
        for number, crash in enumerate(scenario.crashes[: len(checkpointed_before) - 1])
        if crash.where == "cut"
        and crash.step in checkpointed_before[number + 1] - checkpointed_before[number]
    )
    expected = model(scenario, landed)
    ran = [recorder.steps_of(attempt) for attempt in range(1, len(checkpointed_before) + 1)]
    assert ran == expected
    for attempt, (held, called) in enumerate(zip(checkpointed_before, ran, strict=True), 1):
        # A checkpointed step never runs again, and the unfinished ones run in order.
        assert not held & set(called), f"attempt {attempt} re-ran checkpointed steps"
        unfinished = [step for step in range(scenario.steps) if step not in held]
        assert called == unfinished[: len(called)], f"attempt {attempt} skipped a step"
    assert set(ran[-1]) | checkpointed_before[-1] == set(range(scenario.steps))

    keys: dict[int, set[str]] = {}
    for call in recorder.calls:
        keys.setdefault(call.step, set()).add(call.idempotency_key)
    assert keys == {step: {f"{run_id}:s{step}"} for step in keys}

    assert output == [step_result(step) for step in range(scenario.steps)]
    last_run = {call.step: call.attempt for call in recorder.calls}
    stored = await crasher.steps.list(run_id)
    assert {int(step.key[1:]): (step.status, step.attempt) for step in stored} == {
        step: (StepStatus.SUCCEEDED, last_run[step]) for step in range(scenario.steps)
    }
    finished = await RunsRepo(crasher.db).finish_many([Succeeded(fence=claim.fence, output=output)])
    assert finished == [True]
    await crasher.store.cleanup_run(run_id)
