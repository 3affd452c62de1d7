"""Frozen values the repositories return, and the fence every worker write carries."""

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import and_, func
from sqlalchemy.sql.elements import ColumnElement

from moorline.db.schema import runs
from moorline.types import Attempt, JSONObject, JSONValue, RunId, RunStatus, StepStatus, TenantId
from moorline.usage import StepUsage


def unindexed(column: ColumnElement[str]) -> ColumnElement[str]:
    """``column`` (NOT NULL) in an expression no index covers (see :func:`is_running`).

    For a check on rows found another way (by id), never a way for the planner to find them.
    """
    return func.coalesce(column, "")


def is_running() -> ColumnElement[bool]:
    """The run is ``running``: a check on rows found by their id, never a way to find them.

    Wrapped in an expression that no index covers. A plain ``status = 'running'`` offers the
    planner every index that leads with the status, and PostgreSQL, whose statistics can say
    that few runs are running (a young table, or one analysed while idle), then walks one of
    them past every running run, and every dead entry a finished run left, for a batch of 8
    ids that the primary key finds directly.
    """
    return unindexed(runs.c.status) == RunStatus.RUNNING.value


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
            is_running(),
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
    waiting_for: JSONObject | None = None
    """What a ``waiting`` run waits for: ``{"kind", "until", "interrupt_id"?}``."""
    wake_at: datetime | None = None
    """When the timer sweep re-queues a ``waiting`` run (None: no timer)."""
    resumes: int = 0
    """Times the run left ``waiting``; claims after them do not use up attempts."""
    deadline_at: datetime | None = None
    """The run's wall-clock limit, waits included (None: none)."""
    parent_run_id: RunId | None = None
    """The run that started this one as a child (None: a top-level run)."""
    child_key: str | None = None
    """Its key among its parent's children."""
    depth: int = 0
    """0 for a top-level run, its parent's plus one for a child."""
    detached: bool = False
    """A child that outlives its parent's failure (never cancelled with it)."""
    emits: int = 0
    """``ctx.emit`` calls outside steps made before the run last parked (its replay skips)."""
    rerun_of: RunId | None = None
    """The run whose input this one was started with (``POST …/rerun``; None: not a re-run)."""
    trace_context: JSONObject | None = None
    """The trigger's W3C trace context, which the attempts' spans join (None: not traced)."""
    cached_tokens: int = 0
    """Prompt tokens of its model calls the provider served from cache (part of prompt_tokens)."""
    cost: float = 0.0
    """What its model calls cost, priced by the models file when they were made."""
    saved_tokens: int = 0
    """Tokens its replayed steps did not spend again."""
    saved_cost: float = 0.0
    """What those tokens would have cost."""


def run_from_row(row: Mapping[Any, Any]) -> Run:
    """The :class:`Run` a ``runs`` row holds: a row read back, or the values just inserted.

    A writer that knows every column of the row it stored (its times included) builds the
    run from its own values rather than reading the row back: a round trip less. The
    columns an insert leaves NULL come from :data:`NULL_ON_INSERT`, e.g.
    ``run_from_row({**NULL_ON_INSERT, **values})``; keys that are no column are ignored.
    """
    return Run(
        run_id=RunId(row["id"]),
        tenant_id=TenantId(row["tenant_id"]),
        workflow=row["workflow"],
        status=RunStatus(row["status"]),
        lane=row["lane"],
        priority=row["priority"],
        attempt=Attempt(row["attempt"]),
        max_attempts=row["max_attempts"],
        lease_owner=row["lease_owner"],
        lease_expires_at=row["lease_expires_at"],
        not_before=row["not_before"],
        idempotency_key=row["idempotency_key"],
        input_hash=row["input_hash"],
        conversation_id=row["conversation_id"],
        input=row["input"],
        output=row["output"],
        error=row["error"],
        timeout_s=row["timeout_s"],
        cancel_requested_at=row["cancel_requested_at"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        elapsed_time=row["elapsed_time"],
        prompt_tokens=row["prompt_tokens"],
        completion_tokens=row["completion_tokens"],
        waiting_for=row.get("waiting_for"),
        wake_at=row.get("wake_at"),
        resumes=row.get("resumes") or 0,
        deadline_at=row.get("deadline_at"),
        parent_run_id=row.get("parent_run_id"),
        child_key=row.get("child_key"),
        depth=row.get("depth") or 0,
        detached=bool(row.get("detached")),
        emits=row.get("emits") or 0,
        rerun_of=row.get("rerun_of"),
        trace_context=row.get("trace_context"),
        cached_tokens=row.get("cached_tokens") or 0,
        cost=row.get("cost") or 0.0,
        saved_tokens=row.get("saved_tokens") or 0,
        saved_cost=row.get("saved_cost") or 0.0,
    )


# A dict typed read-only, not a MappingProxyType: ``{**NULL_ON_INSERT, **values}`` takes
# CPython's fast path for dicts, and inserts build one per run.
NULL_ON_INSERT: Mapping[str, None] = dict.fromkeys(
    (
        "lease_owner",
        "lease_expires_at",
        "output",
        "error",
        "cancel_requested_at",
        "started_at",
        "finished_at",
        "elapsed_time",
    )
)
"""The ``runs`` columns a new run's INSERT leaves NULL: the lease, the outcome, the times."""


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
    seq: int | None = None
    """Its place among the run's steps by first start (None: stored before revision 0004)."""
    usage: StepUsage = field(default_factory=dict)
    """The model calls it made, by model (empty: none)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """One ordered event of a run (``seq`` counts from 1 per run)."""

    run_id: RunId
    seq: int
    type: str
    attempt: Attempt
    data: JSONValue
    created_at: datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """A message injected into a run (``seq`` counts from 1 per run).

    ``delivered_attempt`` is the attempt whose ``ctx.drain_messages`` took it (None while it
    waits); a replay of that drain returns it again, never a later one.
    """

    run_id: RunId
    seq: int
    content: str
    created_at: datetime
    delivered_attempt: Attempt | None
    delivered_at: datetime | None


@dataclass(frozen=True, slots=True, kw_only=True)
class ApiKey:
    """One API key of a tenant, as listed: never the key itself, only its first characters."""

    key_id: str
    tenant_id: TenantId
    prefix: str
    created_at: datetime
    revoked_at: datetime | None


class InterruptStatus(StrEnum):
    """The state of an interrupt: waiting, or the decision it was resolved with."""

    PENDING = "pending"
    APPROVED = "approved"
    DENIED = "denied"


class DecisionReason(StrEnum):
    """Why an interrupt was resolved (``Decision.reason`` in docs/design.md)."""

    APPROVED = "approved"
    DENIED = "denied"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    SHUTDOWN = "shutdown"


@dataclass(frozen=True, slots=True, kw_only=True)
class Interrupt:
    """A pause of a run waiting for a human decision (``ctx.request_permission``).

    ``decision`` is the data the approver sent with the decision, if any.
    """

    interrupt_id: str
    run_id: RunId
    key: str
    action: str
    data: JSONValue
    status: InterruptStatus
    reason: DecisionReason | None
    decision: JSONObject | None
    attempt: Attempt
    created_at: datetime
    expires_at: datetime
    resolved_at: datetime | None

    @property
    def is_pending(self) -> bool:
        """Whether no decision was recorded yet."""
        return self.status is InterruptStatus.PENDING

    @property
    def approved(self) -> bool:
        """Whether the recorded decision is an approval (False while pending)."""
        return self.status is InterruptStatus.APPROVED


@dataclass(frozen=True, slots=True, kw_only=True)
class Webhook:
    """An inbound webhook: deliveries to its URL, signed with ``secret``, start ``workflow``.

    The secret is kept as given, because verifying a signature needs it (an HMAC key cannot
    be checked against a hash of itself).
    """

    webhook_id: str
    tenant_id: TenantId
    workflow: str
    secret: str
    created_at: datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class LaneLoad:
    """What waits in one lane and what runs from it.

    Attributes:
        lane: The lane's name.
        queued: Runs ``queued`` in the lane (delayed and backing-off ones included).
        running: Runs ``running`` from the lane.
        oldest_queued_age_s: Seconds the longest-waiting claimable run has been claimable
            (since its ``not_before``), by database time; None when none is claimable.
    """

    lane: str
    queued: int
    running: int
    oldest_queued_age_s: float | None
