"""The run state machine's check after every rule: the database agrees with the model.

``DatabaseChecks`` reads the example's lane once (``observe.py``) and compares every run with
``RunModel``: its row, its lease (at most one valid), its wait, its steps and approval
(checkpoints prefix-closed), and its history (``history.py``; terminal runs never change).
"""

from dataclasses import dataclass, field

from hypothesis.stateful import invariant

from moorline.db.repos.parking import WaitKind
from moorline.db.repos.records import InterruptStatus
from moorline.types import RunId, RunStatus
from tests.model.backend import Backend
from tests.model.history import check_history
from tests.model.observe import Observation, observe
from tests.model.run_model import I0, RunModel, Worker, check_prefix_closed


@dataclass
class Seen:
    """A run as the previous check read it."""

    status: RunStatus
    attempt: int
    finished_at: str | None
    events: list[tuple[str, int]] = field(default_factory=list)


class DatabaseChecks:
    """The invariant of ``RunMachine``, which keeps the state read here."""

    backend: Backend
    lane: str
    model: RunModel
    workers: list[Worker]
    seen: dict[RunId, Seen]
    observed: Observation | None
    """The last check's read; None once a rule may have written."""

    @invariant()
    def agrees_with_database(self) -> None:
        if not self.model.runs:
            return
        if self.observed is None:
            # Rules that touched no database (pause, resume, crash) leave the last read valid.
            self.observed = self.backend.sync(observe(self.backend.db, self.lane))
        seen = self.observed
        assert set(seen.runs) == set(self.model.runs), "the tenant's runs differ from the model's"
        for run_id in self.model.runs:
            self._check_run(run_id, seen)
            self._check_steps_and_approval(run_id, seen)
            self._check_history(run_id, seen)

    def _check_run(self, run_id: RunId, seen: Observation) -> None:
        model = self.model.run(run_id)
        row = seen.runs[run_id]
        assert (row.status, row.attempt, row.owner) == (model.status, model.attempt, model.owner)
        assert row.is_cancel_requested == model.is_cancel_requested
        assert (row.finished_at is not None) == row.status.is_terminal
        if row.status is RunStatus.RUNNING:
            assert row.is_lease_valid == (not self.model.is_lease_expired(model))
        else:
            assert row.is_lease_valid is None, "a lease outlived its attempt"
        if row.status is RunStatus.QUEUED:
            assert row.is_due == (model.due_tick is None)
        assert row.resumes == model.resumes
        if row.status is RunStatus.WAITING:
            assert row.waiting_for is not None
            waited = (row.waiting_for["kind"], row.waiting_for["interrupt_id"])
            assert waited == (WaitKind.PERMISSION.value, model.waiting_for)
            assert row.is_wake_due == model.is_wake_past
        else:
            assert (row.waiting_for, row.is_wake_due) == (None, None), "a wait outlived it"
        if model.deadline_tick is None:
            assert row.is_deadline_past is None
        elif not row.status.is_terminal:
            assert row.is_deadline_past == model.is_deadline_past
        # At most one valid lease: of all the fences live and paused workers hold, one matches.
        holding = [
            fence
            for worker in self.workers
            for fence in worker.held
            if fence.run_id == run_id
            and row.status is RunStatus.RUNNING
            and (fence.attempt, fence.owner) == (row.attempt, row.owner)
        ]
        assert len(holding) <= 1, f"run {run_id} has {len(holding)} valid leases: {holding}"

    def _check_steps_and_approval(self, run_id: RunId, seen: Observation) -> None:
        model = self.model.run(run_id)
        stored_steps = seen.steps.get(run_id, {})
        assert stored_steps == model.steps
        asked = seen.interrupts.get(run_id, [])
        decided: InterruptStatus | None = None
        if model.interrupt is None:
            assert asked == []
        else:
            expected = model.interrupt
            [interrupt] = asked
            assert (interrupt.interrupt_id, interrupt.key, interrupt.attempt) == (
                expected.interrupt_id,
                I0,
                expected.attempt,
            )
            decided = interrupt.status
            assert (decided, interrupt.reason) == (expected.status, expected.reason)
            assert interrupt.decision == expected.decision
        check_prefix_closed(run_id, {k: s for k, (s, _) in stored_steps.items()}, decided)

    def _check_history(self, run_id: RunId, seen: Observation) -> None:
        row = seen.runs[run_id]
        history = seen.events.get(run_id, [])
        check_history(run_id, history, row.status, row.attempt)
        before = self.seen.get(run_id)
        if before is not None:
            assert history[: len(before.events)] == before.events, "events were rewritten"
            assert row.attempt >= before.attempt
            if before.status.is_terminal:
                now = (row.status, row.attempt, row.finished_at, history)
                was = (before.status, before.attempt, before.finished_at, before.events)
                assert now == was, f"terminal run {run_id} changed: {was} → {now}"
        self.seen[run_id] = Seen(row.status, row.attempt, row.finished_at, history)
