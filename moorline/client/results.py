"""The results of ``moorline.Client``: pydantic models of API v1's response bodies.

Defined here, not imported from ``moorline.api``: the client speaks only the HTTP contract.
They ignore fields a newer server adds (docs/api.md: "may grow fields").
"""

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from moorline.types import JSONValue, RunStatus

TERMINAL_EVENTS = frozenset({"succeeded", "failed", "cancelled", "timed_out"})
"""Event types after which the server closes a run's stream."""


class Result(BaseModel):
    """A response body: immutable, and fields a newer server adds are ignored."""

    model_config = ConfigDict(frozen=True, extra="ignore")


class TenantCreated(Result):
    """A new tenant and its API key, shown this once."""

    tenant_id: str
    name: str
    plan: str
    api_key: str


class Tenant(Result):
    """A tenant."""

    tenant_id: str
    name: str
    plan: str


class TenantLoad(Tenant):
    """A tenant as the admin listing shows it: its plan's limits and what it uses of them."""

    lane: str
    daily_quota: int
    used_today: int
    tenant_concurrency: int
    running: int
    created_at: datetime


class TenantPage(Result):
    """A page of tenants, oldest first; ``next_cursor`` is None on the last page."""

    tenants: list[TenantLoad]
    next_cursor: str | None


class ApiKey(Result):
    """One API key as listed: its id and first characters, never the key."""

    key_id: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None


class ApiKeyIssued(ApiKey):
    """A new API key, shown this once."""

    api_key: str


class ApiKeys(Result):
    """A tenant's API keys, revoked ones too, oldest first."""

    keys: list[ApiKey]


class Lane(Result):
    """One lane's load."""

    lane: str
    queued: int
    running: int
    oldest_queued_age_s: float | None


class Queues(Result):
    """Every lane's load."""

    lanes: list[Lane]


class RunAccepted(Result):
    """An admitted trigger (or, for a repeated idempotency key, the earlier run)."""

    run_id: str
    workflow: str
    status: RunStatus
    queue: str
    created_at: datetime


class RerunAccepted(RunAccepted):
    """The new run of a re-run, and the run it re-runs."""

    rerun_of: str


class BulkJob(Result):
    """A bulk cancel or retry and its progress: ``done + failed`` of ``total`` runs."""

    job_id: str
    action: Literal["cancel", "retry"]
    state: Literal["running", "finished"]
    total: int
    done: int
    failed: int
    filters: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None

    @property
    def is_finished(self) -> bool:
        """Whether every run of the job has its outcome."""
        return self.state == "finished"


class Step(Result):
    """One checkpointed step of a run."""

    key: str
    status: str
    attempt: int
    started_at: datetime
    finished_at: datetime | None


class PendingInterrupt(Result):
    """The decision a run waits for."""

    interrupt_id: str
    action: str
    data: Any  # JSON (pydantic cannot build the recursive JSONValue)
    expires_at: datetime


class WaitingFor(Result):
    """What a ``waiting`` run waits for (it holds no worker slot meanwhile)."""

    kind: str
    """``permission``, ``sleep`` or ``message``."""
    until: datetime | None
    interrupt_id: str | None = None
    children: int | None = None


class RunSummary(Result):
    """A run as listed."""

    run_id: str
    workflow: str
    tenant_id: str
    status: RunStatus
    queue: str
    attempt: int
    error: Any
    conversation_id: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    elapsed_time: float | None
    waiting_for: WaitingFor | None = None
    parent_run_id: str | None = None
    rerun_of: str | None = None


class Child(Result):
    """A child run, as its parent lists it."""

    run_id: str
    key: str
    workflow: str
    status: RunStatus


class Run(RunSummary):
    """A run with its input, output, steps and pending interrupt."""

    input: Any
    output: Any
    steps: list[Step]
    pending_interrupt: PendingInterrupt | None
    children: list[Child] = []


class RunPage(Result):
    """A page of runs, newest first; ``next_cursor`` is None on the last page."""

    runs: list[RunSummary]
    next_cursor: str | None


class CancelAccepted(Result):
    """A recorded cancel: ``cancelled`` at once, or ``running`` until the run's next check."""

    run_id: str
    status: RunStatus


class Resumed(Result):
    """A recorded decision."""

    run_id: str
    interrupt_id: str
    resolution: Literal["resolved"]


class MessageAccepted(Result):
    """A stored message, in the order the workflow will drain it."""

    run_id: str
    seq: int


class Webhook(Result):
    """A webhook: where to deliver and the secret to sign with."""

    webhook_id: str
    url: str
    secret: str


class WebhookListed(Result):
    """A webhook as listed (its secret was shown when it was created)."""

    webhook_id: str
    workflow: str
    url: str


class Webhooks(Result):
    """The tenant's webhooks, oldest first."""

    webhooks: list[WebhookListed]


class Usage(Result):
    """The tenant's daily quota."""

    tenant_id: str
    plan: str
    daily_quota: int
    used_today: int
    remaining: int
    resets_at: datetime


class WorkflowLimits(Result):
    """What bounds one run of a workflow."""

    max_attempts: int
    timeout_s: float | None
    soft_timeout_s: float | None


class WorkflowInfo(Result):
    """One workflow of the catalogue: its input as JSON Schema, limits and lanes."""

    name: str
    parameters: dict[str, Any]
    limits: WorkflowLimits
    lanes: list[str]
    lane: str


class Workflows(Result):
    """The catalogue (``GET /v1/workflows``)."""

    workflows: list[WorkflowInfo]


class Readiness(Result):
    """``/readyz``: whether every backend accepts work, and each one's state."""

    ready: bool
    checks: dict[str, str]
    message: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """One event of a run's stream: its ``seq`` (the SSE id), type and JSON data."""

    seq: int
    type: str
    data: JSONValue

    @property
    def is_terminal(self) -> bool:
        """The run's last event: the server closes the stream after it."""
        return self.type in TERMINAL_EVENTS
