"""The Hypothesis state machine that drives the real repositories beside ``run_model.RunModel``.

One rule is one thing a part of Moorline does to runs: the API submits, admits and cancels;
workers claim, heartbeat, run steps, ask for approval, park, finish or release attempts,
crash, pause and resume; a person decides an approval; time passes; the reaper reaps; the
timer sweep re-queues or times out waiting runs. Every rule calls the real repository
(``RunsRepo``, ``QueueRepo``, ``StepsRepo``, ``InterruptsRepo``, ``ParkingRepo``,
``moorline.dispatch.cancel.cancel_run``, ``moorline.dispatch.timers.TimerSweep``), applies
the same event to the model and asserts that the repository answered what the model
predicts. After every rule ``agrees_with_database`` (``checks.py``) reads the database
(``observe.py``) and checks the invariants; ``test_run_state_machine.py`` lists them.

**Workers** are three slots. A worker holds the fences of the attempts it believes it runs,
each with its position in ``run_model.WORKFLOW``; it forgets one when a write tells it the
lease is lost, and when it finished or released the attempt. A paused worker keeps its fences
and neither heartbeats nor writes until it resumes; a crashed one is replaced by a fresh
process (new owner id), and its leases are simply never renewed again.

**Time.** Leases, retry delays, approval deadlines, waiting runs' timers and runs' deadlines
are granted ``LONG_S`` of database time, which no example lasts; ``advance_clock`` moves the
model's logical clock and rewrites, by SQL, the ones it passed to ``PAST_S`` before database
time. The repositories' own predicates against the database clock (``lease_expires_at <
now``, ``not_before <= now``, ``expires_at > now``, ``wake_at <= now``) still decide; only
the passing of time is simulated, deterministically and without sleeping.

**Shape of the examples.** Hypothesis picks uniformly among the enabled rules, so each rule
acts only in the states where it means something (``when``: a claim needs a claimable run, a
heartbeat a held lease, ``finish`` an attempt that returned or raised) and does nothing
otherwise; every example starts with a run already claimed (``start_running``, at a random
point of its workflow, parked and resumed included); and one cancel per example at most:
ending rules apply in almost every state and would otherwise end most runs before their
attempts get anywhere.
"""

import functools
import uuid
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule
from sqlalchemy import delete, update

from moorline.db.repos.interrupts import InterruptResolved, InterruptsRepo
from moorline.db.repos.messages import MessagesRepo
from moorline.db.repos.parking import ParkingRepo, Wait, WaitKind
from moorline.db.repos.queue import QueueRepo
from moorline.db.repos.records import DecisionReason, Fence, InterruptStatus
from moorline.db.repos.runs import Failed, NewRun, Outcome, RunsRepo, Stopped, Succeeded
from moorline.db.repos.steps import CancelRequested, LeaseLost, StepsRepo
from moorline.db.schema import interrupts, runs
from moorline.dispatch.cancel import cancel_run
from moorline.errors import RunFinished, RunNotFound, RunNotInteractive
from moorline.types import JSONObject, RunId, RunStatus, StepStatus, TenantId
from tests.contract.queue_helpers import NO_CAP, unique
from tests.model.backend import LONG_S, PAST_S, Backend
from tests.model.checks import DatabaseChecks, Seen
from tests.model.observe import Observation
from tests.model.run_model import (
    END,
    I0,
    WORKFLOW,
    Kind,
    ModelInterrupt,
    Park,
    Passed,
    Progress,
    RunModel,
    StepStart,
    Worker,
    next_position,
)

T = TypeVar("T")
M = TypeVar("M", bound="RunMachine")

WORKERS = 3
MAX_RUNS = 3
MAX_RESOLUTIONS = 2
"""Decisions sent per example: the second one may conflict with the first."""

STEP_POSITIONS = tuple(i for i, item in enumerate(WORKFLOW) if item != I0)
APPROVAL_POSITION = WORKFLOW.index(I0)

PICK = st.integers(0, 11)
"""Chooses among a rule's candidates, modulo their number (shrinks towards the first)."""

KINDS = st.sampled_from(
    ["succeeded", "retry_now", "retry_later", "failed", "timed_out", "cancelled"]
)


def when(
    applies: Callable[[M], object],
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A rule that does nothing (no database call, no model change) unless ``applies``.

    Not Hypothesis's ``precondition``: when swarm testing leaves no enabled rule whose
    precondition holds, Hypothesis throws the example away as invalid, after its setup and
    steps ran; with preconditions on most rules that cost a third more examples here. A
    step that does nothing costs no database round trip (the last check's read is reused).
    """

    def decorate(fn: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(fn)
        def guarded(self: M, **arguments: Any) -> None:
            if applies(self):
                fn(self, **arguments)

        return guarded

    return decorate


def call_hash(key: str) -> str:
    return f"{key:0>64}"


def step_output(key: str) -> JSONObject:
    return {"step": key}


class RunMachine(DatabaseChecks, RuleBasedStateMachine):
    def __init__(self, backend: Backend) -> None:
        super().__init__()
        self.backend = backend
        db = backend.db
        self.runs = RunsRepo(db)
        self.queue = QueueRepo(db)
        self.steps = StepsRepo(db)
        self.interrupts = InterruptsRepo(db)
        self.parking = ParkingRepo(db)
        self.messages = MessagesRepo(db)
        self.tenant = backend.tenant
        self.lane = unique("lane")
        self.model = RunModel()
        self.workers = [Worker(slot) for slot in range(WORKERS)]
        self.seen: dict[RunId, Seen] = {}
        self.observed: Observation | None = None
        self.has_cancelled = False
        self.resolutions = 0

    def sync(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run a rule's database call; what the last check read may be out of date now."""
        self.observed = None
        return self.backend.sync(coroutine)

    def teardown(self) -> None:
        self.backend.sync(self._end_example())

    def is_inert(self) -> bool:
        """Whether this example's rows may stay: no later example can see them.

        Examples keep to their own lanes, and read runs by lane, except for the reaper (which
        takes running runs whose lease a tick moved into the past), approval expiry (which
        takes pending approvals past their deadline) and the timer sweep (which takes waiting
        runs whose timer a tick made due). With no run running or waiting and no approval
        pending, the rows are inert, and the delete (one write transaction, a tenth of an
        example's cost) is left to the module's end.
        """
        return not any(
            run.status in (RunStatus.RUNNING, RunStatus.WAITING)
            or (run.interrupt is not None and run.interrupt.status is InterruptStatus.PENDING)
            for run in self.model.runs.values()
        )

    async def _end_example(self) -> None:
        if not self.is_inert():
            async with self.backend.db.transaction() as conn:
                # Steps, events and interrupts go with their runs (ON DELETE CASCADE).
                await conn.execute(delete(runs).where(runs.c.lane == self.lane))
        for run_id in self.model.runs:
            await self.backend.store.cleanup_run(run_id)

    # --- choosing -----------------------------------------------------------------------------

    def _run(self, pick: int) -> RunId:
        ids = list(self.model.runs)
        return ids[pick % len(ids)]

    def _workers(self, state: str) -> list[Worker]:
        return [worker for worker in self.workers if worker.state == state]

    def _attempts(self) -> list[tuple[Fence, Progress]]:
        """The attempts live workers hold, as they see them."""
        return [
            (fence, progress)
            for worker in self._workers("alive")
            for fence, progress in worker.held.items()
        ]

    def _stepping(self) -> list[tuple[Fence, Progress]]:
        """Attempts with a step in flight or next."""
        return [
            (fence, progress)
            for fence, progress in self._attempts()
            if progress.in_flight is not None or progress.position in STEP_POSITIONS
        ]

    def _asking(self) -> list[tuple[Fence, Progress]]:
        return [(f, p) for f, p in self._attempts() if p.position == APPROVAL_POSITION]

    def _done(self) -> list[tuple[Fence, Progress]]:
        """Attempts whose workflow returned (at ``END``) or raised."""
        return [(f, p) for f, p in self._attempts() if p.position == END or p.has_raised]

    def _drop(self, fence: Fence) -> None:
        """The worker learnt the attempt is over (lost, finished, released): it forgets it."""
        for worker in self.workers:
            worker.held.pop(fence, None)

    def has(self, *statuses: RunStatus) -> bool:
        return any(run.status in statuses for run in self.model.runs.values())

    def has_pending_interrupt(self) -> bool:
        return any(
            run.interrupt is not None and run.interrupt.status is InterruptStatus.PENDING
            for run in self.model.runs.values()
        )

    def can_resolve(self) -> bool:
        has_interrupt = any(run.interrupt for run in self.model.runs.values())
        return has_interrupt and self.resolutions < MAX_RESOLUTIONS

    def is_waiting_on_time(self) -> bool:
        """Something a tick can change: a lease, a retry delay, an approval's deadline, a
        waiting run's timer, a run's deadline."""
        delayed = any(
            run.due_tick is not None or (run.deadline_tick is not None and not run.is_deadline_past)
            for run in self.model.runs.values()
            if not run.status.is_terminal
        )
        running_or_waiting = self.has(RunStatus.RUNNING, RunStatus.WAITING)
        return running_or_waiting or delayed or self.has_pending_interrupt()

    # --- submission and admission -------------------------------------------------------------

    @initialize(
        max_attempts=st.integers(1, 3),
        progress=st.integers(0, 6),
        timeout_ticks=st.integers(1, 3),
        deadline_ticks=st.sampled_from([None, 1, 2]),
    )
    def start_running(
        self,
        max_attempts: int,
        progress: int,
        timeout_ticks: int = 3,
        deadline_ticks: int | None = None,
    ) -> None:
        """A run claimed by worker 0, then taken ``progress`` actions along its workflow:
        ``s0`` done; the approval asked for (``timeout_ticks``); then either (3) approved by
        a person and seen by the worker, or (4) the run parked for it, ``waiting`` (with a
        deadline if ``deadline_ticks``), (5) approved by a person, which queues it to resume,
        and (6) claimed again by worker 1: an attempt that does not count against the budget.
        """
        self.submit(max_attempts=max_attempts, pending=False)
        self.claim(worker=0, limit=1)
        if progress >= 1:
            self.complete_step(pick=0)
        if progress >= 2:
            self.request_approval(pick=0, timeout_ticks=timeout_ticks)
        if progress == 3:
            self.resolve_approval(run=0, reason=DecisionReason.APPROVED, with_data=False)
            self.request_approval(pick=0, timeout_ticks=3)
        if progress >= 4:
            self.park(pick=0, deadline_ticks=deadline_ticks)
        if progress >= 5:
            self.resolve_approval(run=0, reason=DecisionReason.APPROVED, with_data=False)
        if progress == 6:
            self.claim(worker=1, limit=1)

    @rule(max_attempts=st.integers(1, 3), pending=st.sampled_from([False, False, True]))
    @when(lambda self: len(self.model.runs) < MAX_RUNS)
    def submit(self, max_attempts: int, pending: bool) -> None:
        new = NewRun(
            tenant_id=self.tenant,
            workflow="model",
            input={},
            lane=self.lane,
            max_attempts=max_attempts,
        )
        insert = self.runs.insert_pending if pending else self.runs.submit_many
        [stored] = self.sync(insert([new]))
        self.model.submit(stored.run_id, max_attempts, pending=pending)
        assert stored.status is self.model.run(stored.run_id).status

    @rule(run=PICK, admitted=st.sampled_from([True, True, False]))
    @when(lambda self: self.has(RunStatus.PENDING))
    def admit(self, run: int, admitted: bool) -> None:
        """Admission decides about a run (any run: only a pending one may move)."""
        run_id = self._run(run)
        if admitted:
            moved = self.sync(self.runs.enqueue([run_id]))
            assert (moved == [run_id]) == self.model.enqueue(run_id)
        else:
            refused = self.sync(self.runs.mark_rate_limited(run_id, {"reason": "rate limited"}))
            assert refused == self.model.rate_limit(run_id)

    # --- workers ------------------------------------------------------------------------------

    @rule(worker=st.integers(0, WORKERS - 1), limit=st.integers(1, 3))
    @when(lambda self: self._workers("alive") and self.model.claimable())
    def claim(self, worker: int, limit: int) -> None:
        alive = self._workers("alive")
        claimer = alive[worker % len(alive)]
        owner = claimer.owner(self.lane)
        claimable = self.model.claimable()
        claims = self.sync(
            self.queue.claim_batch(
                self.lane, owner, limit=limit, lease_ttl_s=LONG_S, tenant_caps=NO_CAP
            )
        )
        assert len(claims) == min(limit, len(claimable)), (claims, claimable)
        for claim in claims:
            # Each claim takes the next attempt: the fencing token strictly increases.
            attempt = self.model.claim(claim.fence.run_id, owner)
            assert claim.fence == Fence(run_id=claim.fence.run_id, attempt=attempt, owner=owner)
            assert (claim.run.status, claim.run.attempt) == (RunStatus.RUNNING, attempt)
            # The worker's attempt budget is read from the claim: it must know the resumes.
            resumes = self.model.run(claim.fence.run_id).resumes
            assert claim.run.resumes == resumes
            claimer.held[claim.fence] = Progress(resumes=resumes)

    @rule(worker=st.integers(0, WORKERS - 1))
    @when(lambda self: self._attempts())
    def heartbeat(self, worker: int) -> None:
        holders = [w for w in self._workers("alive") if w.held]
        beating = holders[worker % len(holders)]
        fences = list(beating.held)
        renewal = self.sync(self.queue.renew_leases(fences, LONG_S))
        renewed, cancelled = self.model.renew(fences)
        assert renewal.renewed == renewed
        assert renewal.cancel_requested == cancelled
        for fence in fences:
            if (fence.run_id, fence.attempt) not in renewed:
                self._drop(fence)
            elif fence.run_id in cancelled:
                beating.held[fence].has_raised = True  # it stops the workflow: Cancelled

    @rule(worker=st.integers(0, WORKERS - 1))
    @when(lambda self: any(w.held or w.state == "paused" for w in self.workers))
    def crash_worker(self, worker: int) -> None:
        """The process dies (kill -9); a fresh one with a new owner id takes its slot."""
        busy = [w for w in self.workers if w.held or w.state == "paused"]
        dead = busy[worker % len(busy)]
        self.workers[dead.slot] = Worker(dead.slot, generation=dead.generation + 1)

    @rule(worker=st.integers(0, WORKERS - 1))
    @when(lambda self: self._attempts())
    def pause_worker(self, worker: int) -> None:
        """The process stops (SIGSTOP, a long GC, a partition) with its attempts in hand."""
        holders = [w for w in self._workers("alive") if w.held]
        holders[worker % len(holders)].state = "paused"

    @rule(worker=st.integers(0, WORKERS - 1))
    @when(lambda self: self._workers("paused"))
    def resume_worker(self, worker: int) -> None:
        """The paused process carries on, with fences that may have gone stale meanwhile."""
        paused = self._workers("paused")
        paused[worker % len(paused)].state = "alive"

    # --- steps --------------------------------------------------------------------------------

    def _start(self, fence: Fence, progress: Progress) -> bool:
        """Start the attempt's next step; whether it is in flight now (else replayed or not)."""
        key = WORKFLOW[progress.position]
        got: StepStart
        try:
            started = self.sync(self.steps.start(fence, key, f"fn_{key}", call_hash(key)))
        except LeaseLost:
            got = "lease_lost"
        except CancelRequested:
            got = "cancel_requested"
        else:
            got = "replay" if started.replay else "repeated" if started.repeated else "new"
        assert got == self.model.start_step(fence, key)
        if got == "lease_lost":
            self._drop(fence)
        elif got == "cancel_requested":
            progress.has_raised = True  # the workflow raises Cancelled
        elif got == "replay":
            assert started.step.output == step_output(key)
            progress.position += 1
        else:
            step = (started.step.status, started.step.attempt)
            assert step == (StepStatus.RUNNING, fence.attempt)
            progress.in_flight = key
            progress.has_raised = False
        return progress.in_flight is not None

    def _end_step(self, fence: Fence, progress: Progress, status: StepStatus) -> None:
        key = progress.in_flight
        assert key is not None
        try:
            if status is StepStatus.SUCCEEDED:
                self.sync(self.steps.succeed(fence, key, step_output(key)))
            else:
                self.sync(self.steps.fail(fence, key, "boom"))
        except LeaseLost:
            assert not self.model.finish_step(fence, key, status)
            self._drop(fence)
            return
        assert self.model.finish_step(fence, key, status)
        progress.in_flight = None
        if status is StepStatus.SUCCEEDED:
            progress.position += 1
        else:
            progress.has_raised = True

    def _step(self, pick: int, status: StepStatus) -> None:
        candidates = self._stepping()
        fence, progress = candidates[pick % len(candidates)]
        if progress.in_flight is not None or self._start(fence, progress):
            self._end_step(fence, progress, status)

    @rule(pick=PICK)
    @when(lambda self: any(p.in_flight is None for _, p in self._stepping()))
    def start_step(self, pick: int) -> None:
        """Start the next step and leave it in flight (a crash or a pause may follow)."""
        candidates = [(f, p) for f, p in self._stepping() if p.in_flight is None]
        fence, progress = candidates[pick % len(candidates)]
        self._start(fence, progress)

    @rule(pick=PICK)
    @when(lambda self: self._stepping())
    def complete_step(self, pick: int) -> None:
        """The step in flight, or else the next one, returns and is checkpointed."""
        self._step(pick, StepStatus.SUCCEEDED)

    @rule(pick=PICK)
    @when(lambda self: self._stepping())
    def fail_step(self, pick: int) -> None:
        """The step in flight, or else the next one, raises."""
        self._step(pick, StepStatus.FAILED)

    # --- approvals ----------------------------------------------------------------------------

    @rule(pick=PICK, timeout_ticks=st.integers(1, 3))
    @when(lambda self: self._asking())
    def request_approval(self, pick: int, timeout_ticks: int) -> None:
        """The workflow asks for permission (a replay gets the interrupt, and any decision)."""
        candidates = self._asking()
        fence, progress = candidates[pick % len(candidates)]
        try:
            opened = self.sync(self.interrupts.open(fence, I0, "approve", {}, LONG_S))
        except LeaseLost:
            assert self.model.open_interrupt(fence, "", timeout_ticks) == "lease_lost"
            self._drop(fence)
            return
        except CancelRequested:
            assert self.model.open_interrupt(fence, "", timeout_ticks) == "cancel_requested"
            progress.has_raised = True
            return
        expected = self.model.open_interrupt(fence, opened.interrupt_id, timeout_ticks)
        assert isinstance(expected, ModelInterrupt), expected
        assert (opened.interrupt_id, opened.attempt) == (expected.interrupt_id, expected.attempt)
        assert (opened.status, opened.reason) == (expected.status, expected.reason)
        progress.position = next_position(progress.position, expected)
        progress.has_asked = expected.status is InterruptStatus.PENDING

    @rule(run=PICK, reason=st.sampled_from(DecisionReason), with_data=st.booleans())
    @when(lambda self: self.can_resolve())
    def resolve_approval(self, run: int, reason: DecisionReason, with_data: bool) -> None:
        """A person approves or denies, or the worker records a timeout, cancel or shutdown."""
        self.resolutions += 1
        asked = [r for r in self.model.runs.values() if r.interrupt is not None]
        chosen = asked[run % len(asked)]
        assert chosen.interrupt is not None
        data: JSONObject | None = {"note": "by the model"} if with_data else None
        try:
            resolved = self.sync(
                self.interrupts.resolve(
                    chosen.run_id,
                    chosen.interrupt.interrupt_id,
                    approved=reason is DecisionReason.APPROVED,
                    reason=reason.value,
                    data=data,
                )
            )
        except InterruptResolved:
            accepted = False
        else:
            accepted = True
        should, after = self.model.resolve(chosen.run_id, reason, data)
        assert accepted == should, (reason, after)
        if accepted:
            assert (resolved.status, resolved.reason) == (after.status, after.reason)
            assert resolved.decision == after.decision

    @rule()
    @when(lambda self: self.has_pending_interrupt())
    def expire_approvals(self) -> None:
        expired = self.sync(self.interrupts.expire_due())
        assert {i.run_id for i in expired} <= set(self.model.runs), "another test's interrupt"
        assert {i.interrupt_id for i in expired} == self.model.expire_due()

    # --- parking and the timer sweep -------------------------------------------------------

    def _waiting_for_decision(self) -> list[tuple[Fence, Progress]]:
        """Attempts that asked for ``i0``, found it pending and have not stopped."""
        return [(f, p) for f, p in self._asking() if p.has_asked and not p.has_raised]

    @rule(pick=PICK, deadline_ticks=st.sampled_from([None, None, 1, 2]))
    @when(lambda self: self._waiting_for_decision())
    def park(self, pick: int, deadline_ticks: int | None) -> None:
        """The decision is slow (past ``park_after``): the attempt parks its run and ends.

        The wait ends at the approval's deadline, which is past if a tick passed it (the
        park then refuses: the worker's timeout is due); a run's own deadline, if given, is
        recorded by its first park that has one.
        """
        candidates = self._waiting_for_decision()
        fence, progress = candidates[pick % len(candidates)]
        interrupt = self.model.run(fence.run_id).interrupt
        assert interrupt is not None
        until = datetime.now(UTC) + timedelta(seconds=PAST_S if interrupt.is_overdue else LONG_S)
        wait = Wait(kind=WaitKind.PERMISSION, until=until, interrupt_id=interrupt.interrupt_id)
        deadline_at = None
        if deadline_ticks is not None:
            deadline_at = datetime.now(UTC) + timedelta(seconds=LONG_S)
        got: Park
        try:
            parked = self.sync(self.parking.park(fence, wait, deadline_at=deadline_at))
        except LeaseLost:
            got = "lease_lost"
        except CancelRequested:
            got = "cancel_requested"
        else:
            got = "parked" if parked else "arrived"
        assert got == self.model.park(fence, deadline_ticks)
        if got in ("lease_lost", "parked"):
            self._drop(fence)  # parked: RunParked ends the attempt, the slot is free
        elif got == "cancel_requested":
            progress.has_raised = True  # the workflow raises Cancelled

    @rule(batch_limit=st.sampled_from([1, 100]))
    @when(lambda self: self.has(RunStatus.WAITING))
    def sweep_timers(self, batch_limit: int) -> None:
        """The leading timer sweep moves every waiting run whose timer is due, and no other."""
        moved = self.sync(self.backend.timer_sweep(batch_limit).tick())
        assert {r.run_id for r in moved} <= set(self.model.runs), "another test's run"
        assert all(r.lane == self.lane for r in moved)
        assert {r.run_id: r.status for r in moved} == self.model.sweep_due()

    @rule(run=PICK)
    @when(lambda self: self.has(RunStatus.RUNNING, RunStatus.WAITING))
    def inject(self, run: int) -> None:
        """The tenant posts a message to a run: stored while it runs; refused otherwise,
        a waiting one included, since it waits for a decision, not a message (which must
        neither wake it nor be lost)."""
        run_id = self._run(run)
        try:
            posted = self.sync(self.messages.post(self.tenant, run_id, "hello"))
        except RunNotInteractive:
            accepted = False
        else:
            accepted = True
            assert posted.resumed_lane is None, "a message re-queued a run waiting for a decision"
        assert accepted == (self.model.run(run_id).status is RunStatus.RUNNING)

    # --- ending attempts ----------------------------------------------------------------------

    def _outcome(self, fence: Fence, progress: Progress, kind: Kind) -> tuple[Outcome, Kind]:
        """What the worker writes, its retry policy applied: no retry past ``max_attempts``,
        counting the attempts as the worker does (``fence.attempt - claim.run.resumes``)."""
        error: JSONObject = {"type": "Boom", "message": "boom", "reason": "retry"}
        if kind in ("retry_now", "retry_later"):
            if fence.attempt - progress.resumes < self.model.run(fence.run_id).max_attempts:
                delay = 0.0 if kind == "retry_now" else LONG_S
                return Failed(fence=fence, error=error, retry_delay_s=delay), kind
            kind = "failed"
            error = {**error, "reason": "max attempts"}
        if kind == "succeeded":
            return Succeeded(fence=fence, output={"done": True}), kind
        if kind == "failed":
            return Failed(fence=fence, error=error, retry_delay_s=None), kind
        if kind == "timed_out":
            limit: JSONObject = {"type": "TimeLimitExceeded", "reason": "timeout"}
            return Stopped(fence=fence, status=RunStatus.TIMED_OUT, error=limit), kind
        return Stopped(fence=fence, status=RunStatus.CANCELLED), kind

    @rule(picks=st.lists(st.tuples(PICK, KINDS), min_size=1, max_size=2))
    @when(lambda self: self._done())
    def finish(self, picks: list[tuple[int, Kind]]) -> None:
        """Attempts end, one or two in one ``finish_many``: usually one whose workflow
        returned or raised (those come first), but any attempt may stop or return early."""
        done = self._done()
        candidates = done + [held for held in self._attempts() if held not in done]
        chosen = [self._outcome(*candidates[pick % len(candidates)], kind) for pick, kind in picks]
        applied = self.sync(self.runs.finish_many([outcome for outcome, _ in chosen]))
        expected = self.model.finish([(outcome.fence, kind) for outcome, kind in chosen])
        assert applied == expected, f"finish_many applied {applied}, the model {expected}"
        for outcome, _ in chosen:
            self._drop(outcome.fence)

    @rule(pick=PICK)
    @when(lambda self: self._attempts())
    def release(self, pick: int) -> None:
        """A worker shutting down gives an attempt back."""
        candidates = self._attempts()
        fence, _ = candidates[pick % len(candidates)]
        released = self.sync(self.queue.release(fence))
        assert released == self.model.release(fence)
        self._drop(fence)

    # --- cancel -------------------------------------------------------------------------------

    @rule(run=PICK, by=st.sampled_from(["owner", "owner", "owner", "stranger"]))
    @when(
        lambda self: (
            not self.has_cancelled
            and self.has(RunStatus.PENDING, RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.WAITING)
        )
    )
    def cancel(self, run: int, by: str) -> None:
        """The tenant (or another tenant, who must not find the run) cancels a run."""
        self.has_cancelled = True
        run_id = self._run(run)
        tenant = self.tenant if by == "owner" else TenantId(str(uuid.uuid4()))
        try:
            after = self.sync(cancel_run(self.runs, self.backend.store, tenant, run_id))
        except RunNotFound:
            got = "not_found"
        except RunFinished:
            got = "finished"
        else:
            assert after.status in (RunStatus.CANCELLED, RunStatus.RUNNING)
            got = "cancelled" if after.status is RunStatus.CANCELLED else "requested"
        assert got == self.model.cancel(run_id, is_owner=by == "owner")
        if got == "requested":
            assert self.sync(self.backend.store.is_cancelled(run_id)), "cancel not signalled"

    # --- time and the reaper ------------------------------------------------------------------

    @rule(ticks=st.integers(1, 2))
    @when(lambda self: self.is_waiting_on_time())
    def advance_clock(self, ticks: int) -> None:
        passed = self.model.advance(ticks)
        self.sync(self._move_into_past(passed))

    async def _move_into_past(self, passed: Passed) -> None:
        past = self.backend.db.backend.now(plus_s=PAST_S)
        moves = (
            (runs, passed.leases, "lease_expires_at"),
            (runs, passed.delays, "not_before"),
            (runs, passed.wakes, "wake_at"),
            (runs, passed.run_deadlines, "deadline_at"),
            (interrupts, passed.deadlines, "expires_at"),
        )
        async with self.backend.db.transaction() as conn:
            for table, ids, column in moves:
                if ids:
                    ids_in = table.c.id.in_(ids)
                    await conn.execute(update(table).where(ids_in).values({column: past}))

    @rule(limit=st.sampled_from([1, 100]))
    @when(lambda self: self.has(RunStatus.RUNNING))
    def reap(self, limit: int) -> None:
        """The reaper takes back expired leases, and never a live one."""
        expired = self.model.expired()
        reaped = self.sync(self.queue.reap_expired(limit=limit))
        assert len(reaped) == min(limit, len(expired)), (reaped, expired)
        for run in reaped:
            attempt = self.model.run(run.run_id).attempt
            assert run.status is self.model.reap(run.run_id)
            assert (run.attempt, run.lane) == (attempt, self.lane)


def machine_on(backend: Backend) -> type[RunMachine]:
    """``RunMachine`` bound to ``backend``: Hypothesis builds machines without arguments."""

    class RunMachineOn(RunMachine):
        def __init__(self) -> None:
            super().__init__(backend)

    return RunMachineOn
