"""Persisted and API-visible names of durable suspension are contract."""

from moorline.db.repos.events import EVENT_RESUMED, EVENT_WAITING
from moorline.db.repos.parking import ResumeReason, WaitKind
from moorline.engine.waits import MESSAGE_WAIT_STEP_PREFIX, SLEEP_STEP_PREFIX, TIMER_FUNCTION
from moorline.errors import RunParked


def test_waiting_event_types() -> None:
    assert (EVENT_WAITING, EVENT_RESUMED) == ("waiting", "resumed")


def test_what_a_run_waits_for_and_why_it_resumed() -> None:
    assert [kind.value for kind in WaitKind] == [
        "permission",
        "sleep",
        "message",
        "children",
        "capacity",
    ]
    assert [r.value for r in ResumeReason] == ["decision", "message", "timer", "children"]


def test_timer_checkpoints_are_steps_named_by_position() -> None:
    assert SLEEP_STEP_PREFIX == "moorline.sleep:"
    assert MESSAGE_WAIT_STEP_PREFIX == "moorline.wait:"
    assert TIMER_FUNCTION == "moorline.timer"


def test_the_park_is_a_base_exception() -> None:
    assert RunParked.code == "run_parked"
    assert not issubclass(RunParked, Exception)


def test_child_run_names() -> None:
    from moorline.db.repos.children import (
        EVENT_CHILD_FINISHED,
        EVENT_CHILD_STARTED,
        ChildLimitExceeded,
    )
    from moorline.errors import ChildFailed

    assert (EVENT_CHILD_STARTED, EVENT_CHILD_FINISHED) == ("child_started", "child_finished")
    assert WaitKind.CHILDREN.value == "children" and ResumeReason.CHILDREN.value == "children"
    assert (ChildFailed.code, ChildLimitExceeded.code) == ("child_failed", "child_limit_exceeded")
