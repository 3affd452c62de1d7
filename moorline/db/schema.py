"""The schema: one SQLAlchemy ``MetaData``, the only source of truth for every table.

SQLite creates it with ``create_all``; PostgreSQL and MySQL/MariaDB reach it through the Alembic
migrations in ``moorline/db/migrations`` (a test proves upgrade-from-empty equals ``create_all``).
"""

from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)

from moorline.db.types import JSONDocument, UTCDateTime

# Deterministic constraint names, so migrations and create_all name everything alike.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)

# MySQL/MariaDB compare strings case-insensitively under their default collation, so step keys
# "Key" and "key", or tenants "Acme" and "acme", would collide there and nowhere else. Binary
# collation makes them compare as on SQLite and PostgreSQL (except that it still ignores
# trailing spaces: the NO PAD binary collations differ between MySQL and MariaDB).
MYSQL_TABLE_OPTIONS = {"mysql_charset": "utf8mb4", "mysql_collate": "utf8mb4_bin"}


def only_where_set(column: str) -> dict[str, Any]:
    """An index's options that leave out the rows whose ``column`` is NULL (a partial index).

    For an index that only rows with ``column`` set are ever looked up by (``column = ?`` or a
    range on it implies ``IS NOT NULL``, and SQLite's and PostgreSQL's planners both prove
    it): most runs have no parent, conversation or lease, and are finished only once, so
    their inserts and status changes skip the index instead of moving an entry in it. MariaDB
    has no partial indexes: there the index holds every row, as before.
    """
    where = text(f"{column} IS NOT NULL")
    return {"sqlite_where": where, "postgresql_where": where}


ID = 36  # a UUID in text (uuid4 for most ids, UUIDv7 for runs)
NAME = 200
KEY = 255

tenants = Table(
    "tenants",
    metadata,
    Column("id", String(ID), primary_key=True),
    Column("name", String(NAME), nullable=False, unique=True),
    Column("plan", String(64), nullable=False),
    Column("created_at", UTCDateTime(), nullable=False),
    Column("updated_at", UTCDateTime(), nullable=False),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("id", String(ID), primary_key=True),
    Column("tenant_id", String(ID), ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
    # SHA-256 hex of the key; the key itself is never stored.
    Column("key_hash", String(64), nullable=False, unique=True),
    # First characters of the key, to tell keys apart in listings without revealing them.
    Column("prefix", String(16), nullable=False),
    Column("created_at", UTCDateTime(), nullable=False),
    Column("revoked_at", UTCDateTime(), nullable=True),
    Index(None, "tenant_id"),
)

runs = Table(
    "runs",
    metadata,
    Column("id", String(ID), primary_key=True),
    Column("tenant_id", String(ID), ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
    Column("workflow", String(NAME), nullable=False),
    Column("status", String(16), nullable=False),
    Column("lane", String(64), nullable=False),
    Column("priority", Integer, nullable=False, default=0),
    # The fencing token: incremented by every claim; every worker write is conditional on it.
    Column("attempt", Integer, nullable=False, default=0),
    Column("max_attempts", Integer, nullable=False, default=3),
    Column("lease_owner", String(KEY), nullable=True),
    Column("lease_expires_at", UTCDateTime(), nullable=True),
    # Not claimable before this instant (delay, retry backoff); FIFO order within a priority.
    Column("not_before", UTCDateTime(), nullable=False),
    Column("idempotency_key", String(KEY), nullable=True),
    Column("input_hash", String(64), nullable=False),
    Column("conversation_id", String(KEY), nullable=True),
    Column("input", JSONDocument(), nullable=False),
    Column("output", JSONDocument(), nullable=True),
    Column("error", JSONDocument(), nullable=True),
    Column("timeout_s", Double, nullable=True),
    Column("cancel_requested_at", UTCDateTime(), nullable=True),
    Column("created_at", UTCDateTime(), nullable=False),
    Column("updated_at", UTCDateTime(), nullable=False),
    Column("started_at", UTCDateTime(), nullable=True),
    Column("finished_at", UTCDateTime(), nullable=True),
    Column("elapsed_time", Double, nullable=True),
    # LLM usage of the run's steps (prompt tokens include the cached ones; the cached tokens,
    # cost and saved figures are the last columns); written with the checkpoints
    # (moorline.db.repos.usage).
    Column("prompt_tokens", Integer, nullable=False, default=0),
    Column("completion_tokens", Integer, nullable=False, default=0),
    # A waiting run: what it waits for ({"kind", "until", "interrupt_id"?}) and when the timer
    # sweep re-queues it unless something else does first (NULL: no timer).
    Column("waiting_for", JSONDocument(), nullable=True),
    Column("wake_at", UTCDateTime(), nullable=True),
    # Times the run left ``waiting``: a claim after a resume is no failure, so the attempt
    # budget counts ``attempt - resumes`` against ``max_attempts``.
    Column("resumes", Integer, nullable=False, default=0, server_default="0"),
    # Wall-clock limit of the whole run, waits included (``deadline=``, ``deadline_seconds``).
    Column("deadline_at", UTCDateTime(), nullable=True),
    # A child run: its parent, its key among the parent's children (unique per parent, so a
    # replayed start_child finds the child it started), its depth (top-level runs: 0),
    # whether it outlives its parent (detached), and whether the parent awaits it now.
    Column("parent_run_id", String(ID), nullable=True),
    Column("child_key", String(KEY), nullable=True),
    Column("depth", Integer, nullable=False, default=0, server_default="0"),
    # 0 or 1: integers, whose server defaults every backend reflects alike (booleans' differ).
    Column("detached", Integer, nullable=False, default=0, server_default="0"),
    Column("awaited", Integer, nullable=False, default=0, server_default="0"),
    # ``ctx.emit`` calls outside steps the workflow had made when it last parked: its replay
    # skips that many, since they are recorded already (a step's emits replay with the step).
    Column("emits", Integer, nullable=False, default=0, server_default="0"),
    # A re-run: the run whose input this one was started with (``POST …/rerun``).
    Column("rerun_of", String(ID), nullable=True),
    # More LLM usage: cached prompt tokens, the cost, and what replayed steps did not spend.
    Column("cached_tokens", Integer, nullable=False, default=0, server_default="0"),
    Column("cost", Double, nullable=False, default=0.0, server_default="0"),
    Column("saved_tokens", Integer, nullable=False, default=0, server_default="0"),
    Column("saved_cost", Double, nullable=False, default=0.0, server_default="0"),
    # The trigger's W3C trace context ({"traceparent", "tracestate"?}) when tracing is on: the
    # worker's spans of the run join the trigger's trace (moorline.observability.tracing).
    Column("trace_context", JSONDocument(), nullable=True),
    UniqueConstraint("tenant_id", "idempotency_key"),
    # A unique index, not a constraint: SQLite files made before it can get an index.
    Index("ix_runs_parent_key", "parent_run_id", "child_key", unique=True),
    # A parent's children by status: its joins, the cancel cascade, GET /v1/runs?parent_run_id.
    Index("ix_runs_parent", "parent_run_id", "status", **only_where_set("parent_run_id")),
    # Reaper: running runs whose lease expired (only a claimed run has a lease).
    Index("ix_runs_lease", "status", "lease_expires_at", **only_where_set("lease_expires_at")),
    # Tenant concurrency cap, and a tenant's listing filtered on a status (newest first).
    Index("ix_runs_tenant_status", "tenant_id", "status", "created_at", "id"),
    # A tenant's listing.
    Index("ix_runs_tenant_created", "tenant_id", "created_at"),
    Index(
        "ix_runs_conversation",
        "tenant_id",
        "conversation_id",
        "status",
        **only_where_set("conversation_id"),
    ),
    # The admin's listing across tenants, newest first: all runs, those of one status, those
    # of one workflow (a filter on a lane walks ix_runs_created: lanes are few and large).
    Index("ix_runs_created", "created_at", "id"),
    Index("ix_runs_status_created", "status", "created_at", "id"),
    Index("ix_runs_workflow_created", "workflow", "created_at", "id"),
    # The timer sweep: waiting runs whose timer is due. Only waiting runs have a wake_at.
    Index("ix_runs_wake", "status", "wake_at"),
    # The retention cleaner walks finished runs oldest first; /metrics reads the oldest one.
    # Only ended runs have a finished_at.
    Index("ix_runs_finished", "finished_at", "id", **only_where_set("finished_at")),
)
# Claim: the tenants with queued runs in a lane (an index skip-scan), then each one's next runs
# in claim order (priority first, oldest eligible first), without reading a backlog past them.
# It is the only index leading with (status, lane), so a planner without statistics yet (a
# young table) cannot pick a worse one for the claim's reads. ``workflow`` comes last: a
# worker claims only the workflows it serves, a filter checked on the index entries the claim
# walks anyway, and the unserved queued runs are counted from the index alone.
Index(
    "ix_runs_lane_tenant",
    runs.c.status,
    runs.c.lane,
    runs.c.tenant_id,
    runs.c.priority.desc(),
    runs.c.not_before,
    runs.c.id,
    runs.c.workflow,
)

steps = Table(
    "steps",
    metadata,
    Column("run_id", String(ID), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("key", String(KEY), primary_key=True),
    Column("status", String(16), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("function", String(KEY), nullable=False),
    # SHA-256 of the function name and arguments: a replay with another call is detected.
    Column("call_hash", String(64), nullable=False),
    Column("output", JSONDocument(), nullable=True),
    Column("error", Text, nullable=True),
    Column("started_at", UTCDateTime(), nullable=False),
    Column("finished_at", UTCDateTime(), nullable=True),
    # 1, 2, … in the order the run's steps first started: listings sort by it, as timestamps
    # tie (SQLite keeps milliseconds). NULL for steps stored before revision 0004.
    Column("seq", Integer, nullable=True),
    # The model calls the step made, by model ({model: {prompt_tokens, completion_tokens,
    # cached_tokens, requests, failed_requests, cost}}); NULL for a step that made none.
    Column("usage", JSONDocument(), nullable=True),
    # A new step's number is the run's largest plus one: one index probe, not a scan.
    Index("ix_steps_run_seq", "run_id", "seq"),
)

events = Table(
    "events",
    metadata,
    Column("run_id", String(ID), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("seq", Integer, primary_key=True, autoincrement=False),
    Column("type", String(64), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("data", JSONDocument(), nullable=False),
    Column("created_at", UTCDateTime(), nullable=False),
)

interrupts = Table(
    "interrupts",
    metadata,
    Column("id", String(ID), primary_key=True),
    Column("run_id", String(ID), ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    # Position of the interrupt in the run, so a replay finds the same one.
    Column("key", String(KEY), nullable=False),
    Column("action", String(NAME), nullable=False),
    Column("data", JSONDocument(), nullable=False),
    Column("status", String(16), nullable=False),
    Column("reason", String(16), nullable=True),
    Column("decision", JSONDocument(), nullable=True),
    Column("attempt", Integer, nullable=False),
    Column("created_at", UTCDateTime(), nullable=False),
    Column("expires_at", UTCDateTime(), nullable=False),
    Column("resolved_at", UTCDateTime(), nullable=True),
    UniqueConstraint("run_id", "key"),
    Index(None, "run_id", "status"),
)

messages = Table(
    "messages",
    metadata,
    Column("run_id", String(ID), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("seq", Integer, primary_key=True, autoincrement=False),
    Column("content", Text, nullable=False),
    Column("created_at", UTCDateTime(), nullable=False),
    # The attempt that consumed the message and the step boundary it was consumed at.
    Column("delivered_attempt", Integer, nullable=True),
    Column("delivered_at", UTCDateTime(), nullable=True),
)

quota_usage = Table(
    "quota_usage",
    metadata,
    Column("tenant_id", String(ID), ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True),
    Column("day", String(10), primary_key=True),  # YYYY-MM-DD, UTC
    Column("used", Integer, nullable=False),
)

budget_spend = Table(
    "budget_spend",
    metadata,
    Column("tenant_id", String(ID), ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True),
    Column("day", String(10), primary_key=True),  # YYYY-MM-DD, UTC
    Column("kind", String(16), primary_key=True),  # "tokens" or "cost_micros"
    Column("amount", BigInteger, nullable=False),
)

# LLM usage per tenant, UTC day, workflow and model: the totals of /v1/usage and /metrics.
# Added to in the transaction of the step checkpoint whose calls it counts (and of the saved
# tokens of replays), so it always equals the sum of the steps' usage; never deleted with runs.
llm_usage = Table(
    "llm_usage",
    metadata,
    Column("tenant_id", String(ID), ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True),
    Column("day", String(10), primary_key=True),  # YYYY-MM-DD, UTC
    Column("workflow", String(NAME), primary_key=True),
    Column("model", String(NAME), primary_key=True),
    Column("prompt_tokens", BigInteger, nullable=False),
    Column("completion_tokens", BigInteger, nullable=False),
    Column("cached_tokens", BigInteger, nullable=False),
    Column("requests", BigInteger, nullable=False),
    Column("failed_requests", BigInteger, nullable=False),
    Column("cost", Double, nullable=False),
    Column("saved_tokens", BigInteger, nullable=False),
    Column("saved_cost", Double, nullable=False),
)

webhooks = Table(
    "webhooks",
    metadata,
    Column("id", String(ID), primary_key=True),
    Column("tenant_id", String(ID), ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
    Column("workflow", String(NAME), nullable=False),
    # The HMAC secret must be readable to verify signatures, so it is stored as given.
    Column("secret", String(KEY), nullable=False),
    Column("created_at", UTCDateTime(), nullable=False),
    Index(None, "tenant_id"),
)

# A tenant's recurring trigger of one workflow: a cron expression in a time zone, or an
# interval. ``next_at`` is the first tick not yet fired; the scheduler moves it forward only
# after the tick's run is stored (see moorline.admission.scheduler), with the counts and the
# last outcome in the same statement.
schedules = Table(
    "schedules",
    metadata,
    Column("id", String(ID), primary_key=True),
    Column("tenant_id", String(ID), ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
    Column("workflow", String(NAME), nullable=False),
    Column("input", JSONDocument(), nullable=False),
    Column("cron", String(NAME), nullable=True),
    Column("every_s", Integer, nullable=True),
    Column("timezone", String(64), nullable=False),
    Column("catch_up", String(8), nullable=False),
    Column("paused", Integer, nullable=False, default=0, server_default="0"),
    Column("next_at", UTCDateTime(), nullable=False),
    Column("last_fired_at", UTCDateTime(), nullable=True),
    Column("last_run_id", String(ID), nullable=True),
    Column("last_error", JSONDocument(), nullable=True),
    Column("fired", Integer, nullable=False, default=0, server_default="0"),
    Column("refused", Integer, nullable=False, default=0, server_default="0"),
    Column("created_at", UTCDateTime(), nullable=False),
    Column("updated_at", UTCDateTime(), nullable=False),
    Index(None, "tenant_id", "created_at"),
    # The scheduler's pass: the unpaused schedules whose next tick is due.
    Index(None, "paused", "next_at"),
    # Retention keeps the run a schedule shows as its last: a probe by run id.
    Index("ix_schedules_last_run_id", "last_run_id"),
)

# What the retention cleaner deleted, for ever: rows per table, and runs per (lane, status) so
# that ``moorline_runs_total`` (ended runs in the table plus those deleted) never falls. Rows of
# the other tables have lane and status ''. Only the cleaner writes here, in the transaction of
# the deletion it counts.
retention_tallies = Table(
    "retention_tallies",
    metadata,
    Column("table_name", String(64), primary_key=True),
    Column("lane", String(64), primary_key=True),
    Column("status", String(16), primary_key=True),
    Column("deleted", BigInteger, nullable=False),
)

leader_leases = Table(
    "leader_leases",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("holder", String(KEY), nullable=False),
    Column("term", Integer, nullable=False),
    Column("expires_at", UTCDateTime(), nullable=False),
)

# The worker processes and what they serve: each renews its row with its heartbeat, so a row
# whose ``expires_at`` passed is a worker gone (killed, partitioned, paused), shown dead to
# operators until pruned a day later; a clean stop deletes the row. A queued run whose
# (lane, workflow) no live row serves is reported as unserved.
workers = Table(
    "workers",
    metadata,
    Column("id", String(KEY), primary_key=True),  # the worker's lease owner id
    Column("host", String(KEY), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("lanes", JSONDocument(), nullable=False),  # {lane: slots}
    Column("workflows", JSONDocument(), nullable=True),  # [name, ...]; null: every workflow
    Column("started_at", UTCDateTime(), nullable=False),
    Column("last_seen_at", UTCDateTime(), nullable=False),
    Column("expires_at", UTCDateTime(), nullable=False),
    # The Moorline version the process runs (null: a worker older than revision 0011).
    Column("version", String(64), nullable=True),
)

# A bulk action (``POST /v1/runs/bulk/cancel|retry``): the runs it acts on are fixed when it
# is created (``bulk_job_runs``), and a processor works through them in batches, each batch
# one transaction that acts on its runs and records their outcome together, so a processor
# killed mid-job leaves no run acted on without its outcome, and none acted on twice.
bulk_jobs = Table(
    "bulk_jobs",
    metadata,
    Column("id", String(ID), primary_key=True),
    # The tenant whose runs it acts on, or "(admin)" for a job of the admin token: the scope
    # of the idempotency key (a NULL would make every admin key unique).
    Column("scope", String(ID), nullable=False),
    Column("action", String(16), nullable=False),  # cancel | retry
    Column("filters", JSONDocument(), nullable=False),  # as asked, for display
    Column("idempotency_key", String(KEY), nullable=True),
    Column("state", String(16), nullable=False),  # running | finished
    Column("total", Integer, nullable=False),
    Column("done", Integer, nullable=False, default=0, server_default="0"),
    Column("failed", Integer, nullable=False, default=0, server_default="0"),
    Column("created_at", UTCDateTime(), nullable=False),
    Column("updated_at", UTCDateTime(), nullable=False),
    Column("finished_at", UTCDateTime(), nullable=True),
    UniqueConstraint("scope", "idempotency_key"),
    # The processors' read: the unfinished jobs, oldest first.
    Index("ix_bulk_jobs_state", "state", "created_at"),
)

bulk_job_runs = Table(
    "bulk_job_runs",
    metadata,
    Column("job_id", String(ID), ForeignKey("bulk_jobs.id", ondelete="CASCADE"), primary_key=True),
    Column("run_id", String(ID), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    # NULL until the job acted on the run: ``done``, or ``failed`` with the error code why.
    Column("outcome", String(16), nullable=True),
    Column("reason", String(64), nullable=True),
    # A job's runs still to do, in run id order (the batches' read).
    Index("ix_bulk_job_runs_todo", "job_id", "outcome", "run_id"),
    # Retention keeps a run a job has still to act on: a probe by run id.
    Index("ix_bulk_job_runs_run_id", "run_id"),
)

for _table in metadata.tables.values():
    _table.dialect_kwargs.update(MYSQL_TABLE_OPTIONS)
