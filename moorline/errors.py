"""The Moorline exception tree.

Every error Moorline raises on purpose derives from :class:`MoorlineError`::

    MoorlineError
    ├── ConfigError            operator or developer mistake; fails at start with one line
    │   └── SchemaOutOfDate    the database schema is behind the code (`moorline db upgrade`)
    ├── BadRequest             400: the request itself is malformed
    │   ├── InvalidJson        invalid_json: the body is not JSON, or nests deeper than 64
    │   ├── CredentialsInQuery key_in_query: an API key or token sent in the query string
    │   └── RequestTimeout     408 request_timeout: the request's head or body came too slowly
    ├── Unauthorized           401 unauthorized: no key, or a key that names no tenant
    │   └── InvalidSignature   invalid_signature: a webhook delivery's signature does not verify
    ├── Forbidden              403 forbidden: a tenant key on an admin route
    ├── InvalidInput           422 invalid_input: a workflow's input does not fit its parameters
    ├── InvalidRequest         422 invalid_request: a body or parameter does not fit the schema
    │   └── TooManyRuns        too_many_runs: a bulk action's filters match more runs than allowed
    ├── NotFound               404: an object that does not exist (or belongs to another tenant)
    │   ├── RunNotFound        run_not_found
    │   ├── WorkflowNotFound   workflow_not_found
    │   ├── TenantNotFound     tenant_not_found
    │   ├── WebhookNotFound    webhook_not_found
    │   ├── ScheduleNotFound   schedule_not_found
    │   ├── InterruptNotFound  interrupt_not_found
    │   ├── ApiKeyNotFound     api_key_not_found
    │   └── WorkerNotFound     worker_not_found
    │   └── BulkJobNotFound    bulk_job_not_found
    ├── Conflict               409: the request contradicts the current state
    │   ├── TransitionRejected a fenced or conditional transition matched no row
    │   ├── IdempotencyConflict idempotency_conflict
    │   ├── RunFinished        run_finished: the run already ended (a cancel came too late)
    │   ├── ConversationBusy   conversation_busy: the conversation has an active run
    │   ├── RunNotInteractive  run_not_interactive: the run's workflow is not executing
    │   ├── NoPendingInterrupt no_pending_interrupt
    │   └── RunNotRetryable    run_not_retryable: retry of a run that is not failed or timed out
    ├── LimitExceeded          429: a quota or rate limit refused the request
    │   ├── RateLimited        rate_limited: the key's API rate limit; nothing was stored
    │   ├── QuotaExceeded      quota_exceeded: the daily quota; the run is stored rate_limited
    │   ├── BudgetExhausted    budget_exhausted: the daily token/cost budget; nothing stored
    │   ├── BodyTooLarge       413 body_too_large: the body is over MOORLINE_MAX_BODY_BYTES
    │   ├── HeadersTooLarge    431 headers_too_large: too many or too large request headers
    │   └── ServerBusy         503 server_busy: the server holds MOORLINE_MAX_CONNECTIONS already
    ├── BackendUnavailable     503: the database or Redis could not be reached
    ├── BudgetExceeded         raised inside a workflow at a model call after the budget ran out
    ├── SoftTimeLimitExceeded  raised inside a workflow at its soft time limit; catchable
    └── TimeLimitExceeded      an attempt ran past its hard time limit: the run ends timed_out

Errors defined next to the code that raises them (``TenantExists``, ``InterruptResolved``,
…) hang off these branches too.

Two stops of an attempt are not errors of the tree but ``BaseException`` subclasses, as
``asyncio.CancelledError`` is, so that a workflow's ``except Exception:`` cannot swallow them;
only the engine's attempt runner catches them::

    BaseException
    └── AttemptStopped
        ├── LeaseLost          a fenced write found the run no longer held by this attempt
        └── CancelRequested    the run's cancel is recorded: no new step or interrupt starts

API-facing classes carry ``code`` (the snake_case code of docs/api.md) and ``status`` (the HTTP
status), and :attr:`MoorlineError.details` holds the extra fields of the error body (a
``run_id``, say); ``moorline.api.errors`` is the only place they become HTTP responses.
"""

from typing import ClassVar, Protocol

Detail = str | int | float | bool | None
"""A value of an error body's extra field (``errors`` sits below ``types``, so no JSONValue)."""


class MoorlineError(Exception):
    """Root of every error Moorline raises on purpose."""

    code: ClassVar[str] = "internal_error"
    status: ClassVar[int] = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.extra: dict[str, Detail] = {}
        """Extra fields of the error body this error was read from (:class:`moorline.Client`
        fills them in); empty for an error raised on this side."""

    @property
    def details(self) -> dict[str, Detail]:
        """Extra fields of the error body beside ``code`` and ``message`` (none by default)."""
        return dict(self.extra)


class ConfigError(MoorlineError):
    """A setting, URL or file is wrong; the message names the key and why."""

    code = "config_error"


class SchemaOutOfDate(ConfigError):
    """The database schema is older than the code."""

    code = "schema_out_of_date"


class BadRequest(MoorlineError):
    """The request itself is malformed (before any schema applies)."""

    code = "bad_request"
    status = 400


class InvalidJson(BadRequest):
    """The body is not JSON, holds what no database can store, or nests deeper than 64."""

    code = "invalid_json"


class CredentialsInQuery(BadRequest):
    """An API key or token arrived in the query string, where logs and proxies keep it."""

    code = "key_in_query"


class RequestTimeout(BadRequest):
    """The request's head or body did not arrive within its timeout; the connection is closed."""

    code = "request_timeout"
    status = 408


class Unauthorized(MoorlineError):
    """No credentials, or credentials that name no tenant (unknown and revoked alike)."""

    code = "unauthorized"
    status = 401


class InvalidSignature(Unauthorized):
    """A webhook delivery's signature is missing, malformed or wrong; nothing was stored."""

    code = "invalid_signature"


class Forbidden(MoorlineError):
    """Valid credentials that may not use this route (a tenant key on an admin route)."""

    code = "forbidden"
    status = 403


class InvalidRequest(MoorlineError):
    """A body, path or query parameter does not fit the route's schema; nothing was stored."""

    code = "invalid_request"
    status = 422


class TooManyRuns(InvalidRequest):
    """A bulk action's filters match more runs than one request may act on."""

    code = "too_many_runs"


class InvalidInput(MoorlineError):
    """A workflow's input does not fit the workflow's parameters; nothing was stored."""

    code = "invalid_input"
    status = 422


class NotFound(MoorlineError):
    """The object does not exist, or is not visible to the caller."""

    code = "not_found"
    status = 404


class RunNotFound(NotFound):
    """No such run for this tenant (another tenant's run is not found either)."""

    code = "run_not_found"


class WorkflowNotFound(NotFound):
    """No workflow is registered under that name."""

    code = "workflow_not_found"


class TenantNotFound(NotFound):
    """No tenant with that id."""

    code = "tenant_not_found"


class WebhookNotFound(NotFound):
    """No webhook with that id."""

    code = "webhook_not_found"


class ScheduleNotFound(NotFound):
    """No schedule with that id for that tenant."""

    code = "schedule_not_found"


class ApiKeyNotFound(NotFound):
    """No unrevoked API key with that id for that tenant (admin)."""

    code = "api_key_not_found"


class InterruptNotFound(NotFound):
    """No interrupt with that id in the run."""

    code = "interrupt_not_found"


class WorkerNotFound(NotFound):
    """No worker row with that id (admin): it never beat, stopped cleanly, or was pruned."""

    code = "worker_not_found"


class BulkJobNotFound(NotFound):
    """No bulk job with that id for this caller."""

    code = "bulk_job_not_found"


class Conflict(MoorlineError):
    """The request contradicts the object's current state."""

    code = "conflict"
    status = 409


class TransitionRejected(Conflict):
    """A conditional transition matched no row: the state or the fencing token moved on."""

    code = "transition_rejected"


class IdempotencyConflict(Conflict):
    """The idempotency key was used before with a different input."""

    code = "idempotency_conflict"


class RunFinished(Conflict):
    """The run already ended (any terminal status); it cannot be cancelled any more."""

    code = "run_finished"


class ConversationBusy(Conflict):
    """The conversation already has an active (pending, queued or running) run.

    At most one run per conversation is active at a time; ``active_run_id`` names it (the
    error body's ``run_id``), so a client can follow it and submit again once it ended.
    """

    code = "conversation_busy"

    def __init__(self, conversation_id: str, active_run_id: str) -> None:
        super().__init__(
            f"conversation {conversation_id!r} already has an active run: {active_run_id}"
        )
        self.conversation_id = conversation_id
        self.active_run_id = active_run_id

    @property
    def details(self) -> dict[str, Detail]:
        return {"run_id": self.active_run_id}


class RunNotInteractive(Conflict):
    """The run's workflow is not executing now, so it cannot take a message."""

    code = "run_not_interactive"


class NoPendingInterrupt(Conflict):
    """The run waits for no decision."""

    code = "no_pending_interrupt"


class RunNotRetryable(Conflict):
    """Only a ``failed`` or ``timed_out`` run can be retried; this one is in another status."""

    code = "run_not_retryable"


class LimitExceeded(MoorlineError):
    """A quota, rate limit or size limit refused the request.

    Attributes:
        retry_after_s: Whole seconds after which the same request may succeed, when known
            (the ``Retry-After`` header).
    """

    code = "limit_exceeded"
    status = 429

    def __init__(self, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RateLimited(LimitExceeded):
    """The key's API rate limit refused the request; nothing was stored.

    Attributes:
        limit: Requests the limit allows per window (``RateLimit-Limit``).
        reset_s: Whole seconds until the window has room again (``RateLimit-Reset``).
    """

    code = "rate_limited"

    def __init__(self, message: str, *, limit: int, reset_s: int) -> None:
        super().__init__(message, retry_after_s=reset_s)
        self.limit = limit
        self.reset_s = reset_s

    @property
    def details(self) -> dict[str, Detail]:
        return {"retry_after_s": self.reset_s}


class QuotaExceeded(LimitExceeded):
    """The tenant's daily quota is used up; the run was stored ``rate_limited``."""

    code = "quota_exceeded"

    def __init__(self, message: str, *, run_id: str, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.run_id = run_id

    @property
    def details(self) -> dict[str, Detail]:
        return {"run_id": self.run_id, "retry_after_s": self.retry_after_s}


class BudgetExhausted(LimitExceeded):
    """The tenant's daily token or cost budget is spent; nothing was stored."""

    code = "budget_exhausted"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s)

    @property
    def details(self) -> dict[str, Detail]:
        return {"retry_after_s": self.retry_after_s}


class BodyTooLarge(LimitExceeded):
    """The request body is over ``MOORLINE_MAX_BODY_BYTES``; it was not read any further."""

    code = "body_too_large"
    status = 413


class HeadersTooLarge(LimitExceeded):
    """The request's head is over ``MOORLINE_MAX_HEADER_BYTES`` or ``MOORLINE_MAX_HEADERS``."""

    code = "headers_too_large"
    status = 431


class ServerBusy(LimitExceeded):
    """The server already holds ``MOORLINE_MAX_CONNECTIONS`` connections; this one is closed."""

    code = "server_busy"
    status = 503


class BackendUnavailable(MoorlineError):
    """The database or Redis did not answer."""

    code = "backend_unavailable"
    status = 503


class BudgetExceeded(MoorlineError):
    """Raised inside a workflow by a model call that would start after the budget is spent.

    Not retried: another attempt today would be refused the same way, so the run ends
    ``failed`` with reason ``budget`` (:mod:`moorline.dispatch.retry`).
    """

    code = "budget_exceeded"


class SoftTimeLimitExceeded(MoorlineError):
    """Raised inside a workflow, at the ``await`` it is suspended in, at its soft time limit.

    A workflow may catch it to clean up (``soft_timeout=`` of ``@app.workflow``): if it then
    returns, the run succeeds; if the exception escapes, the run fails without a retry, since
    another attempt would run out of time the same way.
    """

    code = "soft_time_limit_exceeded"

    def __init__(self, limit_s: float) -> None:
        super().__init__(f"the attempt reached its soft time limit of {limit_s:g}s")
        self.limit_s = limit_s


class TimeLimitExceeded(MoorlineError):
    """An attempt ran past its hard time limit and was stopped; the run ends ``timed_out``.

    Raised by the engine outside the workflow (the workflow itself was cancelled at its
    current ``await``); the worker records it, terminal and without a retry.
    """

    code = "timed_out"

    def __init__(self, limit_s: float) -> None:
        super().__init__(f"the attempt ran past its time limit of {limit_s:g}s")
        self.limit_s = limit_s


class Holder(Protocol):
    """Who holds a run: what :class:`moorline.db.repos.records.Fence` says of itself."""

    @property
    def run_id(self) -> str: ...

    @property
    def attempt(self) -> int: ...

    @property
    def owner(self) -> str: ...


class AttemptStopped(BaseException):
    """The attempt holding ``fence`` must stop; the fenced write that found it wrote nothing.

    A ``BaseException``: a workflow's (or a step's) ``except Exception:`` lets it through.
    """

    code: ClassVar[str]

    def __init__(self, fence: Holder, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.fence = fence


class LeaseLost(AttemptStopped):
    """A fenced write found the run no longer held by this attempt and owner; nothing was written.

    The run was reclaimed, released, cancelled or finished. The worker must stop executing it.
    """

    code = "lease_lost"

    def __init__(self, fence: Holder, action: str) -> None:
        super().__init__(
            fence,
            f"lease lost: run {fence.run_id} is no longer running under attempt "
            f"{fence.attempt} of owner {fence.owner!r}; {action} was not written",
        )


class CancelRequested(AttemptStopped):
    """The run's cancel is recorded: no new step or interrupt may start; nothing was written.

    The attempt still holds its lease, and may still record what was already in flight; the
    engine turns this into :class:`~moorline.engine.context.Cancelled`.
    """

    code = "cancel_requested"

    def __init__(self, fence: Holder, action: str) -> None:
        message = f"run {fence.run_id} has a cancel request; {action} was not started"
        super().__init__(fence, message)


class RunParked(AttemptStopped):
    """The attempt parked its run: the run is ``waiting`` and this attempt ends here.

    Raised out of a wait (``request_permission``, ``sleep``, ``wait_for_message``) once the
    park is committed; the next attempt replays the run to the same wait. Workflow code must
    let it through (a ``BaseException``, like ``asyncio.CancelledError``): the runner raises
    it again if it was swallowed, and the attempt writes nothing more.
    """

    code = "run_parked"

    def __init__(self, fence: Holder, kind: str) -> None:
        super().__init__(fence, f"run {fence.run_id} parked, waiting for a {kind}")
        self.kind = kind


class ChildFailed(MoorlineError):
    """A child run the workflow joined did not succeed.

    Attributes:
        run_id: The child's run id.
        child_status: How it ended (``failed``, ``cancelled``, ``timed_out``).
        error: Its error, as stored (None for a cancel).
    """

    code = "child_failed"

    def __init__(self, run_id: str, child_status: str, error: object) -> None:
        super().__init__(f"child run {run_id} ended {child_status}: {error!r}")
        self.run_id = run_id
        self.child_status = child_status
        self.error = error


class StepMismatch(MoorlineError):
    """A finished step key was replayed for a different call (non-deterministic workflow).

    Raised instead of returning the recorded output: step keys are unique within a run, and a
    workflow whose code changed between attempts must fail loudly (docs/reliability.md E3).
    """

    code = "step_mismatch"

    def __init__(
        self,
        run_id: str,
        key: str,
        *,
        recorded_key: str,
        recorded_function: str,
        recorded_call_hash: str,
        function: str,
        call_hash: str,
    ) -> None:
        if recorded_key != key:
            message = (
                f"step key {key!r} of run {run_id} collides with the recorded step key "
                f"{recorded_key!r}, which this database compares as equal (case or trailing "
                "spaces); step keys must differ in more than that"
            )
        else:
            message = (
                f"non-deterministic workflow: step {key!r} of run {run_id} already succeeded "
                f"as {recorded_function} (call hash {recorded_call_hash}) and is now called as "
                f"{function} (call hash {call_hash}); step keys must be unique within a run"
            )
        super().__init__(message)
        self.run_id = run_id
        self.key = key
        self.recorded_function = recorded_function
        self.recorded_call_hash = recorded_call_hash
        self.function = function
        self.call_hash = call_hash


class StepNotRunning(TransitionRejected):
    """A step was finished (or failed) while it was not running under the fence's attempt."""

    code = "step_not_running"
