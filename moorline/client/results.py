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
    tokens_today: int = 0
    """LLM tokens of its runs today (UTC)."""
    cost_today: float = 0.0


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


class Worker(Result):
    """A worker process as ``GET /v1/admin/workers`` lists it, live or dead."""

    worker_id: str
    host: str
    pid: int
    version: str | None
    lanes: dict[str, int]
    workflows: list[str] | None
    status: Literal["live", "dead"]
    started_at: datetime
    last_seen_at: datetime
    last_seen_age_s: float
    expires_at: datetime
    runs: int
    run_ids: list[str]


class Workers(Result):
    """Every worker with a heartbeat row, live ones first."""

    workers: list[Worker]


class HeldRun(Result):
    """A run a worker holds the lease of."""

    run_id: str
    tenant_id: str
    workflow: str
    queue: str
    attempt: int
    started_at: datetime | None
    lease_expires_at: datetime | None


class WorkerDetail(Worker):
    """One worker with every run it holds."""

    held: list[HeldRun]


class RunAccepted(Result):
    """An admitted trigger (or, for a repeated idempotency key, the earlier run)."""

    run_id: str
    workflow: str
    status: RunStatus
    queue: str
    created_at: datetime


class BatchItem(Result):
    """One item's answer in a batch trigger, at the item's index.

    ``status_code`` is what a single trigger of the item answers (202 new run, 200 the earlier
    run of a repeated key, else an error's status with ``error`` set: ``{"code", "message",
    ...}``). ``run_id`` names the item's run, also one the quota stored ``rate_limited``.
    """

    status_code: int
    run_id: str | None
    status: RunStatus | None
    queue: str | None = None
    created_at: datetime | None = None
    error: dict[str, Any] | None = None

    @property
    def is_accepted(self) -> bool:
        """Whether the item has a queued (new or earlier) run: a 202 or a 200."""
        return self.error is None


class BatchAnswer(Result):
    """A batch trigger's answer: every item's, in order, and how many of each kind."""

    workflow: str
    created: int
    existing: int
    refused: int
    results: list[BatchItem]


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


class ModelUsage(Result):
    """One model's calls: tokens (prompt tokens include the cached ones), requests, cost."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    requests: int
    failed_requests: int
    cost: float


class Step(Result):
    """One checkpointed step of a run."""

    key: str
    status: str
    attempt: int
    started_at: datetime
    finished_at: datetime | None
    usage: dict[str, ModelUsage] | None = None
    """The model calls the step made, by model; None when it made none."""


class RunUsage(Result):
    """What a run's model calls used, and what its replayed steps saved."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cost: float
    saved_tokens: int
    saved_cost: float
    by_model: dict[str, ModelUsage]


class PendingInterrupt(Result):
    """The decision a run waits for."""

    interrupt_id: str
    action: str
    data: Any  # JSON (pydantic cannot build the recursive JSONValue)
    expires_at: datetime


class WaitingFor(Result):
    """What a ``waiting`` run waits for (it holds no worker slot meanwhile)."""

    kind: str
    """``permission``, ``sleep``, ``message``, ``children`` or ``capacity``."""
    until: datetime | None
    interrupt_id: str | None = None
    children: int | None = None
    model: str | None = None
    """The model whose provider limits a ``capacity`` wait waits for."""


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
    usage: RunUsage | None = None
    """The run's LLM usage (None from a server older than issue 18)."""


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


class TickError(Result):
    """The last tick of a schedule that admission refused."""

    code: str
    message: str
    tick: str


class Schedule(Result):
    """A schedule: what it triggers, when (``cron`` or ``every_seconds``), and how it went."""

    schedule_id: str
    workflow: str
    input: dict[str, Any]
    cron: str | None
    every_seconds: int | None
    timezone: str
    catch_up: str
    paused: bool
    next_at: datetime
    last_fired_at: datetime | None
    last_run_id: str | None
    last_error: TickError | None
    fired_count: int
    refused_count: int
    created_at: datetime
    updated_at: datetime


class Schedules(Result):
    """The tenant's schedules, oldest first."""

    schedules: list[Schedule]


class UsageTotals(ModelUsage):
    """A model's or a workflow's LLM usage today, with what replays saved."""

    saved_tokens: int
    saved_cost: float


class Usage(Result):
    """The tenant's daily quota, and its LLM usage today (UTC)."""

    tenant_id: str
    tenant_name: str | None = None
    """None from a server older than the field."""
    plan: str
    daily_quota: int
    used_today: int
    remaining: int
    resets_at: datetime
    tokens_today: int = 0
    cost_today: float = 0.0
    saved_tokens_today: int = 0
    saved_cost_today: float = 0.0
    by_model: dict[str, UsageTotals] = {}
    by_workflow: dict[str, UsageTotals] = {}


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
