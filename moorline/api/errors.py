"""The one place where errors become HTTP responses.

Every error body is ``{"error": {"code": "<snake_case>", "message": "<sentence>", ...}}``
(docs/api.md). A :class:`~moorline.errors.MoorlineError` brings its ``code``, ``status`` and extra
fields (:attr:`~moorline.errors.MoorlineError.details`); a limit adds ``Retry-After`` and, for
the API rate limit, the ``RateLimit-Limit/Remaining/Reset`` headers. FastAPI's and Starlette's
own errors are put in the same shape: a body that fails its schema is 422 ``invalid_request``,
an unknown path 404 ``not_found``. A database that cannot be reached is 503
``backend_unavailable``; anything else is a bug, answered 500 ``internal_error`` without
details and logged with its traceback.
"""

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from moorline.db.failures import DATABASE_ERRORS, as_unavailable
from moorline.errors import (
    BackendUnavailable,
    BodyTooLarge,
    BudgetExhausted,
    ConversationBusy,
    CredentialsInQuery,
    IdempotencyConflict,
    InvalidInput,
    InvalidJson,
    InvalidRequest,
    LimitExceeded,
    MoorlineError,
    QuotaExceeded,
    RateLimited,
    WorkflowNotFound,
)

logger = logging.getLogger(__name__)

_STATUS_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    413: BodyTooLarge.code,
}


COMMON_ERRORS: tuple[type[MoorlineError], ...] = (CredentialsInQuery, BackendUnavailable)
"""Errors any route may answer (:class:`~moorline.api.guards.RequestGuard`, the database)."""

BODY_ERRORS: tuple[type[MoorlineError], ...] = (InvalidJson, BodyTooLarge, InvalidRequest)
"""Errors of a route that takes a JSON body."""

ADMISSION_ERRORS: tuple[type[MoorlineError], ...] = (
    WorkflowNotFound,
    InvalidInput,
    IdempotencyConflict,
    ConversationBusy,
    QuotaExceeded,
    RateLimited,
    BudgetExhausted,
)
"""Errors of a route that admits one new run (the trigger, a webhook's delivery): an unknown
workflow, then each refusal of :class:`~moorline.admission.admit.Admission`."""


class ErrorDetail(BaseModel):
    """What went wrong: a stable code, a sentence for people, and extra fields of the code."""

    model_config = ConfigDict(extra="allow")

    code: str = Field(description="Stable snake_case error code (docs/api.md).")
    message: str = Field(description="What went wrong, for people; may change.")


class ErrorResponse(BaseModel):
    """The body of every error response."""

    error: ErrorDetail


def error_body(code: str, message: str, **details: Any) -> dict[str, Any]:
    """The JSON body of an error."""
    return {"error": {"code": code, "message": message, **details}}


def error_response(exc: MoorlineError) -> JSONResponse:
    """The response that answers ``exc``: its status, body and limit headers."""
    headers: dict[str, str] = {}
    if isinstance(exc, LimitExceeded) and exc.retry_after_s is not None:
        headers["Retry-After"] = str(exc.retry_after_s)
    if isinstance(exc, RateLimited):
        headers.update(rate_limit_headers(exc.limit, 0, exc.reset_s))
    return JSONResponse(
        status_code=exc.status,
        content=error_body(exc.code, exc.message, **exc.details),
        headers=headers,
    )


def raw_error_response(exc: MoorlineError) -> bytes:
    """``exc``'s answer as the bytes of a whole HTTP/1.1 response that closes the connection.

    For the server's own refusals (:mod:`moorline.api.protocol`), written to the socket where
    no ASGI app runs: a request head over the limits, a request too slow, a connection beyond
    the cap.
    """
    response = error_response(exc)
    head = [f"HTTP/1.1 {response.status_code} {HTTPStatus(response.status_code).phrase}"]
    head += [
        f"{name.decode('latin-1')}: {value.decode('latin-1')}"
        for name, value in response.raw_headers
    ]
    head.append("connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + bytes(response.body)


def rate_limit_headers(limit: int, remaining: int, reset_s: int) -> dict[str, str]:
    """The ``RateLimit-*`` headers (IETF httpapi draft): the window, what is left, its reset."""
    return {
        "RateLimit-Limit": str(limit),
        "RateLimit-Remaining": str(remaining),
        "RateLimit-Reset": str(reset_s),
    }


def responses(*errors: type[MoorlineError]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` documenting ``errors`` and :data:`COMMON_ERRORS` by status."""
    codes: dict[int, set[str]] = {}
    for error in (*COMMON_ERRORS, *errors):
        codes.setdefault(error.status, set()).add(error.code)
    return {
        status: {
            "model": ErrorResponse,
            "description": "Error codes: " + ", ".join(f"`{code}`" for code in sorted(names)),
        }
        for status, names in sorted(codes.items())
    }


async def _moorline_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, MoorlineError)
    if exc.status == MoorlineError.status:
        # A MoorlineError without a status of its own (a ConfigError, say) is a fault of the
        # server, not of the request: logged like any other 500, or no line would say why.
        logger.error("%s answered 500 %s", type(exc).__name__, exc.code, exc_info=exc)
    return error_response(exc)


async def _validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = list(exc.errors())
    if any(problem.get("type") == "json_invalid" for problem in problems):
        return error_response(InvalidJson("the body is not valid JSON"))
    first = problems[0] if problems else {}
    where = ".".join(str(part) for part in first.get("loc", ())) or "request"
    message = f"{where}: {first.get('msg', 'invalid')}"
    return JSONResponse(
        status_code=InvalidRequest.status,
        content=error_body(InvalidRequest.code, message, field=where),
    )


async def _http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    code = _STATUS_CODES.get(exc.status_code, "http_error")
    message = str(exc.detail) if exc.status_code != 404 else "no such route"
    return JSONResponse(
        status_code=exc.status_code,
        content=error_body(code, message),
        headers=dict(exc.headers or {}),
    )


async def _database_error(_request: Request, exc: Exception) -> JSONResponse:
    unavailable = as_unavailable(exc)
    if unavailable is not None:
        logger.warning("database unavailable: %s", type(exc).__name__)
        return error_response(unavailable)
    # Handled here (Starlette's ExceptionMiddleware), the error is not re-raised as the
    # catch-all's is, so nothing else would log it.
    logger.error("database error answered 500 internal_error", exc_info=exc)
    return await _internal_error(_request, exc)


async def _client_disconnected(request: Request, _exc: Exception) -> JSONResponse:
    # The client went away mid-body: no bug, nobody to answer. Without this handler it reached
    # the catch-all and logged a traceback at ERROR for what a flaky network does every day.
    logger.info("client closed the connection before its body was read: %s", request.url.path)
    return JSONResponse(
        status_code=400,
        content=error_body("invalid_request", "the client closed the connection mid-body"),
    )


async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
    # As the catch-all (ServerErrorMiddleware), Starlette re-raises the exception after this
    # answer, so the server logs its traceback.
    return JSONResponse(
        status_code=500,
        content=error_body("internal_error", "an internal error occurred; it has been logged"),
    )


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` in the API's error shape."""
    app.add_exception_handler(MoorlineError, _moorline_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(ClientDisconnect, _client_disconnected)
    # db/failures.py names and translates the driver's errors; none is imported here.
    for database_error in DATABASE_ERRORS:
        app.add_exception_handler(database_error, _database_error)
    app.add_exception_handler(Exception, _internal_error)
