"""``Context``: what a workflow knows about the run it executes, and how it acts on it."""

from dataclasses import dataclass

from moorline.types import Attempt, RunId, TenantId


@dataclass(frozen=True, slots=True, kw_only=True)
class Context:
    """The first argument of every workflow: the run being executed, attempt by attempt.

    Attributes:
        run_id: The run's id, the same on every attempt.
        attempt: This attempt's number (1 for the first claim); the run's fencing token.
        tenant_id: The tenant that owns the run.
        conversation_id: The conversation the run belongs to, if any.
    """

    run_id: RunId
    attempt: Attempt
    tenant_id: TenantId
    conversation_id: str | None
