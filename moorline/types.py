"""Core identifiers, statuses and the JSON alias shared by every layer."""

from enum import StrEnum
from typing import NewType, TypeAlias

RunId = NewType("RunId", str)
TenantId = NewType("TenantId", str)
Attempt = NewType("Attempt", int)

JSONScalar: TypeAlias = str | int | float | bool | None
JSONValue: TypeAlias = JSONScalar | list["JSONValue"] | dict[str, "JSONValue"]
JSONObject: TypeAlias = dict[str, JSONValue]


class RunStatus(StrEnum):
    """The lifecycle of a run (docs/design.md, "Run lifecycle")."""

    PENDING = "pending"
    QUEUED = "queued"
    RUNNING = "running"
    WAITING = "waiting"
    """Parked: waits for a decision, a timer or a message, holding no lease, slot or cap."""
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    RATE_LIMITED = "rate_limited"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset(
    {
        RunStatus.SUCCEEDED,
        RunStatus.FAILED,
        RunStatus.CANCELLED,
        RunStatus.TIMED_OUT,
        RunStatus.RATE_LIMITED,
    }
)


class StepStatus(StrEnum):
    """The state of one checkpointed step."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
