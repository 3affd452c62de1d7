"""Error answers of API v1 as :class:`~moorline.errors.MoorlineError` classes.

An error body ``{"error": {"code", "message", ...}}`` is raised as the class of its code
(``run_not_found`` → :class:`~moorline.errors.RunNotFound`, …), with the body's message, its
extra fields in :attr:`~moorline.errors.MoorlineError.details` and, for a 429,
``Retry-After`` in ``retry_after_s``. A code this client does not know becomes an
:class:`ApiError` that is also an instance of the branch of its HTTP status (a 409 is a
:class:`~moorline.errors.Conflict`), carrying the code and status it was sent with.
"""

from collections.abc import Callable
from dataclasses import dataclass

import httpx

from moorline.errors import (
    ApiKeyNotFound,
    BackendUnavailable,
    BadRequest,
    BodyTooLarge,
    BulkJobNotFound,
    Conflict,
    ConversationBusy,
    CredentialsInQuery,
    Detail,
    Forbidden,
    IdempotencyConflict,
    InterruptNotFound,
    InvalidInput,
    InvalidJson,
    InvalidRequest,
    InvalidSignature,
    LimitExceeded,
    MoorlineError,
    NoPendingInterrupt,
    NotFound,
    QuotaExceeded,
    RateLimited,
    RunFinished,
    RunNotFound,
    RunNotInteractive,
    RunNotRetryable,
    ScheduleNotFound,
    TenantNotFound,
    TooManyRuns,
    Unauthorized,
    WebhookNotFound,
    WorkerNotFound,
    WorkflowNotFound,
)


class ApiError(MoorlineError):
    """An error answer whose code this client does not know.

    Each one is raised as a subclass made for its code that also derives from the branch of
    its HTTP status (see :func:`error_from_response`), so ``except Conflict`` still catches
    a 409 of a newer server; ``code`` and ``status`` are the ones the server sent.
    """


class ServerUnreachable(BackendUnavailable):
    """The server did not answer: nothing listens at the URL, or the connection broke."""

    code = "server_unreachable"


_BRANCHES: dict[int, type[MoorlineError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: LimitExceeded,
    422: InvalidRequest,
    429: LimitExceeded,
    503: BackendUnavailable,
}
"""The class an unknown code derives from, by HTTP status (else :class:`MoorlineError`)."""

_SIMPLE: tuple[type[MoorlineError], ...] = (
    BadRequest,
    InvalidJson,
    CredentialsInQuery,
    Unauthorized,
    InvalidSignature,
    Forbidden,
    InvalidInput,
    InvalidRequest,
    NotFound,
    RunNotFound,
    WorkflowNotFound,
    TenantNotFound,
    WebhookNotFound,
    ScheduleNotFound,
    InterruptNotFound,
    ApiKeyNotFound,
    WorkerNotFound,
    BulkJobNotFound,
    Conflict,
    IdempotencyConflict,
    RunFinished,
    RunNotInteractive,
    RunNotRetryable,
    NoPendingInterrupt,
    TooManyRuns,
    BackendUnavailable,
)
"""Known classes built from the message alone."""


@dataclass(frozen=True, slots=True)
class _Answer:
    """What an error factory needs of the response."""

    message: str
    extra: dict[str, Detail]
    headers: httpx.Headers

    def header_int(self, name: str) -> int | None:
        value = self.headers.get(name)
        return int(value) if value is not None and value.isdigit() else None

    def extra_str(self, name: str) -> str:
        value = self.extra.get(name)
        return value if isinstance(value, str) else ""


def _conversation_busy(answer: _Answer) -> MoorlineError:
    error = ConversationBusy(answer.extra_str("conversation_id"), answer.extra_str("run_id"))
    error.message, error.args = answer.message, (answer.message,)
    return error


def _rate_limited(answer: _Answer) -> MoorlineError:
    reset_s = answer.header_int("RateLimit-Reset") or answer.header_int("Retry-After") or 0
    return RateLimited(
        answer.message, limit=answer.header_int("RateLimit-Limit") or 0, reset_s=reset_s
    )


def _quota_exceeded(answer: _Answer) -> MoorlineError:
    return QuotaExceeded(
        answer.message,
        run_id=answer.extra_str("run_id"),
        retry_after_s=answer.header_int("Retry-After") or 0,
    )


def _limit(cls: type[LimitExceeded]) -> Callable[[_Answer], MoorlineError]:
    return lambda answer: cls(answer.message, retry_after_s=answer.header_int("Retry-After"))


def _plain(cls: type[MoorlineError]) -> Callable[[_Answer], MoorlineError]:
    return lambda answer: cls(answer.message)


_FACTORIES: dict[str, tuple[int, Callable[[_Answer], MoorlineError]]] = {
    **{cls.code: (cls.status, _plain(cls)) for cls in _SIMPLE},
    ConversationBusy.code: (ConversationBusy.status, _conversation_busy),
    RateLimited.code: (RateLimited.status, _rate_limited),
    QuotaExceeded.code: (QuotaExceeded.status, _quota_exceeded),
    LimitExceeded.code: (LimitExceeded.status, _limit(LimitExceeded)),
    BodyTooLarge.code: (BodyTooLarge.status, _limit(BodyTooLarge)),
}
"""The HTTP status and the way to build the error of each code this client knows."""


def error_from_response(response: httpx.Response) -> MoorlineError:
    """The :class:`~moorline.errors.MoorlineError` an error response stands for."""
    try:
        error = response.json()["error"]
        code, message = str(error["code"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        # Not the API's error shape (a proxy's page, say): keep the status, show the text.
        code, message, error = "http_error", response.text[:200] or response.reason_phrase, {}
    extra: dict[str, Detail] = {
        key: value
        for key, value in error.items()
        if key not in ("code", "message") and isinstance(value, str | int | float | bool | None)
    }
    answer = _Answer(message=message, extra=extra, headers=response.headers)
    status, factory = _FACTORIES.get(code, (0, None))
    # A known code under another status is not what this client knows: treat it as unknown.
    exc = factory(answer) if factory is not None and status == response.status_code else None
    if exc is None:
        exc = _unknown(code, response.status_code, answer)
    exc.extra.update(extra)
    return exc


def _unknown(code: str, status: int, answer: _Answer) -> MoorlineError:
    branch = _BRANCHES.get(status, MoorlineError)
    # A class per answer rather than a shared cache: unknown codes are rare, and the client
    # keeps no state outside its instance.
    cls: type[MoorlineError] = type(
        "ApiError", (ApiError, branch), {"code": code, "status": status}
    )
    if issubclass(cls, LimitExceeded):
        return cls(answer.message, retry_after_s=answer.header_int("Retry-After"))
    return cls(answer.message)
