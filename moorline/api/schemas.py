"""Request and response bodies of API v1 (docs/api.md); the field names are contract.

Request bodies forbid unknown fields, so a client can never set what the server owns
(``tenant_id``, ``status``, ``attempt``, usage counters: docs/reliability.md I10). Strings that end
up in keys or URLs have a pattern; free text refuses control characters, which not every
database stores.
"""

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AwareDatetime, BaseModel, ConfigDict, Field, WithJsonSchema

from moorline.admission.submission import (
    CONVERSATION_PATTERN,
    IDEMPOTENCY_KEY_PATTERN,
    MAX_BATCH,
    MAX_DELAY_S,
    MAX_KEY_LENGTH,
)
from moorline.types import RunStatus

PRINTABLE = r"^[^\x00-\x1f\x7f]+$"
"""Text without control characters."""

TOKEN = IDEMPOTENCY_KEY_PATTERN
"""Visible ASCII, no spaces: keys that must compare exactly on every database."""

CONVERSATION = CONVERSATION_PATTERN
"""Conversation ids become Redis key parts: no ``:``, ``{``, ``}``, ``*`` or spaces."""

WORKFLOW = r"^[A-Za-z][A-Za-z0-9_.-]*$"
"""As ``moorline.engine.registry.NAME_PATTERN``."""

DISPLAY_NAME = r"^[^\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]+$"
"""Text without control characters (C0, C1), zero-width, line-separator or bidi-override
characters: a name shown to operators must read as what it is. Written with escapes that
pydantic's (Rust) and Python's regex engines read alike, so clients generating from the OpenAPI
document agree with the server."""

Name = Annotated[str, Field(min_length=1, max_length=200, pattern=DISPLAY_NAME)]
PLAN_NAMES = "x-moorline-plan-name"
"""Marks a schema whose values are plan names (see :mod:`moorline.api.openapi`)."""

PlanName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="A configured plan: `professional`, `team`, `sandbox` or one of the plans "
        "file.",
        examples=["team"],
        # The served document lists the plans configured at start (moorline.api.openapi).
        json_schema_extra={PLAN_NAMES: True},
    ),
]
WorkflowName = Annotated[str, Field(min_length=1, max_length=200, pattern=WORKFLOW)]
ConversationId = Annotated[
    str, Field(min_length=1, max_length=MAX_KEY_LENGTH, pattern=CONVERSATION)
]
IdempotencyKey = Annotated[str, Field(min_length=1, max_length=MAX_KEY_LENGTH, pattern=TOKEN)]


class RequestBody(BaseModel):
    """A request body: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


# --- tenants (admin) ------------------------------------------------------------------------


class TenantCreate(RequestBody):
    """A new tenant."""

    name: Name
    plan: PlanName


class TenantCreated(BaseModel):
    """The new tenant and its API key, shown this once (only its hash is stored)."""

    tenant_id: str
    name: str
    plan: str
    api_key: str


class TenantPlanChange(RequestBody):
    """Move a tenant to another plan."""

    plan: PlanName


class TenantOut(BaseModel):
    """A tenant."""

    tenant_id: str
    name: str
    plan: str


class TenantLoad(BaseModel):
    """A tenant with its plan's limits and how much of them it uses now."""

    tenant_id: str
    name: str
    plan: str
    lane: str
    daily_quota: int
    used_today: int = Field(description="Quota units taken today (UTC).")
    tenant_concurrency: int = Field(description="The plan's cap on the tenant's running runs.")
    running: int
    created_at: datetime
    tokens_today: int = Field(default=0, description="LLM tokens of its runs today (UTC).")
    cost_today: float = Field(default=0.0, description="What those LLM calls cost.")


class TenantList(BaseModel):
    """A page of tenants, oldest first."""

    tenants: list[TenantLoad]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page.")


class LaneOut(BaseModel):
    """One lane's load."""

    lane: str
    queued: int
    running: int
    oldest_queued_age_s: float | None = Field(
        description="Seconds the longest-waiting claimable run has waited; null when none."
    )
    unserved: int = Field(
        description="Queued runs of the lane whose workflow no live worker serves there (a "
        "rolling deploy, a worker started with another app): they wait for one that does."
    )
    unserved_workflows: list[str] = Field(
        description="The workflows of the unserved runs, by name; empty when none."
    )


class Queues(BaseModel):
    """Every lane's load."""

    lanes: list[LaneOut]


# --- workers --------------------------------------------------------------------------------


class WorkerOut(BaseModel):
    """A worker process as its heartbeat row says, live or dead, with the runs it holds."""

    worker_id: str = Field(description="Its lease owner id: runs it holds name it.")
    host: str
    pid: int
    version: str | None = Field(description="The Moorline version it runs; null if unknown.")
    lanes: dict[str, int] = Field(description="Lane → worker slots it serves.")
    workflows: list[str] | None = Field(
        description="The workflows it runs, by name; null when it claims every workflow."
    )
    status: Literal["live", "dead"] = Field(
        description="`dead`: no heartbeat for one `MOORLINE_LEASE_TTL` (killed, partitioned, "
        "paused); a worker that stops cleanly removes itself instead. Dead rows are pruned a "
        "day after."
    )
    started_at: datetime
    last_seen_at: datetime = Field(description="Its last heartbeat, by database time.")
    last_seen_age_s: float = Field(description="Seconds since its last heartbeat.")
    expires_at: datetime = Field(description="When it counts as dead without another beat.")
    runs: int = Field(description="Runs it holds the lease of (`running`).")
    run_ids: list[str] = Field(description="The ids of the first 50 of those runs, sorted.")


class WorkerList(BaseModel):
    """Every worker with a heartbeat row: live ones first, then by host and pid."""

    workers: list[WorkerOut]


class HeldRunOut(BaseModel):
    """A run a worker holds the lease of."""

    run_id: str
    tenant_id: str
    workflow: str
    queue: str = Field(description="The run's lane.")
    attempt: int
    started_at: datetime | None
    lease_expires_at: datetime | None = Field(
        description="When the reaper may take it back unless the worker renews it."
    )


class WorkerDetail(WorkerOut):
    """One worker with every run it holds."""

    held: list[HeldRunOut]


# --- runs -----------------------------------------------------------------------------------


class RunCreate(RequestBody):
    """A trigger."""

    input: dict[str, Any] = Field(
        default_factory=dict, description="The workflow's arguments by parameter name."
    )
    idempotency_key: IdempotencyKey | None = Field(
        default=None, description="The same key and input again returns the first run."
    )
    conversation_id: ConversationId | None = Field(
        default=None, description="At most one active run per conversation."
    )
    delay_seconds: float = Field(
        default=0.0,
        ge=0.0,
        le=MAX_DELAY_S,
        allow_inf_nan=False,
        # A number, not a string or a boolean that lax validation would turn into one.
        strict=True,
        description="Claim no sooner.",
    )


class RunAccepted(BaseModel):
    """A run that was admitted (or, for a repeated idempotency key, the earlier one)."""

    run_id: str
    workflow: str
    status: RunStatus
    queue: str
    created_at: datetime


class RunBatch(RequestBody):
    """Triggers of one workflow, each admitted on its own (not all-or-nothing)."""

    runs: list[RunCreate] = Field(
        min_length=1,
        max_length=MAX_BATCH,
        description=f"1 to {MAX_BATCH} triggers, each as the body of a single trigger.",
    )


class ItemError(BaseModel):
    """Why an item was refused: the single trigger's error body (its code, message, fields)."""

    model_config = ConfigDict(extra="allow")

    code: str
    message: str


class RunBatchItem(BaseModel):
    """One item's answer, at the item's index in the request."""

    status_code: int = Field(
        description="What a single trigger of this item answers: 202 new run, 200 the earlier "
        "run of a repeated idempotency key, 409, 422 or 429 with `error`."
    )
    run_id: str | None = Field(
        description="The item's run: new, earlier, or stored `rate_limited` by the quota; "
        "null when nothing was stored."
    )
    status: RunStatus | None = Field(description="The run's status; null without a run.")
    queue: str | None = None
    created_at: datetime | None = None
    error: ItemError | None = None


class RunBatchAnswer(BaseModel):
    """Every item's answer, in the request's order, and how many of each kind."""

    workflow: str
    created: int = Field(description="Items answered 202: new runs.")
    existing: int = Field(description="Items answered 200: earlier runs of their keys.")
    refused: int = Field(description="Items answered with an error.")
    results: list[RunBatchItem]


class ModelUsageOut(BaseModel):
    """One model's calls: tokens (prompt tokens include the cached ones), requests, cost."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    requests: int
    failed_requests: int
    """Calls that failed or were left before the reply ended (their usage, if any, counts)."""
    cost: float
    """Priced by the models file when the calls were made (0 for a model it does not name)."""


class StepOut(BaseModel):
    """One checkpointed step."""

    key: str
    status: str
    attempt: int
    started_at: datetime
    finished_at: datetime | None
    usage: dict[str, ModelUsageOut] | None = None
    """The model calls the step made, by model; null when it made none."""


class RunUsageOut(BaseModel):
    """What a run's model calls used, and what its replayed steps saved."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cost: float
    saved_tokens: int
    """Tokens of steps replayed from their checkpoint, which called no model again."""
    saved_cost: float
    by_model: dict[str, ModelUsageOut]


class ApprovalOut(BaseModel):
    """A decision the run asked for: when, and when it was decided (the wait between)."""

    interrupt_id: str
    action: str
    status: str
    """``pending``, else the decision (``approved``, ``denied``)."""
    reason: str | None
    """Why it was decided so (``approved``, ``denied``, ``timeout``, …); null while pending."""
    requested_at: datetime
    decided_at: datetime | None


class PendingInterrupt(BaseModel):
    """The decision a run waits for."""

    interrupt_id: str
    action: str
    data: Any
    expires_at: datetime


class WaitingFor(BaseModel):
    """What a ``waiting`` run waits for (it holds no worker slot meanwhile)."""

    kind: Literal["permission", "sleep", "message", "children", "capacity"]
    until: datetime | None
    """When the wait ends by itself: the permission's deadline, the sleep's end, the message
    wait's timeout; null for a message wait without one."""
    interrupt_id: str | None = None
    """The interrupt a ``permission`` wait waits for."""
    children: int | None = None
    """How many child runs a ``children`` wait awaits."""
    model: str | None = None
    """The model whose provider limits a ``capacity`` wait waits for."""


RUN_ERROR_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {
            "type": "object",
            "description": "Why the run ended without an output.",
            "properties": {
                "type": {"type": "string", "description": "The exception's class name."},
                "message": {"type": "string"},
                "reason": {"type": "string"},
                "traceback": {
                    "type": "string",
                    "description": "A failed attempt's traceback: its innermost frames, at "
                    "most 4000 characters, secrets blanked.",
                },
            },
            "additionalProperties": True,
        },
        {"type": "null"},
    ],
    "title": "Error",
}
"""The OpenAPI schema of a run's ``error``. The value is served as stored (a dict, and fields
added later pass through), so only the document describes it (``WithJsonSchema``)."""


class RunSummary(BaseModel):
    """A run as listed."""

    run_id: str
    workflow: str
    tenant_id: str
    status: RunStatus
    queue: str
    attempt: int
    error: Annotated[Any, WithJsonSchema(RUN_ERROR_SCHEMA)]
    conversation_id: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    elapsed_time: float | None
    waiting_for: WaitingFor | None = None
    """What a ``waiting`` run waits for; null for every other status."""
    parent_run_id: str | None = None
    """The run that started this one with ``ctx.start_child``; null for a top-level run."""
    rerun_of: str | None = None
    """The run whose input this one was started with (``POST …/rerun``); null otherwise."""


class ChildOut(BaseModel):
    """A child run, as its parent lists it."""

    run_id: str
    key: str
    workflow: str
    status: RunStatus


class RunOut(RunSummary):
    """A run with its input, output, steps and pending interrupt."""

    input: Any
    output: Any
    children: list[ChildOut] = []
    """The runs this one started with ``ctx.start_child``, in the order it started them."""
    steps: list[StepOut]
    approvals: list[ApprovalOut] = []
    """Every decision the run asked for, oldest first (the timeline's waits)."""
    pending_interrupt: PendingInterrupt | None
    usage: RunUsageOut | None = None
    """The run's LLM usage (zeros for a run whose steps called no model)."""


class RunList(BaseModel):
    """A page of runs, newest first."""

    runs: list[RunSummary]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page.")


class Resume(RequestBody):
    """A decision on a paused run."""

    interrupt_id: Annotated[str, Field(min_length=1, max_length=36, pattern=TOKEN)] | None = Field(
        default=None, description="Default: the run's oldest pending interrupt."
    )
    approved: bool
    data: dict[str, Any] | None = Field(default=None, description="Handed to the workflow.")


class MessageIn(RequestBody):
    """A message for a running run's workflow."""

    content: str = Field(description="The message; non-empty.")


class MessageAccepted(BaseModel):
    """A stored message, in the order the workflow will drain it."""

    run_id: str
    seq: int


class Cancelled(BaseModel):
    """A recorded cancel: ``cancelled`` at once, or ``running`` until the run's next check."""

    run_id: str
    status: RunStatus


class Resumed(BaseModel):
    """The recorded decision."""

    run_id: str
    interrupt_id: str
    resolution: Literal["resolved"]


# --- webhooks and usage ---------------------------------------------------------------------


class WebhookCreate(RequestBody):
    """A new webhook for a workflow."""

    workflow: WorkflowName
    secret: Annotated[str, Field(min_length=16, max_length=200, pattern=PRINTABLE)] | None = Field(
        default=None, description="The HMAC secret; a random one when absent."
    )


class WebhookCreated(BaseModel):
    """The webhook: where to deliver and the secret to sign with."""

    webhook_id: str
    url: str
    secret: str


class UsageTotalsOut(ModelUsageOut):
    """Totals of a model or a workflow today, with what replays saved."""

    saved_tokens: int
    saved_cost: float


class UsageOut(BaseModel):
    """The tenant's daily quota, and its LLM usage today (UTC)."""

    tenant_id: str
    tenant_name: str
    plan: str
    daily_quota: int
    used_today: int
    remaining: int
    resets_at: datetime
    tokens_today: int = 0
    """Prompt and completion tokens of the tenant's model calls today."""
    cost_today: float = 0.0
    saved_tokens_today: int = 0
    """Tokens replayed steps did not spend again today."""
    saved_cost_today: float = 0.0
    by_model: dict[str, UsageTotalsOut] = {}
    by_workflow: dict[str, UsageTotalsOut] = {}


# --- retry, re-run and bulk actions ---------------------------------------------------------


class RerunRequest(RequestBody):
    """A re-run's optional body."""

    idempotency_key: IdempotencyKey | None = Field(
        default=None,
        description="The same key again returns the first re-run instead of starting another.",
    )


class RerunAccepted(RunAccepted):
    """The new run of a re-run, and the run it re-runs."""

    rerun_of: str


RunIdText = Annotated[str, Field(min_length=1, max_length=36, pattern=r"^[A-Za-z0-9-]+$")]

MAX_BULK_IDS = 1000
"""The most run ids one bulk request may name (the filters reach more)."""


def _storable_time(value: datetime | None) -> datetime | None:
    """``value`` in UTC, if every database can compare with it (1970 to 9999)."""
    if value is None:
        return None
    try:
        utc = value.astimezone(UTC)
    except OverflowError:
        raise ValueError("the time is out of range") from None
    if not 1970 <= utc.year <= 9998:
        raise ValueError("a time between 1970 and 9998 (UTC)")
    return utc


StorableTime = Annotated[AwareDatetime | None, AfterValidator(_storable_time)]


class BulkRequest(RequestBody):
    """Which runs a bulk action acts on: the list's filters, all of which must match."""

    status: RunStatus | None = Field(
        default=None,
        description="Retry: `failed` or `timed_out` (default both); cancel: a status that has "
        "not ended (default all of them).",
    )
    workflow: WorkflowName | None = None
    conversation_id: ConversationId | None = None
    created_after: StorableTime = Field(
        default=None, description="Runs created at or after this instant."
    )
    created_before: StorableTime = Field(
        default=None, description="Runs created before this instant."
    )
    ids: list[RunIdText] | None = Field(
        default=None, min_length=1, max_length=MAX_BULK_IDS, description="Only these runs."
    )
    idempotency_key: IdempotencyKey | None = Field(
        default=None,
        description="The same key and filters again return the first request's job.",
    )


class AdminBulkRequest(BulkRequest):
    """A bulk action of the admin: over every tenant's runs, or one tenant's."""

    tenant_id: str | None = Field(
        default=None, min_length=1, max_length=36, pattern=r"^[A-Za-z0-9-]+$"
    )


class BulkJobOut(BaseModel):
    """A bulk job and its progress: ``done + failed`` of ``total`` runs have an outcome."""

    job_id: str
    action: Literal["cancel", "retry"]
    state: Literal["running", "finished"]
    total: int
    """The runs the filters matched when the job was created (those the action applies to)."""
    done: int
    """Runs acted on: retried, or cancelled (a running one: its cancel requested)."""
    failed: int
    """Runs the action no longer applied to when their turn came (they had changed)."""
    filters: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
