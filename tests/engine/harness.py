"""Runs executed by the real runner (or a real Worker) over a real database and RuntimeStore.

Runs are stored through :class:`RunsRepo` (so conversation admission applies) and claimed for
real; a reclaim puts the run back to ``queued`` and claims it again, which fences the earlier
attempt out exactly as the reaper would.
"""

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager

from sqlalchemy import select

from moorline.db.manager import DatabaseManager
from moorline.db.repos.events import EventsRepo
from moorline.db.repos.parking import ParkingRepo
from moorline.db.repos.queue import Claim, QueueRepo
from moorline.db.repos.records import Event
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.db.schema import runs
from moorline.dispatch.leader import LeaderElector
from moorline.dispatch.retry import RetryPolicy
from moorline.dispatch.timers import TimerSweep
from moorline.engine.inbox import Inbox
from moorline.engine.registry import Moorline
from moorline.engine.runner import WorkflowRunner
from moorline.engine.streams import EventStreams
from moorline.errors import BackendUnavailable
from moorline.llm.governance import CallHook
from moorline.runtime.base import LeaseAcquisition, RuntimeStore, WindowChange
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.settings import Settings
from moorline.types import JSONObject, RunId, RunStatus, TenantId
from moorline.worker.worker import Worker
from tests.contract.queue_helpers import NO_CAP, Tenants, no_caps, requeue_all, unique
from tests.helpers import wait_for


class CountingStore(InMemoryRuntimeStore):
    """The in-memory store, recording its batches of window changes; while ``gate`` is set to
    an event, each batch waits for it (one never set: the store hangs); while ``unreachable``
    is true, window changes, lease acquisitions and cancel watches fail as a store that cannot be
    reached."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[WindowChange]] = []
        self.gate: asyncio.Event | None = None
        self.unreachable = False

    async def change_windows(self, changes: Sequence[WindowChange], ttl_s: float) -> list[bool]:
        self.batches.append(list(changes))
        if self.gate is not None:
            await self.gate.wait()
        self._fail_if_unreachable()
        return await super().change_windows(changes, ttl_s)

    async def acquire_lease(self, key: str, holder: str, ttl_s: float) -> LeaseAcquisition:
        self._fail_if_unreachable()
        return await super().acquire_lease(key, holder, ttl_s)

    async def wait_cancelled(self, run_id: RunId, timeout_s: float) -> bool:
        self._fail_if_unreachable()
        return await super().wait_cancelled(run_id, timeout_s)

    def _fail_if_unreachable(self) -> None:
        if self.unreachable:
            raise BackendUnavailable("the test's runtime store is unreachable")


class EngineHarness:
    """One lane, an app to register workflows on, the API-side services, claims by hand."""

    def __init__(
        self,
        db: DatabaseManager,
        store: RuntimeStore,
        tenants: Tenants,
        *,
        lease_ttl_s: float = 30.0,
        event_batch_size: int = 256,
        event_flush_interval_s: float = 0.05,
        park_after_s: float = 2.0,
        step_start_after_s: float = 0.0,
    ) -> None:
        self.db = db
        self.store = store
        self.tenants = tenants
        self.settings = Settings(
            lease_ttl=lease_ttl_s, park_after=park_after_s, step_start_after=step_start_after_s
        )
        self.app = Moorline(self.settings)
        self.runner = WorkflowRunner(
            self.app,
            db=db,
            store=store,
            settings=self.settings,
            event_batch_size=event_batch_size,
            event_flush_interval_s=event_flush_interval_s,
        )
        self.lane = unique("lane")
        self.queue = QueueRepo(db)
        self.runs = RunsRepo(db)
        self.events = EventsRepo(db)
        self.inbox = Inbox(db, store)
        self.streams = EventStreams(db, store, poll_interval_s=0.2)
        self.tenant: TenantId | None = None

    async def new_run(
        self, workflow: str, *, conversation_id: str | None = None, input: JSONObject | None = None
    ) -> RunId:
        if self.tenant is None:
            self.tenant = await self.tenants.new()
        [run] = await self.runs.submit_many(
            [
                NewRun(
                    tenant_id=self.tenant,
                    workflow=workflow,
                    input=input or {},
                    lane=self.lane,
                    conversation_id=conversation_id,
                )
            ]
        )
        return run.run_id

    async def claim(self) -> Claim:
        [claim] = await self.queue.claim_batch(
            self.lane, unique("owner"), limit=1, lease_ttl_s=30.0, tenant_caps=NO_CAP
        )
        return claim

    async def reclaim(self) -> Claim:
        """Take the run from its current attempt and claim it again (attempt + 1)."""
        assert self.tenant is not None
        await requeue_all(self.db, self.tenant)
        return await self.claim()

    async def status(self, run_id: RunId) -> RunStatus:
        async with self.db.connect() as conn:
            value = await conn.execute(select(runs.c.status).where(runs.c.id == run_id))
            return RunStatus(value.scalar_one())

    async def stored(self, run_id: RunId, event_type: str | None = None) -> list[Event]:
        events = await self.events.list(run_id)
        return [e for e in events if event_type is None or e.type == event_type]

    @asynccontextmanager
    async def worker(
        self,
        *,
        slots: int = 4,
        tenant_caps: Callable[[], Awaitable[Mapping[str, int]]] = no_caps,
    ) -> AsyncIterator[Worker]:
        """A real Worker on the lane, stopped (gracefully) when the block ends."""
        worker = Worker(
            self.db,
            self.runner,
            lanes={self.lane: slots},
            lease_ttl_s=self.settings.lease_ttl,
            tenant_caps=tenant_caps,
            retry_policy=RetryPolicy(base_s=0.0, cap_s=0.0),
            poll_interval_s=0.05,
            grace_s=5.0,
        )
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        try:
            yield worker
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)

    def use_call_hook(self, hook: CallHook) -> None:
        """Run the workflows with ``hook`` governing their model calls (a worker's governor)."""
        self.runner = WorkflowRunner(
            self.app, db=self.db, store=self.store, settings=self.settings, call_hook=hook
        )

    def timer_sweep(self) -> TimerSweep:
        """A timer sweep of its own (its own leader lease), ticked by the test."""
        elector = LeaderElector(self.queue, name=unique("timers"), holder="test", ttl_s=30)
        return TimerSweep(ParkingRepo(self.db), elector, interval_s=0.1)

    async def waiting_for_or_none(self, run_id: RunId) -> object:
        """The run's stored ``waiting_for`` (None unless it is waiting)."""
        async with self.db.connect() as conn:
            found = await conn.execute(select(runs.c.waiting_for).where(runs.c.id == run_id))
            return found.scalar_one()

    async def waiting_for(self, run_id: RunId) -> dict[str, object]:
        """The ``waiting_for`` of a run that is waiting."""
        value = await self.waiting_for_or_none(run_id)
        assert isinstance(value, dict), value
        return value

    async def until_status(self, run_id: RunId, status: RunStatus, timeout_s: float = 20) -> None:
        async def reached() -> bool:
            return await self.status(run_id) is status

        try:
            await wait_for(reached, timeout_s=timeout_s, message=f"run {run_id} to be {status}")
        except AssertionError as exc:
            # Where it stopped instead, for the failure's reader (a run that went past the
            # status awaited, say).
            raise AssertionError(f"{exc}; it is {await self.status(run_id)}") from None
