"""Settings: every ``MOORLINE_*`` environment variable, validated once at start.

Build one :class:`Settings` in the CLI (or ``create_app``) and pass it down; nothing reads the
environment anywhere else. Tests construct ``Settings(...)`` directly.
"""

import difflib
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from moorline.errors import ConfigError

ENV_PREFIX = "MOORLINE_"
RATE_PATTERN = r"^[1-9][0-9]*/(second|minute|hour|day)$"
"""A rate limit setting: ``<count>/<period>`` (the plans' grammar, without their spaces)."""
DEFAULT_DATABASE_URL = "sqlite+aiosqlite:///./moorline.db"


class Edition(StrEnum):
    """``cloud`` runs one lane per plan; ``community`` puts every plan on one lane."""

    CLOUD = "cloud"
    COMMUNITY = "community"


class DatabasePooler(StrEnum):
    """What sits between Moorline and PostgreSQL: nothing, or PgBouncer in transaction mode."""

    NONE = "none"
    PGBOUNCER = "pgbouncer"


class LogFormat(StrEnum):
    """``text`` for people, ``json`` for one JSON object per log line."""

    TEXT = "text"
    JSON = "json"


class LogLevel(StrEnum):
    """The least severe log level written (the ``logging`` names, any case in the variable)."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"
    CRITICAL = "CRITICAL"


class AccessLog(StrEnum):
    """Which requests ``moorline serve`` writes an access-log line for (uvicorn's line).

    ``errors`` (the default) logs the requests answered 4xx or 5xx: refusals and failures, the
    lines an operator reads, at no cost to the requests that succeed (at hundreds of triggers a
    second, a line each was several per cent of the API process's CPU). ``all`` logs every
    request (uvicorn's own access log, logger ``uvicorn.access``), ``off`` none. The line is
    uvicorn's in every case; with ``errors`` its logger is ``moorline.access``.
    """

    ALL = "all"
    ERRORS = "errors"
    OFF = "off"


class Settings(BaseSettings):
    """Moorline's configuration. Durations are seconds (floats)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    database_url: str = DEFAULT_DATABASE_URL
    """SQLAlchemy URL of the database; default a SQLite file in the working directory."""

    database_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Comma-separated URLs tried primary-first for new connections; overrides DATABASE_URL."""

    database_pooler: DatabasePooler = DatabasePooler.NONE
    """``pgbouncer`` when the PostgreSQL URLs reach PgBouncer in transaction pooling mode.

    Each transaction may then run on another server session, so nothing may rely on session
    state: asyncpg prepares no named statements, and LISTEN goes to :attr:`listen_url`
    (without it, workers find work by their slow poll). ``none``: the URLs reach PostgreSQL
    (or MySQL, SQLite) directly.
    """

    listen_url: str | None = None
    """PostgreSQL URL reaching the database directly, not through a pooler, for the LISTEN
    connection of the LISTEN/NOTIFY wake-ups; several, comma-separated, are tried primary-first
    as ``database_urls`` are. Unset, LISTEN uses the database URLs (but not behind PgBouncer,
    see :attr:`database_pooler`)."""

    db_pool_size: int = Field(default=5, ge=1)
    """Connections kept open per process (PostgreSQL, MySQL).

    A worker process keeps more, one per slot and one per loop of its workers that writes
    beside them (claims, outcomes, heartbeats), within
    ``db_pool_size + db_max_overflow`` (``moorline.worker.process.with_worker_pool``).
    """

    db_max_overflow: int = Field(default=10, ge=0)
    """Connections opened beyond ``db_pool_size`` at peaks."""

    db_pool_timeout: float = Field(default=30.0, gt=0)
    """Seconds to wait for a pooled connection before failing."""

    db_pool_recycle: float = Field(default=300.0, gt=0)
    """Seconds after which a pooled connection is replaced."""

    db_pool_pre_ping: bool = True
    """Check a pooled connection before handing it out, dropping dead ones.

    The driver's own record of whether the server closed the connection, read without a round
    trip (asyncpg's; aiomysql's reader, see ``moorline.db.mysql_driver`` and
    ``DatabaseManager``).
    """

    fast_paths: bool = True
    """Use the fast paths that reach into dependencies' internals (``moorline.fastpaths``).

    ``false`` takes each library's public path instead, as uvicorn takes h11 without
    httptools: plain aiosqlite and aiomysql connections (MariaDB without multi-statements),
    the ``limits`` memory storage as it is, Starlette's ``Response`` and FastAPI's own
    dependency solving and route order. Same answers, more CPU and round trips; the way out
    when an upgraded dependency fails ``tests/compat/test_private_names.py`` or the check a
    fast path makes when it starts.
    """

    db_retry_base: float = Field(default=1.0, ge=0)
    """First backoff of ``with_retry`` in seconds; doubles per attempt (1 → 2 → 4)."""

    redis_url: str | None = None
    """Redis URL of the runtime store; unset means the in-memory store (one process)."""

    redis_prefix: str = Field(default="mo", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    """Every Redis key and channel starts with this."""

    admin_token: SecretStr | None = None
    """Bearer token of the admin routes; unset disables them."""

    public_url: str | None = None
    """The address clients reach the API at (``https://moorline.example.com``); webhook URLs
    are built from it, never from a request's ``Host`` header. ``moorline serve`` defaults it to
    the address it listens on; unset elsewhere, a webhook's ``url`` is its path alone."""

    edition: Edition = Edition.CLOUD
    plans_file: Path | None = None
    """YAML file whose plans replace the defaults of the same name."""

    models_file: Path | None = None
    """YAML file of model prices (and provider limits); unset: every model costs 0."""

    lease_ttl: float = Field(default=90.0, gt=0)
    """Seconds a worker's lease on a run lives without a heartbeat (heartbeat every TTL/3)."""

    reaper_interval: float = Field(default=5.0, gt=0)
    """Seconds between two reaper passes."""

    execution_timeout: float = Field(default=1800.0, gt=0)
    """Hard limit of one run, in seconds; also the lifetime cap of an event stream."""

    cancel_grace: float = Field(default=10.0, ge=0)
    """Seconds a cancelled run's workflow has to reach a check (a step, a wait, a message
    drain) before its task is cancelled outright; the run ends ``cancelled`` either way."""

    permission_timeout: float = Field(default=300.0, gt=0)
    """Seconds an interrupt waits for a decision before it is denied with reason ``timeout``."""

    park_after: float = Field(default=2.0, ge=0)
    """Seconds a wait (a decision, a sleep, a message) is awaited in memory before the run
    parks: ``waiting``, holding no lease, slot or cap unit. 0 parks at once."""

    step_start_after: float = Field(default=0.0, ge=0)
    """Seconds a new step may run before its start is written (opt-in; 0, the default, writes
    every start before the function is called). A step that returns sooner is recorded by one
    write (its start and its result together) instead of two; a longer one shows ``running``
    from then on. The price: a step may start after a cancel the worker has not heard of yet
    (at most one per run, kept), where with 0 none starts after the cancel is recorded."""

    poll_interval: float = Field(default=1.0, gt=0)
    """Seconds a worker's lane waits for a wake-up before it looks for work anyway (the slow
    poll): how late a worker finds a run whose wake-up was lost."""

    timer_interval: float = Field(default=1.0, gt=0)
    """Seconds between two passes of the timer sweep, which re-queues waiting runs whose
    timer (a sleep's end, a permission's or a message wait's timeout) is due."""

    scheduler_interval: float = Field(default=1.0, gt=0)
    """Seconds between two passes of the scheduler, which fires the schedules' due ticks:
    a tick fires within about this long after its time."""

    schedule_grace: float = Field(default=60.0, gt=0)
    """Seconds after its time a schedule's tick still fires; an older one is *missed* and
    its schedule's ``catch_up`` decides (``skip``: nothing, ``one``: the latest once)."""

    bulk_interval: float = Field(default=1.0, gt=0)
    """Seconds between two looks for unfinished bulk jobs (``POST /v1/runs/bulk/…``) by the
    process leading their processing: a new job starts within about this long."""

    bulk_batch_size: int = Field(default=200, ge=1, le=1000)
    """Runs one bulk-job transaction acts on (their rows stay locked until it commits)."""

    bulk_pause: float = Field(default=0.02, ge=0)
    """Seconds between two batches of a bulk job, so that a large one leaves the database to
    the hot path (claims, triggers) between its transactions."""

    retention_days: float = Field(default=30.0, ge=0)
    """Days a finished run is kept, counted from its end; then the retention cleaner deletes
    it with its steps, events, messages and interrupts. A plan's ``retention_days`` overrides
    it for its tenants; 0 keeps finished runs for ever."""

    retention_interval: float = Field(default=600.0, gt=0)
    """Seconds between two passes of the retention cleaner."""

    retention_batch: int = Field(default=500, ge=1)
    """Finished runs the retention cleaner examines (and at most deletes) per transaction."""

    retention_pause: float = Field(default=0.2, ge=0)
    """Seconds the retention cleaner pauses between two batches, leaving the database (and,
    on SQLite, the one write lock) to the runs being dispatched. On SQLite, while nothing else
    commits, the pause is only as long as the batch took."""

    sse_ping_interval: float = Field(default=15.0, gt=0)
    """Seconds between two keep-alive comments on an event stream."""

    max_streams_per_tenant: int = Field(default=20, ge=1)
    """Event streams one tenant may hold open at once in one API process; more are 429."""

    request_rate_limit: str = Field(default="100/second", pattern=RATE_PATTERN)
    """API requests one key may make other than triggers (reads, cancels, decisions, messages,
    stream opens, webhook creations), ``"<count>/<second|minute|hour|day>"``; more are 429
    ``rate_limited``. Triggers count against the plan's ``rate_limit`` instead."""

    stream_rate_limit: str = Field(default="10/second", pattern=RATE_PATTERN)
    """Event streams one key may open, as :attr:`request_rate_limit`."""

    webhook_rate_limit: str = Field(default="10/minute", pattern=RATE_PATTERN)
    """Webhooks one key may create, as :attr:`request_rate_limit`."""

    max_body_bytes: int = Field(default=1024 * 1024, gt=0)
    """Largest request body accepted, in bytes."""

    max_header_bytes: int = Field(default=16 * 1024, ge=1024)
    """Largest request head (request line and headers) ``moorline serve`` reads, in bytes; a
    larger one is 431 ``headers_too_large``."""

    max_headers: int = Field(default=100, ge=1)
    """Most headers a request may have; more are 431 ``headers_too_large``."""

    header_timeout: float = Field(default=10.0, gt=0)
    """Seconds a request's head may take to arrive, from its first byte (from the connection's
    opening, for its first request); then 408 ``request_timeout`` and the connection closes."""

    body_timeout: float = Field(default=30.0, gt=0)
    """Seconds a request's body may take to arrive after its head, not counting the time the
    server itself stopped reading; then 408 ``request_timeout`` and the connection closes."""

    keep_alive_timeout: float = Field(default=20.0, gt=0)
    """Seconds an idle kept-alive connection stays open (uvicorn's ``timeout_keep_alive``,
    rounded up to whole seconds). Above the idle expiry of common clients (httpx's 5 s,
    aiohttp's 15 s): the client drops an idle connection first, so no request is written to
    a socket the server is closing at that moment (a POST lost that way raises, unanswered)."""

    max_connections: int = Field(default=1000, ge=1)
    """Connections ``moorline serve`` holds open at once (event streams included); one
    beyond is answered 503 ``server_busy`` and closed."""

    llm_base_url: str | None = None
    """OpenAI-compatible endpoint; unset means the simulated model."""

    llm_api_key: SecretStr | None = None
    llm_model: str = "gpt-4o-mini"

    metrics_tenant_label: bool = False
    """Add a ``tenant`` label to the ``moorline_llm_*`` metrics (one series per tenant)."""

    app: str | None = None
    """``module:attr`` of the user's Moorline app; unset means the bundled example app."""

    url: str = "http://127.0.0.1:8000"
    """Where client commands reach the server."""

    api_key: SecretStr | None = None
    """API key that client commands send."""

    log_format: LogFormat = LogFormat.TEXT
    """``text`` (one readable line per record) or ``json`` (one JSON object per line)."""

    log_level: LogLevel = LogLevel.INFO
    """The least severe level logged: ``DEBUG``, ``INFO`` (the default), ``WARNING``, ..."""

    access_log: AccessLog = AccessLog.ERRORS
    """Requests ``moorline serve`` logs a line for: ``errors`` (answered 4xx/5xx), ``all``, or
    ``off`` (see :class:`AccessLog`)."""

    @field_validator("public_url")
    @classmethod
    def _public_url_is_a_base(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parsed = urlsplit(value)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"{value!r} is not an http(s) URL")
        if parsed.query or parsed.fragment:
            raise ValueError(f"{value!r} has a query or a fragment")
        return value.rstrip("/")

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_log_level(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("database_urls", mode="before")
    @classmethod
    def _split_urls(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _check_timeouts(self) -> "Settings":
        if self.permission_timeout > self.execution_timeout:
            raise ValueError("permission_timeout must not exceed execution_timeout")
        return self

    @property
    def effective_database_urls(self) -> list[str]:
        """The URLs to connect to, primary first."""
        return list(self.database_urls) or [self.database_url]


def load_settings(**overrides: Any) -> Settings:
    """Build settings from the environment (and overrides), as one-line ``ConfigError``s."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None


def describe_validation_error(exc: ValidationError) -> str:
    """One line naming the first bad variable and why it is bad."""
    first = exc.errors()[0]
    location = first["loc"]
    name = f"{ENV_PREFIX}{str(location[0]).upper()}" if location else "settings"
    return f"{name}: {first['msg']}"


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One sentence per ``MOORLINE_*`` variable of ``environ`` that is no setting.

    pydantic-settings ignores such a variable, so a misspelt ``MOORLINE_LEASE_TTLL=5`` would
    silently leave the default; the CLI logs these sentences as warnings at start. Each names
    the closest known variable (difflib) when one is close enough to be the likely intent.
    """
    known = [f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields]
    warnings = []
    for name in sorted(environ):
        # pydantic-settings reads the variables case-insensitively; so does this check.
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in known:
            continue
        close = difflib.get_close_matches(upper, known, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        warnings.append(f"unknown setting {name} is ignored{hint}")
    return warnings


SchemaT = TypeVar("SchemaT", bound=BaseModel)


def read_settings_file(path: Path, schema: type[SchemaT], *, kind: str, setting: str) -> SchemaT:
    """Read and validate a YAML file a setting names (the plans file, the models file).

    Args:
        path: The file.
        schema: Its pydantic model (``extra="forbid"``, so a misspelt key is named).
        kind: What the file is, for messages ("plans file").
        setting: The setting that names it, for a file that cannot be read.

    Raises:
        ConfigError: the file is missing, is not YAML, or breaks the schema; one line naming
            the file and the offending key.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot read {path}: {exc.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{kind} {path}: not valid YAML{at}") from None
    try:
        return schema.model_validate(raw if raw is not None else {})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(top level)"
        if first["type"] == "extra_forbidden":
            raise ConfigError(f"{kind} {path}: unknown key {where!r}") from None
        raise ConfigError(f"{kind} {path}: {where}: {first['msg']}") from None
