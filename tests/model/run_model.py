"""What the repositories should do with one tenant's runs: a plain-Python model over ticks.

The state machine in ``test_run_state_machine.py`` drives the real repositories and this model
side by side, and compares them after every rule. The model knows nothing of SQL: it is the
run lifecycle of docs/design.md ("Run lifecycle"), the fencing rule (invariant 2) and the contracts
in the repositories' docstrings, written as the simplest code that could hold them.

**Time** is a logical clock of integer ticks. A lease granted or renewed at tick ``t`` expires
at ``t + LEASE_TTL_TICKS``; a retry "later" becomes claimable one tick on; an interrupt opened
with a timeout of ``k`` ticks is overdue ``k`` ticks on. The database never sees ticks: the
machine grants every lease, delay and deadline an hour of database time, so the database clock
alone never moves anything during an example, and when the model's clock passes a deadline
the machine rewrites that column into the past by database time. The repositories still
compare with the database clock, as in production; only the passing of time is simulated.

**The workflow** every run executes is ``WORKFLOW``: step ``s0``, the approval ``i0``, then
step ``s1`` only if ``i0`` was approved. An attempt replays it from the start (a succeeded step
is a replay, not a second call), so the only checkpoints that may ever exist are a prefix of
it: ``i0`` after ``s0`` succeeded, ``s1`` after ``i0`` was approved.

**Parking** (docs/design.md, "Run lifecycle"): an attempt whose approval is pending may park
its run for it (``ParkingRepo.park``): the run becomes ``waiting``, holds no lease, and waits
for ``i0``'s decision, its deadline, or the run's own wall-clock deadline, whichever comes
first (its *wake*). A decision re-queues it at once; the timer sweep re-queues it once its
wake passed (the approval denied ``timeout``) or ends it ``timed_out`` once its deadline
passed; a cancel ends it at once. A claim after a resume is no failure: the attempt budget
counts ``attempt - resumes`` against ``max_attempts``, for the worker and the reaper alike.

**History** is checked from the events table, independently of the model: see ``history.py``.
"""

from dataclasses import dataclass, field
from typing import Literal

from moorline.db.repos.records import DecisionReason, Fence, InterruptStatus
from moorline.types import Attempt, JSONObject, RunId, RunStatus, StepStatus

LEASE_TTL_TICKS = 2
"""Ticks a lease lasts after its claim or its last renewal."""

RETRY_LATER_TICKS = 1
"""Ticks before a run retried "later" may be claimed again."""

S0, I0, S1 = "s0", "i0", "s1"
WORKFLOW = (S0, I0, S1)
"""What every run executes, in order; ``s1`` only when ``i0`` was approved."""

END = len(WORKFLOW)
"""An attempt's position once it has nothing left to do but return."""

S = RunStatus

Kind = Literal["succeeded", "retry_now", "retry_later", "failed", "timed_out", "cancelled"]
"""How an attempt ends, as the worker reports it to ``RunsRepo.finish_many``."""

StepStart = Literal["lease_lost", "cancel_requested", "new", "repeated", "replay"]
Cancel = Literal["not_found", "finished", "cancelled", "requested"]
Park = Literal["lease_lost", "cancel_requested", "arrived", "parked"]
"""What ``ParkingRepo.park`` answers: refused by the fence or a cancel, refused because the
decision or the deadline is already there (the workflow goes on), or the run is waiting."""

PERSON_REASONS = frozenset({DecisionReason.APPROVED, DecisionReason.DENIED})


@dataclass
class ModelInterrupt:
    interrupt_id: str
    attempt: int
    deadline_tick: int
    status: InterruptStatus = InterruptStatus.PENDING
    reason: DecisionReason | None = None
    decision: JSONObject | None = None
    is_overdue: bool = False
    """Its deadline passed in the database (``expires_at`` rewritten into the past)."""


@dataclass
class ModelRun:
    run_id: RunId
    max_attempts: int
    status: RunStatus
    attempt: int = 0
    owner: str | None = None
    lease_until_tick: int | None = None
    due_tick: int | None = None
    """Not claimable before this tick (a retry "later"); None: claimable now."""
    is_cancel_requested: bool = False
    steps: dict[str, tuple[StepStatus, int]] = field(default_factory=dict)
    interrupt: ModelInterrupt | None = None
    resumes: int = 0
    """Times the run left ``waiting`` for ``queued``: claims after them use no attempt."""
    waiting_for: str | None = None
    """The interrupt a ``waiting`` run waits for."""
    wake_tick: int | None = None
    """When a ``waiting`` run's timer is due: its approval's or its own deadline."""
    is_wake_past: bool = False
    """Its timer is due in the database (``wake_at`` rewritten into the past)."""
    deadline_tick: int | None = None
    """The run's wall-clock deadline, recorded by its first park that had one."""
    is_deadline_past: bool = False
    """Its deadline passed in the database (``deadline_at`` rewritten into the past)."""

    @property
    def tries(self) -> int:
        """Attempts that count against ``max_attempts``: claims, less those after a resume."""
        return self.attempt - self.resumes


@dataclass
class Progress:
    """Where one attempt is in ``WORKFLOW``, as its worker sees it."""

    position: int = 0
    in_flight: str | None = None
    """The step started and not yet finished by this attempt."""
    has_raised: bool = False
    """Its last step failed: the workflow raised, unless it retries the step."""
    has_asked: bool = False
    """It opened ``i0`` and found it pending: it waits for the decision, and may park."""
    resumes: int = 0
    """The run's ``resumes`` as its claim read them: the worker's attempt budget is
    ``attempt - resumes`` against ``max_attempts``."""


WorkerState = Literal["alive", "paused"]


@dataclass
class Worker:
    """One worker process: a lease owner and the attempts it believes it holds.

    A paused worker neither heartbeats nor writes until it resumes, and then writes with the
    fences it still holds, however stale. A crashed worker is replaced by a fresh process
    with a new owner id; the dead one's leases are simply never renewed again.
    """

    slot: int
    generation: int = 0
    state: WorkerState = "alive"
    held: dict[Fence, Progress] = field(default_factory=dict)

    def owner(self, lane: str) -> str:
        return f"{lane}/w{self.slot}.{self.generation}"


@dataclass
class Passed:
    """What one move of the clock ran out of, for the machine to rewrite into the past."""

    leases: set[RunId]
    delays: set[RunId] = field(default_factory=set)
    deadlines: set[str] = field(default_factory=set)
    """Approvals' deadlines (``interrupts.expires_at``)."""
    wakes: set[RunId] = field(default_factory=set)
    """Waiting runs' timers (``runs.wake_at``)."""
    run_deadlines: set[RunId] = field(default_factory=set)
    """Runs' wall-clock deadlines (``runs.deadline_at``)."""


class RunModel:
    """The runs of one tenant and lane, as the repositories should leave them."""

    def __init__(self) -> None:
        self.clock = 0
        self.runs: dict[RunId, ModelRun] = {}

    # --- reads ------------------------------------------------------------------------------

    def run(self, run_id: RunId) -> ModelRun:
        return self.runs[run_id]

    def is_current(self, fence: Fence) -> bool:
        """Whether ``fence`` is the live attempt of its run: every fenced write must succeed."""
        run = self.runs[fence.run_id]
        return run.status is S.RUNNING and run.attempt == fence.attempt and run.owner == fence.owner

    def is_lease_expired(self, run: ModelRun) -> bool:
        return run.lease_until_tick is not None and run.lease_until_tick <= self.clock

    def claimable(self) -> set[RunId]:
        return {
            run.run_id
            for run in self.runs.values()
            if run.status is S.QUEUED and run.due_tick is None and not run.is_cancel_requested
        }

    def expired(self) -> set[RunId]:
        return {
            run.run_id
            for run in self.runs.values()
            if run.status is S.RUNNING and self.is_lease_expired(run)
        }

    # --- submission -------------------------------------------------------------------------

    def submit(self, run_id: RunId, max_attempts: int, *, pending: bool) -> None:
        status = S.PENDING if pending else S.QUEUED
        self.runs[run_id] = ModelRun(run_id=run_id, max_attempts=max_attempts, status=status)

    def enqueue(self, run_id: RunId) -> bool:
        run = self.runs[run_id]
        if run.status is not S.PENDING:
            return False
        run.status = S.QUEUED
        return True

    def rate_limit(self, run_id: RunId) -> bool:
        run = self.runs[run_id]
        if run.status is not S.PENDING:
            return False
        run.status = S.RATE_LIMITED
        return True

    # --- claims and leases ------------------------------------------------------------------

    def claim(self, run_id: RunId, owner: str) -> Attempt:
        """Record the claim of a claimable run; the attempt it must have been given."""
        run = self.runs[run_id]
        if run_id not in self.claimable():
            raise AssertionError(f"run {run_id} was claimed while {run.status.value}")
        run.status = S.RUNNING
        run.attempt += 1
        run.owner = owner
        run.lease_until_tick = self.clock + LEASE_TTL_TICKS
        return Attempt(run.attempt)

    def renew(self, fences: list[Fence]) -> tuple[set[tuple[RunId, Attempt]], set[RunId]]:
        """Renew the current ones among ``fences``; (renewed, those with a cancel recorded)."""
        renewed: set[tuple[RunId, Attempt]] = set()
        cancelled: set[RunId] = set()
        for fence in fences:
            if self.is_current(fence):
                run = self.runs[fence.run_id]
                run.lease_until_tick = self.clock + LEASE_TTL_TICKS
                renewed.add((fence.run_id, fence.attempt))
                if run.is_cancel_requested:
                    cancelled.add(fence.run_id)
        return renewed, cancelled

    def release(self, fence: Fence) -> bool:
        if not self.is_current(fence):
            return False
        run = self.runs[fence.run_id]
        self._end_lease(run, S.CANCELLED if run.is_cancel_requested else S.QUEUED)
        return True

    def reap(self, run_id: RunId) -> RunStatus:
        """Record the reaping of an expired run; the status it must have been moved to."""
        run = self.runs[run_id]
        if run_id not in self.expired():
            raise AssertionError(f"run {run_id} was reaped while {run.status.value} and unexpired")
        if run.is_cancel_requested:
            status = S.CANCELLED
        elif run.tries >= run.max_attempts:
            status = S.FAILED
        else:
            status = S.QUEUED
        self._end_lease(run, status)
        return status

    def _end_lease(self, run: ModelRun, status: RunStatus) -> None:
        run.status = status
        run.owner = None
        run.lease_until_tick = None
        run.due_tick = None
        run.waiting_for = None
        run.wake_tick = None
        run.is_wake_past = False

    # --- finishing --------------------------------------------------------------------------

    def finish(self, outcomes: list[tuple[Fence, Kind]]) -> list[bool]:
        """Apply a ``finish_many`` batch in order; per outcome, whether it must have applied.

        An outcome applies exactly when its fence is current at its turn in the batch, so a
        second outcome for a run never applies. A recorded cancel wins over every outcome but a
        success: the workflow returned, its output stands.
        """
        applied: list[bool] = []
        for fence, kind in outcomes:
            if not self.is_current(fence):
                applied.append(False)
                continue
            run = self.runs[fence.run_id]
            if kind == "cancelled" or (run.is_cancel_requested and kind != "succeeded"):
                run.is_cancel_requested = True
                self._end_lease(run, S.CANCELLED)
            elif kind in ("retry_now", "retry_later"):
                self._end_lease(run, S.QUEUED)
                if kind == "retry_later":
                    run.due_tick = self.clock + RETRY_LATER_TICKS
            else:
                self._end_lease(run, S(kind))
            applied.append(True)
        return applied

    # --- cancel -----------------------------------------------------------------------------

    def cancel(self, run_id: RunId, *, is_owner: bool) -> Cancel:
        if not is_owner:
            return "not_found"
        run = self.runs[run_id]
        if run.status.is_terminal:
            return "finished"
        run.is_cancel_requested = True
        if run.status is S.RUNNING:
            return "requested"
        if run.status is S.WAITING:
            # Nobody will act on its answer now: the open question closes with the run. (A
            # queued run's pending approval stays as it is, as when a run ends running.)
            self._deny_pending(run, DecisionReason.CANCELLED)
        self._end_lease(run, S.CANCELLED)
        return "cancelled"

    # --- steps ------------------------------------------------------------------------------

    def start_step(self, fence: Fence, key: str) -> StepStart:
        if not self.is_current(fence):
            return "lease_lost"
        run = self.runs[fence.run_id]
        if run.is_cancel_requested:
            return "cancel_requested"
        found = run.steps.get(key)
        if found is not None and found[0] is StepStatus.SUCCEEDED:
            return "replay"
        run.steps[key] = (StepStatus.RUNNING, fence.attempt)
        return "new" if found is None else "repeated"

    def finish_step(self, fence: Fence, key: str, status: StepStatus) -> bool:
        """Record a step's outcome; False when the fence no longer holds (nothing written)."""
        if not self.is_current(fence):
            return False
        run = self.runs[fence.run_id]
        if run.steps.get(key) != (StepStatus.RUNNING, fence.attempt):
            raise AssertionError(f"step {key} finished while not running under {fence}")
        run.steps[key] = (status, fence.attempt)
        return True

    # --- approvals --------------------------------------------------------------------------

    def open_interrupt(
        self, fence: Fence, interrupt_id: str, timeout_ticks: int
    ) -> ModelInterrupt | StepStart:
        """The interrupt the workflow's approval gets (new or recorded), or why it got none."""
        if not self.is_current(fence):
            return "lease_lost"
        run = self.runs[fence.run_id]
        if run.is_cancel_requested:
            return "cancel_requested"
        if run.interrupt is None:
            run.interrupt = ModelInterrupt(
                interrupt_id=interrupt_id,
                attempt=fence.attempt,
                deadline_tick=self.clock + timeout_ticks,
            )
        return run.interrupt

    def resolve(
        self, run_id: RunId, reason: DecisionReason, decision: JSONObject | None
    ) -> tuple[bool, ModelInterrupt]:
        """Apply a decision; (whether it must have been accepted, the interrupt after it)."""
        interrupt = self.runs[run_id].interrupt
        if interrupt is None:
            raise AssertionError(f"run {run_id} has no interrupt to resolve")
        status = (
            InterruptStatus.APPROVED
            if reason is DecisionReason.APPROVED
            else InterruptStatus.DENIED
        )
        if interrupt.status is InterruptStatus.PENDING:
            if reason in PERSON_REASONS and interrupt.is_overdue:
                # A person came too late: the refusal expires the interrupt (and a waiting
                # run waits for its timer, due already, as the sweep will find).
                self._expire(interrupt)
                return False, interrupt
            interrupt.status, interrupt.reason, interrupt.decision = status, reason, decision
            accepted = True
        else:
            accepted = (interrupt.status, interrupt.reason, interrupt.decision) == (
                status,
                reason,
                decision,
            )
        run = self.runs[run_id]
        if accepted and run.status is S.WAITING and run.waiting_for == interrupt.interrupt_id:
            self._resume(run)
        return accepted, interrupt

    def expire_due(self) -> set[str]:
        """Expire every overdue pending interrupt; their ids."""
        expired: set[str] = set()
        for run in self.runs.values():
            interrupt = run.interrupt
            if interrupt is not None and interrupt.is_overdue:
                if interrupt.status is InterruptStatus.PENDING:
                    self._expire(interrupt)
                    expired.add(interrupt.interrupt_id)
        return expired

    def _expire(self, interrupt: ModelInterrupt) -> None:
        interrupt.status = InterruptStatus.DENIED
        interrupt.reason = DecisionReason.TIMEOUT
        interrupt.decision = None

    def _deny_pending(self, run: ModelRun, reason: DecisionReason) -> None:
        interrupt = run.interrupt
        if interrupt is not None and interrupt.status is InterruptStatus.PENDING:
            interrupt.status, interrupt.reason = InterruptStatus.DENIED, reason
            interrupt.decision = None

    # --- parking ----------------------------------------------------------------------------

    def park(self, fence: Fence, deadline_ticks: int | None) -> Park:
        """Park the fence's run for its approval, as ``ParkingRepo.park`` should.

        The run's deadline (``deadline_ticks`` from now) is recorded only if it has none yet.
        """
        if not self.is_current(fence):
            return "lease_lost"
        run = self.runs[fence.run_id]
        if run.is_cancel_requested:
            return "cancel_requested"
        interrupt = run.interrupt
        if interrupt is None:
            raise AssertionError(f"run {fence.run_id} parked for an approval it never asked")
        if interrupt.status is not InterruptStatus.PENDING or interrupt.is_overdue:
            return "arrived"
        if run.deadline_tick is None and deadline_ticks is not None:
            run.deadline_tick = self.clock + deadline_ticks
        self._end_lease(run, S.WAITING)
        run.waiting_for = interrupt.interrupt_id
        run.wake_tick = interrupt.deadline_tick
        if run.deadline_tick is not None:
            run.wake_tick = min(run.wake_tick, run.deadline_tick)
        # A deadline that passed while the run was running makes its timer due at once.
        run.is_wake_past = run.is_deadline_past
        return "parked"

    def sweep_due(self) -> dict[RunId, RunStatus]:
        """Move every waiting run whose timer is due, as the timer sweep should; where to.

        Past its deadline it ends ``timed_out``; else it is re-queued. Either way its pending
        approval is denied ``timeout``: the replay reads that decision.
        """
        moved: dict[RunId, RunStatus] = {}
        for run in self.runs.values():
            if run.status is not S.WAITING or not run.is_wake_past:
                continue
            self._deny_pending(run, DecisionReason.TIMEOUT)
            if run.is_deadline_past:
                self._end_lease(run, S.TIMED_OUT)
            else:
                self._resume(run)
            moved[run.run_id] = run.status
        return moved

    def _resume(self, run: ModelRun) -> None:
        """``waiting`` → ``queued``, in its old place in the lane (claimable at once)."""
        self._end_lease(run, S.QUEUED)
        run.resumes += 1

    # --- time -------------------------------------------------------------------------------

    def advance(self, ticks: int) -> Passed:
        """Move the clock; the leases, delays and deadlines that ran out (for the database)."""
        self.clock += ticks
        passed = Passed(leases=self.expired())
        for run in self.runs.values():
            if (
                run.deadline_tick is not None
                and not run.is_deadline_past
                and not run.status.is_terminal
                and run.deadline_tick <= self.clock
            ):
                run.is_deadline_past = True
                passed.run_deadlines.add(run.run_id)
            if (
                run.status is S.WAITING
                and not run.is_wake_past
                and run.wake_tick is not None
                and run.wake_tick <= self.clock
            ):
                run.is_wake_past = True
                passed.wakes.add(run.run_id)
            if run.due_tick is not None and run.due_tick <= self.clock:
                run.due_tick = None
                passed.delays.add(run.run_id)
            interrupt = run.interrupt
            if (
                interrupt is not None
                and not interrupt.is_overdue
                and interrupt.status is InterruptStatus.PENDING
                and interrupt.deadline_tick <= self.clock
            ):
                interrupt.is_overdue = True
                passed.deadlines.add(interrupt.interrupt_id)
        return passed


def next_position(position: int, interrupt: ModelInterrupt | None) -> int:
    """Where an attempt at ``i0`` goes once ``interrupt`` is decided (or stays, if pending)."""
    if interrupt is None or interrupt.status is InterruptStatus.PENDING:
        return position
    return position + 1 if interrupt.status is InterruptStatus.APPROVED else END


def check_prefix_closed(
    run_id: RunId,
    steps: dict[str, StepStatus],
    interrupt: InterruptStatus | None,
) -> None:
    """The run's checkpoints are a prefix of ``WORKFLOW``: only what the workflow reached."""
    unknown = set(steps) - {S0, S1}
    assert not unknown, f"run {run_id}: checkpoints of steps the workflow has not: {unknown}"
    s0_done = steps.get(S0) is StepStatus.SUCCEEDED
    if interrupt is not None:
        assert s0_done, f"run {run_id}: approval {I0} opened before {S0} succeeded"
    if S1 in steps:
        assert s0_done and interrupt is InterruptStatus.APPROVED, (
            f"run {run_id}: {S1} checkpointed while {S0} is {steps.get(S0)} and {I0} is {interrupt}"
        )
