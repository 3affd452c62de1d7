"""The events that show a run's progress live: its steps, and its waits for a decision.

``step_started`` and ``step_finished`` are buffered progress events (see
:data:`~moorline.engine.events.PROGRESS_EVENT_TYPES`): a workflow of many short steps adds no
write of its own to a step. ``permission_request`` and ``permission_resolved`` are written at
once: a client following the run must learn that it waits for someone (``moorline submit
--follow`` would go silent otherwise).
"""

import time

from moorline.db.repos.records import Interrupt
from moorline.engine.events import (
    EVENT_PERMISSION_REQUEST,
    EVENT_PERMISSION_RESOLVED,
    EVENT_STEP_FINISHED,
    EVENT_STEP_STARTED,
    EventWriter,
)
from moorline.types import JSONObject


class StepProgress:
    """``step_started`` and ``step_finished`` of one try of one step."""

    def __init__(self, events: EventWriter, key: str, try_number: int) -> None:
        self._events = events
        self._key = key
        self._try = try_number
        self._started = time.monotonic()

    async def started(self) -> None:
        """The step's function is about to be called."""
        self._started = time.monotonic()
        await self._events.add(EVENT_STEP_STARTED, {"key": self._key, "try": self._try})

    async def finished(self, error: str | None) -> None:
        """The call returned (``error`` None) or raised ``error``."""
        data: JSONObject = {
            "key": self._key,
            "try": self._try,
            "status": "succeeded" if error is None else "failed",
            "duration_ms": round((time.monotonic() - self._started) * 1000, 3),
        }
        if error is not None:
            data["error"] = error
        await self._events.add(EVENT_STEP_FINISHED, data)


def permission_request(interrupt: Interrupt) -> tuple[str, JSONObject]:
    """The ``permission_request`` event of a pending interrupt (type and data)."""
    return EVENT_PERMISSION_REQUEST, {
        "interrupt_id": interrupt.interrupt_id,
        "action": interrupt.action,
        "data": interrupt.data,
        "expires_at": interrupt.expires_at.isoformat(),
    }


def permission_resolved(
    interrupt: Interrupt, *, approved: bool, reason: str, data: JSONObject | None
) -> tuple[str, JSONObject]:
    """The ``permission_resolved`` event of the decision the workflow got (type and data)."""
    return EVENT_PERMISSION_RESOLVED, {
        "interrupt_id": interrupt.interrupt_id,
        "approved": approved,
        "reason": reason,
        "data": data,
    }
