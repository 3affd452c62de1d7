"""The example app on a real Worker, over the embedded backend: SQLite and the in-memory store.

The examples exercise workflows, not backends (the engine's own tests cover those on every
database and Redis), so this package runs on SQLite only: ``backend`` is pinned here.
"""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from moorline.db.manager import DatabaseManager
from moorline.db.repos.events import EventsRepo
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.records import DecisionReason, Event, Interrupt, Run
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.db.repos.steps import StepsRepo
from moorline.dispatch.retry import RetryPolicy
from moorline.engine.inbox import Inbox
from moorline.engine.registry import Moorline
from moorline.engine.runner import WorkflowRunner
from moorline.examples.app import build_app
from moorline.llm import LLM, SimulatedLLM
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.settings import Settings
from moorline.types import JSONObject, JSONValue, RunId, TenantId
from moorline.worker.worker import Worker
from tests.contract.queue_helpers import Tenants, no_caps, unique
from tests.helpers import wait_for


@pytest.fixture(scope="module")
def backend() -> str:
    return "sqlite"


def fast_model() -> SimulatedLLM:
    """The simulated model without its latency."""
    return SimulatedLLM(first_token_s=0, word_interval_s=0)


class Deployment:
    """The example app (with a given model), a tenant, a lane and a worker serving it."""

    def __init__(
        self,
        db: DatabaseManager,
        store: InMemoryRuntimeStore,
        settings: Settings,
        tenant: TenantId,
        llm: LLM,
    ) -> None:
        self.db = db
        self.store = store
        self.tenant = tenant
        self.settings = settings
        self.app: Moorline = build_app(settings, llm=llm)
        self.lane = unique("examples")
        self.runs = RunsRepo(db)
        self.steps = StepsRepo(db)
        self.interrupts = InterruptsRepo(db)

    async def submit(self, workflow: str, **arguments: JSONValue) -> RunId:
        """Store a run as admission does: its input validated against the workflow first."""
        checked = self.app.get(workflow).validate_input(arguments)
        new = NewRun(tenant_id=self.tenant, workflow=workflow, input=checked, lane=self.lane)
        [run] = await self.runs.submit_many([new])
        return run.run_id

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[Worker]:
        """A worker on the lane until the block ends; failed attempts retry at once."""
        runner = WorkflowRunner(self.app, db=self.db, store=self.store, settings=self.settings)
        worker = Worker(
            self.db,
            runner,
            lanes={self.lane: 4},
            lease_ttl_s=30.0,
            tenant_caps=no_caps,
            poll_interval_s=0.05,
            retry_policy=RetryPolicy(base_s=0.01, cap_s=0.01),
        )
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        try:
            yield worker
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)

    async def finished(self, run_id: RunId, timeout_s: float = 20.0) -> Run:
        async def ended() -> Run | None:
            run = await self.runs.get(run_id)
            return run if run is not None and run.status.is_terminal else None

        run = await wait_for(ended, timeout_s=timeout_s, message=f"run {run_id} to end")
        assert run is not None
        return run

    async def pending(self, run_id: RunId) -> Interrupt:
        """The interrupt the run waits on, once it asks."""

        async def asking() -> list[Interrupt]:
            return await self.interrupts.pending_for_run(run_id)

        [interrupt] = await wait_for(asking, message=f"run {run_id} to ask permission")
        return interrupt

    async def decide(self, interrupt: Interrupt, *, approved: bool) -> None:
        """Approve or deny as ``POST /v1/runs/{id}/resume`` does: database, then wake-up."""
        reason = DecisionReason.APPROVED if approved else DecisionReason.DENIED
        await self.interrupts.resolve(
            interrupt.run_id, interrupt.interrupt_id, approved=approved, reason=reason, data=None
        )
        decision: JSONObject = {"approved": approved, "reason": reason.value, "data": None}
        await self.store.resolve_interrupt(interrupt.run_id, interrupt.interrupt_id, decision)

    async def step_done(self, run_id: RunId, key: str) -> None:
        async def done() -> bool:
            step = await self.steps.get(run_id, key)
            return step is not None and step.status.value == "succeeded"

        await wait_for(done, message=f"step {key!r} of run {run_id}")

    async def step_keys(self, run_id: RunId) -> list[str]:
        """The workflow's own steps, in order (message drains, checkpoints too, left out)."""
        steps = await self.steps.list(run_id)
        return [step.key for step in steps if not step.key.startswith("moorline.")]

    async def post(self, run_id: RunId, content: str) -> None:
        """Inject a message into the running run, as ``POST /v1/runs/{id}/messages`` does."""
        await Inbox(self.db, self.store).post_message(self.tenant, run_id, content)

    async def events(self, run_id: RunId, event_type: str | None = None) -> list[Event]:
        found = await EventsRepo(self.db).list(run_id)
        return [event for event in found if event_type is None or event.type == event_type]

    async def delta_text(self, run_id: RunId, **tags: JSONValue) -> str:
        """The text of the run's ``delta`` events whose data has ``tags``, in order."""
        deltas = await self.events(run_id, "delta")
        picked = [
            event.data
            for event in deltas
            if isinstance(event.data, dict)
            and all(event.data.get(name) == value for name, value in tags.items())
        ]
        return "".join(str(data["text"]) for data in picked if isinstance(data, dict))


@pytest.fixture
async def store() -> AsyncIterator[InMemoryRuntimeStore]:
    memory = InMemoryRuntimeStore()
    yield memory
    await memory.close()


@pytest.fixture
async def tenant(db: DatabaseManager) -> AsyncIterator[TenantId]:
    made = Tenants(db)
    yield await made.new()
    await made.purge()


@pytest.fixture
def deployment(
    db: DatabaseManager, store: InMemoryRuntimeStore, settings: Settings, tenant: TenantId
) -> Deployment:
    """The example app with the simulated model (no latency) on a worker."""
    return Deployment(db, store, settings, tenant, fast_model())
