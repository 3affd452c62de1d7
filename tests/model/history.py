"""The run lifecycle as the events table spells it, checked independently of the model.

The statuses a run's events spell out follow ``ALLOWED_EDGES`` (docs/design.md, "Run
lifecycle"), every claim (``started``) takes the next attempt, and nothing follows a terminal
event (:func:`check_history`).
"""

from moorline.db.repos.events import (
    EVENT_CANCELLED,
    EVENT_FAILED,
    EVENT_QUEUED,
    EVENT_RECLAIMED,
    EVENT_RELEASED,
    EVENT_RESUMED,
    EVENT_RETRIED,
    EVENT_RETRYING,
    EVENT_STARTED,
    EVENT_SUCCEEDED,
    EVENT_TIMED_OUT,
    EVENT_WAITING,
)
from moorline.types import RunId, RunStatus

S = RunStatus
ALLOWED_EDGES = frozenset(
    {
        (S.PENDING, S.QUEUED),
        (S.PENDING, S.RATE_LIMITED),
        (S.QUEUED, S.RUNNING),
        (S.RUNNING, S.QUEUED),
        (S.RUNNING, S.SUCCEEDED),
        (S.RUNNING, S.FAILED),
        (S.RUNNING, S.CANCELLED),
        (S.RUNNING, S.TIMED_OUT),
        # A cancel ends a run nobody executes at once (RunsRepo.request_cancel).
        (S.PENDING, S.CANCELLED),
        (S.QUEUED, S.CANCELLED),
        # Parking (ParkingRepo): a waiting run holds no lease; a decision, a message or its
        # timer re-queues it, a cancel or its deadline ends it without a worker.
        (S.RUNNING, S.WAITING),
        (S.WAITING, S.QUEUED),
        (S.WAITING, S.CANCELLED),
        (S.WAITING, S.TIMED_OUT),
        # A retry (RunsRepo.retry, a bulk retry) queues a failed or timed-out run again: the
        # only edges out of a terminal status.
        (S.FAILED, S.QUEUED),
        (S.TIMED_OUT, S.QUEUED),
    }
)
"""The lifecycle's edges (docs/design.md); every other change of status is a bug."""

EVENT_STATUS: dict[str, RunStatus] = {
    EVENT_QUEUED: S.QUEUED,
    EVENT_STARTED: S.RUNNING,
    EVENT_RETRYING: S.QUEUED,
    EVENT_RECLAIMED: S.QUEUED,
    EVENT_RELEASED: S.QUEUED,
    EVENT_SUCCEEDED: S.SUCCEEDED,
    EVENT_FAILED: S.FAILED,
    EVENT_CANCELLED: S.CANCELLED,
    EVENT_TIMED_OUT: S.TIMED_OUT,
    EVENT_WAITING: S.WAITING,
    EVENT_RESUMED: S.QUEUED,
    EVENT_RETRIED: S.QUEUED,
}
"""The status each lifecycle event records a move to."""


def check_history(
    run_id: RunId, events: list[tuple[str, int]], status: RunStatus, attempt: int
) -> None:
    """The run's events spell a path along ``ALLOWED_EDGES`` that ends where the row is.

    Every ``started`` event carries the attempt after the previous one's (each claim takes the
    next fencing token), every other event the attempt current when it was written, and no
    event follows a terminal one but a ``retried`` (``ALLOWED_EDGES`` has its two edges).
    """
    current = S.PENDING
    last_started = 0
    for seq, (event_type, event_attempt) in enumerate(events, 1):
        where = f"run {run_id} event {seq} ({event_type}, attempt {event_attempt})"
        assert event_type in EVENT_STATUS, f"{where}: not a lifecycle event"
        moved_to = EVENT_STATUS[event_type]
        assert (current, moved_to) in ALLOWED_EDGES, f"{where}: {current} → {moved_to}"
        if event_type == EVENT_STARTED:
            assert event_attempt == last_started + 1, f"{where}: after attempt {last_started}"
            last_started = event_attempt
        else:
            assert event_attempt == last_started, f"{where}: during attempt {last_started}"
        current = moved_to
    ends = status if current is S.PENDING and status is S.RATE_LIMITED else current
    assert ends is status, f"run {run_id}: events end {current}, the row says {status}"
    assert last_started == attempt, f"run {run_id}: last claim {last_started}, row {attempt}"
