"""The scheduler: a leader-elected chore that fires the schedules' due ticks through admission.

Every process that runs chores (``moorline worker`` and ``moorline serve``) runs this loop; the
one that leads its lease (``scheduler``) makes a pass every ``MOORLINE_SCHEDULER_INTERVAL``
seconds: it reads the unpaused schedules whose ``next_at`` has come, works out each one's due
ticks (:func:`~moorline.dispatch.cron.due_ticks`: those on time, and a missed one under
``catch_up: one``), and submits one run per tick through :meth:`Admission.admit`, the path of
every trigger, so the tenant's rate limit and daily quota apply. A tick admission refuses is
counted on the schedule (``refused``, ``last_error``) and not tried again.

**Each tick fires exactly once, whoever leads and whenever a leader dies.**

- *Never twice.* A tick's run carries the idempotency key ``schedule:<id>:<tick time>``, and
  ``(tenant_id, idempotency_key)`` is unique in the runs table. Whoever submits the tick again
  (a successor of a leader that died after storing the run, or a second process that believes
  it leads) gets the stored run back instead of a new one.
- *Never lost.* ``next_at`` moves past a tick only after its run is durably stored (admission
  returns once the run's transaction committed), in one statement conditional on ``next_at``
  still being what the pass read (:meth:`SchedulesRepo.advance`). A leader that dies before
  that statement leaves ``next_at`` where it was, and its successor (within the leader lease's
  TTL, far inside ``MOORLINE_SCHEDULE_GRACE``) submits the same ticks again: those already
  stored come back under their key, the others are stored now. The counts move in the same
  statement as ``next_at``, so of two passes over the same ticks only one counts them.

What is not exactly once: a tick refused by the daily quota stores a ``rate_limited`` run
without its key (admission's rule), so a leader dying between that refusal and the advance lets
its successor ask again, which may store a second ``rate_limited`` run for the tick (never a
second accepted one). A pause or a delete that lands while a pass fires a schedule's tick
lets that one tick through.
"""

import asyncio
import logging
from collections.abc import Callable
from datetime import UTC, datetime

from moorline.admission.admit import Admission
from moorline.admission.triggers import Trigger
from moorline.db.manager import DatabaseManager
from moorline.db.repos.queue import QueueRepo
from moorline.db.repos.schedules import Outcome, Schedule, SchedulesRepo
from moorline.db.repos.tenants import TenantsRepo
from moorline.dispatch.chores import LeaderChore
from moorline.dispatch.cron import Cadence, CatchUp, due_ticks
from moorline.dispatch.leader import LeaderElector, new_holder_id
from moorline.dispatch.reaper import leader_ttl_s
from moorline.engine.registry import Moorline
from moorline.errors import BackendUnavailable, MoorlineError
from moorline.observability.metrics import Metrics
from moorline.plans import PlansProvider
from moorline.settings import Settings
from moorline.types import JSONObject

logger = logging.getLogger(__name__)

LEADER_LEASE = "scheduler"
"""Name of the scheduler's row in ``leader_leases``."""

DUE_BATCH = 100
"""Schedules read per statement; a pass reads batches until one comes back short."""

TICKS_PER_PASS = 100
"""Ticks of one schedule fired per pass at most; the rest come in the next pass."""


def tick_key(schedule_id: str, tick: datetime) -> str:
    """The idempotency key of a tick's run: the schedule and the tick's UTC time."""
    return f"schedule:{schedule_id}:{tick.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}"


def cadence_of(schedule: Schedule) -> Cadence:
    """The stored schedule's timing."""
    return Cadence(cron=schedule.cron, every_s=schedule.every_s, timezone=schedule.timezone)


class Scheduler(LeaderChore):
    """Every ``interval_s``: if this process leads, fire every schedule's due ticks."""

    name = "scheduler"

    def __init__(
        self,
        schedules: SchedulesRepo,
        elector: LeaderElector,
        *,
        admission: Admission,
        workflows: Moorline,
        tenants: TenantsRepo,
        plans: PlansProvider,
        interval_s: float,
        grace_s: float,
        clock: Callable[[], datetime] | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        """Create a scheduler; see :func:`make_scheduler` for one built from the settings.

        Args:
            schedules: The schedules repository.
            elector: Decides whether this process acts; resigned on stop.
            admission: Decides and stores each tick's run.
            workflows: The app whose workflows the schedules name.
            tenants: Where a schedule's tenant's plan is read.
            plans: The plans (lane, quota, rate limit).
            interval_s: Seconds between passes.
            grace_s: Seconds late a tick may still fire (``MOORLINE_SCHEDULE_GRACE``).
            clock: Aware UTC now, replaceable in tests.
            metrics: Where ticks are counted (``moorline_schedule_ticks_total``).
        """
        super().__init__(elector, interval_s=interval_s)
        self._schedules = schedules
        self._admission = admission
        self._workflows = workflows
        self._tenants = tenants
        self._plans = plans
        self._grace_s = grace_s
        self._clock = clock or (lambda: datetime.now(UTC))
        self._ticks = (metrics or Metrics()).schedule_ticks

    async def tick(self) -> list[Outcome]:
        """One pass: nothing unless this process leads, else fire every due tick."""
        return await self._pass(None)

    async def _pass(self, stop: asyncio.Event | None) -> list[Outcome]:
        if not await self.elector.tick():
            return []
        outcomes: list[Outcome] = []
        now = self._clock()
        while stop is None or not stop.is_set():
            batch = await self._schedules.due(now, limit=DUE_BATCH)
            for schedule in batch:
                outcome = await self._fire(schedule, now)
                if await self._schedules.advance(schedule, outcome):
                    outcomes.append(outcome)
                    # Counted once, by the pass whose advance won (as on the schedule).
                    self._ticks.labels(outcome="fired").inc(outcome.fired)
                    self._ticks.labels(outcome="refused").inc(outcome.refused)
            if len(batch) < DUE_BATCH:
                break
        return outcomes

    async def _fire(self, schedule: Schedule, now: datetime) -> Outcome:
        """Submit the schedule's due ticks; what happened, and its next tick."""
        ticks, following = due_ticks(
            cadence_of(schedule),
            schedule.next_at,
            now,
            grace_s=self._grace_s,
            catch_up=CatchUp(schedule.catch_up),
            limit=TICKS_PER_PASS,
        )
        fired = refused = 0
        last_fired: datetime | None = None
        last_run: str | None = None
        last_error: JSONObject | None = None
        for tick in ticks:
            try:
                run_id = await self._submit(schedule, tick)
            except BackendUnavailable:
                raise  # nothing advances: the next pass (or leader) submits these ticks again
            except MoorlineError as exc:
                refused += 1
                last_error = {"code": exc.code, "message": exc.message, "tick": _text(tick)}
                logger.info(
                    "schedule %s: tick %s refused: %s",
                    schedule.schedule_id,
                    _text(tick),
                    exc.code,
                    extra={"tenant_id": schedule.tenant_id},
                )
                continue
            fired += 1
            last_fired, last_run = tick, run_id
        return Outcome(
            next_at=following,
            fired=fired,
            refused=refused,
            last_fired_at=last_fired,
            last_run_id=last_run,
            last_error=last_error,
        )

    async def _submit(self, schedule: Schedule, tick: datetime) -> str:
        """Store the tick's run through admission (or find it stored); its id."""
        tenant = await self._tenants.get(schedule.tenant_id)
        if tenant is None:  # pragma: no cover - a tenant's schedules go with it (CASCADE)
            raise BackendUnavailable(f"schedule {schedule.schedule_id} lost its tenant")
        admitted = await self._admission.admit(
            Trigger(
                tenant_id=tenant.tenant_id,
                plan=await self._plans.get(tenant.plan),
                rate_identity=f"schedule:{schedule.schedule_id}",
                workflow=self._workflows.get(schedule.workflow),
                input=schedule.input,
                idempotency_key=tick_key(schedule.schedule_id, tick),
            )
        )
        return admitted.run.run_id


def _text(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def make_scheduler(
    settings: Settings,
    db: DatabaseManager,
    *,
    admission: Admission,
    workflows: Moorline,
    holder: str | None = None,
    metrics: Metrics | None = None,
) -> Scheduler:
    """A scheduler for this process, with its interval, grace and a leader lease to match."""
    interval_s = settings.scheduler_interval
    elector = LeaderElector(
        QueueRepo(db),
        name=LEADER_LEASE,
        holder=holder if holder is not None else new_holder_id(),
        ttl_s=leader_ttl_s(interval_s, settings.lease_ttl),
    )
    return Scheduler(
        SchedulesRepo(db),
        elector,
        admission=admission,
        workflows=workflows,
        tenants=TenantsRepo(db),
        plans=PlansProvider(settings),
        interval_s=interval_s,
        grace_s=settings.schedule_grace,
        metrics=metrics,
    )
