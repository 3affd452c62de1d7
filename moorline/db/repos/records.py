"""Frozen values the repositories return, and the fence every worker write carries."""

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_
from sqlalchemy.sql.elements import ColumnElement

from moorline.db.schema import runs
from moorline.types import Attempt, JSONValue, RunId, RunStatus, StepStatus, TenantId


@dataclass(frozen=True, slots=True, kw_only=True)
class Fence:
    """Proof of a live lease: the run, the attempt that claimed it (the token) and the owner.

    A write fenced by it succeeds only while the run is still ``running`` under exactly this
    attempt and owner; a reclaimed, cancelled or finished run makes it match zero rows.
    """

    run_id: RunId
    attempt: Attempt
    owner: str

    def clause(self) -> ColumnElement[bool]:
        """The predicate on the ``runs`` row that every fenced statement carries."""
        return and_(
            runs.c.id == self.run_id,
            runs.c.attempt == self.attempt,
            runs.c.lease_owner == self.owner,
            runs.c.status == RunStatus.RUNNING.value,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Tenant:
    """A tenant: the owner of runs, with one plan."""

    tenant_id: TenantId
    name: str
    plan: str
    created_at: datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """One run of a workflow, as stored."""

    run_id: RunId
    tenant_id: TenantId
    workflow: str
    status: RunStatus
    lane: str
    priority: int
    attempt: Attempt
    max_attempts: int
    lease_owner: str | None
    lease_expires_at: datetime | None
    not_before: datetime
    idempotency_key: str | None
    input_hash: str
    conversation_id: str | None
    input: JSONValue
    output: JSONValue
    error: JSONValue
    timeout_s: float | None
    cancel_requested_at: datetime | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    elapsed_time: float | None
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Step:
    """One checkpointed step of a run."""

    run_id: RunId
    key: str
    status: StepStatus
    attempt: Attempt
    function: str
    call_hash: str
    output: JSONValue
    error: str | None
    started_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """One ordered event of a run (``seq`` counts from 1 per run)."""

    run_id: RunId
    seq: int
    type: str
    attempt: Attempt
    data: JSONValue
    created_at: datetime
