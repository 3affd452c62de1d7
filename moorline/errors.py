"""The Moorline exception tree.

Every error Moorline raises on purpose derives from :class:`MoorlineError`::

    MoorlineError
    ├── ConfigError            operator or developer mistake; fails at start with one line
    │   └── SchemaOutOfDate    the database schema is behind the code (`moorline db upgrade`)
    ├── InvalidInput           422 invalid_input: a workflow's input does not fit its parameters
    ├── NotFound               404: an object that does not exist (or belongs to another tenant)
    │   ├── RunNotFound        run_not_found
    │   └── WorkflowNotFound   workflow_not_found
    ├── Conflict               409: the request contradicts the current state
    │   ├── TransitionRejected a fenced or conditional transition matched no row
    │   └── IdempotencyConflict idempotency_conflict
    ├── LimitExceeded          429: a quota or rate limit refused the request
    └── BackendUnavailable     503: the database or Redis could not be reached

API-facing classes carry ``code`` (the snake_case code of API.md) and ``status`` (the HTTP
status); ``moorline.api.errors`` is the only place they become HTTP responses.
"""

from typing import ClassVar


class MoorlineError(Exception):
    """Root of every error Moorline raises on purpose."""

    code: ClassVar[str] = "internal_error"
    status: ClassVar[int] = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigError(MoorlineError):
    """A setting, URL or file is wrong; the message names the key and why."""

    code = "config_error"


class SchemaOutOfDate(ConfigError):
    """The database schema is older than the code."""

    code = "schema_out_of_date"


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


class LimitExceeded(MoorlineError):
    """A quota, rate limit or size limit refused the request."""

    code = "limit_exceeded"
    status = 429


class BackendUnavailable(MoorlineError):
    """The database or Redis did not answer."""

    code = "backend_unavailable"
    status = 503
