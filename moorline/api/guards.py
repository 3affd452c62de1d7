"""Input limits applied before any route runs: body size, JSON shape, credentials in URLs.

- :class:`RequestGuard` (ASGI middleware, outermost of ours) refuses a request whose query
  string carries an API key or token (400 ``key_in_query``: URLs end up in logs and proxies),
  and a body over ``MOORLINE_MAX_BODY_BYTES`` (413 ``body_too_large``): at once when the
  declared ``Content-Length`` is over, and otherwise (chunked bodies) as soon as the bytes
  received pass the limit, so no more than the limit is ever buffered. Starlette's own
  ``RequestBodyLimitMiddleware`` is not used because it answers in plain text, and only once
  the app reads the body or responds.
- :class:`JSONBodyRoute` parses the body of every route that takes one with
  :func:`parse_json` before FastAPI validates it: malformed JSON is 400 ``invalid_json``
  (FastAPI would say 422), nesting deeper than :data:`MAX_JSON_DEPTH` is 400 too, and text no
  database can store (NUL, lone surrogates) is 422 ``invalid_request``.
  :func:`solved_by` makes a route class of it for a hot route whose endpoint's arguments are
  solved by a function of its own rather than by FastAPI's dependency solver.
- :func:`~moorline.api.redaction.redact` blanks anything that looks like an API
  key or a credential parameter; the log formatter (:mod:`moorline.observability.logs`)
  applies it to every line, such as the access-log line of a refused ``?api_key=`` request.
"""

import asyncio
import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moorline.api.errors import error_response
from moorline.api.redaction import has_credentials
from moorline.errors import (
    BodyTooLarge,
    CredentialsInQuery,
    InvalidJson,
    InvalidRequest,
    MoorlineError,
)
from moorline.types import JSONValue

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a JSON body may have."""

PARSE_INLINE_BYTES = 64 * 1024
"""Largest body parsed on the event loop; larger ones are parsed on a thread (see
:meth:`JSONRequest.parse`). Triggers' bodies are a few hundred bytes."""


class RequestGuard:
    """Refuse credentials in the query string and bodies over the limit (see module doc)."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length, chunked = _declared_length(scope)
        refusal = self._refusal(scope, length)
        if refusal is not None:
            await error_response(refusal)(scope, receive, send)
            return
        if length is not None and length >= 0 and not chunked:
            # The server reads no more body than the declared length, checked above: nothing
            # to count, so the app gets the server's own receive and send (no wrappers).
            await self.app(scope, receive, send)
            return
        received = 0
        started = False

        async def receive_within_limit() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise self._too_large()
            return message

        async def send_noting_start(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive_within_limit, send_noting_start)
        except BodyTooLarge as exc:
            # Normally the app's error handler answers; this covers a read outside a route.
            if started:
                raise
            await error_response(exc)(scope, receive, send)

    def _refusal(self, scope: Scope, length: int | None) -> MoorlineError | None:
        query: bytes = scope.get("query_string", b"")
        if query and has_credentials(query.decode("latin-1")):
            return CredentialsInQuery(
                "API keys and tokens are accepted only in the Authorization header, never in "
                "the URL; consider this key exposed and rotate it"
            )
        if length is not None and length > self.max_body_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> BodyTooLarge:
        return BodyTooLarge(f"the request body is over the limit of {self.max_body_bytes} bytes")


def _declared_length(scope: Scope) -> tuple[int | None, bool]:
    """The request's declared body length, and whether its body is chunked.

    The first ``Content-Length`` (None when absent or not a number); chunked when a
    ``Transfer-Encoding`` is named, whatever the length says.
    """
    length: int | None = None
    seen_length = chunked = False
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and not seen_length:
            seen_length = True
            try:
                length = int(value)
            except ValueError:
                length = None
        elif name == b"transfer-encoding":
            chunked = True
    return length, chunked


def parse_json(body: bytes) -> JSONValue:
    """Parse a request body as strict JSON that every backend can store.

    Raises:
        InvalidJson: not UTF-8, not JSON, NaN or infinite numbers, or nesting deeper than
            :data:`MAX_JSON_DEPTH`.
        InvalidRequest: a string holds NUL or a lone surrogate, which PostgreSQL (and UTF-8)
            cannot store.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidJson("the body is not UTF-8") from None
    try:
        if text.startswith("\ufeff"):  # as json.loads refuses it
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        value: JSONValue = _DECODER.decode(text)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:
        raise InvalidJson(f"the body is not valid JSON: {exc}") from None
    _check_stored_shape(value)
    return value


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _float(text: str) -> float:
    number = float(text)
    if number in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is out of range")
    return number


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_float)
"""What ``json.loads(text, parse_constant=..., parse_float=...)`` would build for every call
(the decoder and its scanner); it keeps no state between calls."""


def _too_deep() -> InvalidJson:
    return InvalidJson(f"the body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels")


def _check_stored_shape(value: JSONValue) -> None:
    """Walk ``value`` without recursion: depth of containers and storable strings."""
    pending: list[tuple[JSONValue, int]] = [(value, 1)]
    while pending:
        node, depth = pending.pop()
        if isinstance(node, dict):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep()
            for key, item in node.items():
                _check_text(key)
                pending.append((item, depth + 1))
        elif isinstance(node, list):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep()
            pending.extend((item, depth + 1) for item in node)
        elif isinstance(node, str):
            _check_text(node)


def _check_text(text: str) -> None:
    if text.isascii():
        if "\x00" in text:
            raise InvalidRequest("a string in the body holds a NUL character (\\u0000)")
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest("a string in the body holds a lone UTF-16 surrogate") from None


def _is_json_type(content_type: str) -> bool:
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )


class JSONRequest(Request):
    """A request whose JSON body was parsed by :func:`parse_json` before the route ran."""

    _parsed: JSONValue

    async def parse(self) -> None:
        """Read and parse the body (nothing to parse when it is empty).

        Raises:
            InvalidRequest: the body is declared as something other than JSON.
        """
        body = await self.body()
        if not body:
            return
        declared = self.headers.get("content-type")
        if declared is not None and not _is_json_type(declared):
            raise InvalidRequest(
                f"the body must be JSON (Content-Type: application/json), not {declared!r}"
            )
        if len(body) <= PARSE_INLINE_BYTES:
            self._parsed = parse_json(body)
            return
        # A large body is parsed and walked on a thread: a megabyte of nested ``{}`` costs
        # hundreds of milliseconds of pure Python, which on the event loop would stall every
        # other request of the process. The thread still takes the GIL, but the interpreter
        # hands it back every few milliseconds, so the loop keeps serving meanwhile.
        self._parsed = await asyncio.to_thread(parse_json, body)

    async def json(self) -> Any:
        if not hasattr(self, "_parsed"):
            await self.parse()
        return self._parsed

    @property
    def has_body(self) -> bool:
        """Whether :meth:`parse` found a body (an empty one is none)."""
        return hasattr(self, "_parsed")


Authenticate = Callable[[Request], Awaitable[None]]
"""Checks a request's credentials from its headers alone, raising what the route's own
dependency would (``Unauthorized``, ``Forbidden``); run before the body is read."""


class JSONBodyRoute(APIRoute):
    """A route whose JSON body goes through :func:`parse_json` (routes without one: as is)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler
        authenticate = self._authenticate()

        async def parse_then_handle(request: Request) -> Response:
            parsed = JSONRequest(request.scope, request.receive)
            if authenticate is not None:
                await authenticate(parsed)
            await parsed.parse()
            return await handler(parsed)

        return parse_then_handle

    def _authenticate(self) -> Authenticate | None:
        """What checks the credentials before the body is read; None: nothing (the default)."""
        return None


def authenticated_by(authenticate: Authenticate) -> type[JSONBodyRoute]:
    """A :class:`JSONBodyRoute` class that runs ``authenticate`` before reading a body.

    FastAPI reads and parses a body before it solves a route's dependencies, so without this
    a request with no valid credential would have its body read and walked (:func:`parse_json`)
    before the authentication dependency refused it, and a malformed body would be answered
    400 instead of 401. ``authenticate`` leaves its result on ``request.state`` for the
    dependency to take, so credentials are looked up once.
    """

    class AuthenticatedRoute(JSONBodyRoute):
        def _authenticate(self) -> Authenticate | None:
            return authenticate

    return AuthenticatedRoute


ArgumentSolver = Callable[[JSONRequest], Awaitable[dict[str, Any]]]
"""The keyword arguments of a route's endpoint for a request, or the error FastAPI would raise."""


def solved_by(solve: ArgumentSolver) -> type[JSONBodyRoute]:
    """A :class:`JSONBodyRoute` class whose endpoint is called with the arguments ``solve`` gives.

    For the hottest route only (triggers). FastAPI solves each request's parameters and
    dependencies through generic machinery (a cache key per dependency, the sub-dependencies'
    recursion, each parameter's own validation), a large share of a trigger's CPU (see
    docs/performance.md); ``solve`` does the same work for one known signature
    directly, and must answer as the route's ordinary class would: the same errors in the
    same order (credentials first, before the body is read, as :func:`authenticated_by`; then
    the path, then the body, which ``solve`` parses with :meth:`JSONRequest.parse`;
    ``tests/api/test_runs.py`` compares the two). The route is still declared with the
    endpoint's full signature, so its OpenAPI operation (parameters, body schema, security) is
    FastAPI's as before. The endpoint must
    return a :class:`~starlette.responses.Response`: nothing validates or serializes what it
    returns.
    """

    class HandSolvedRoute(JSONBodyRoute):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            respond = self._responder()

            async def solve_then_answer(scope: Scope, receive: Receive, send: Send) -> None:
                response = await respond(scope, receive)
                await response(scope, receive, send)

            # In place of FastAPI's request_response(self.get_route_handler()): without a
            # dependency to close there is nothing for its two AsyncExitStacks to do, and an
            # exception goes on to the app's ExceptionMiddleware, whose handlers are the same
            # as those FastAPI's per-route wrapper would call. Used when the route is on the
            # app's own router; an included router's copy of the route uses the handler below.
            self.app = solve_then_answer

        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            respond = self._responder()

            async def solve_then_handle(request: Request) -> Response:
                return await respond(request.scope, request.receive)

            return solve_then_handle

        def _responder(self) -> Callable[[Scope, Receive], Coroutine[Any, Any, Response]]:
            """Parse the body, solve the endpoint's arguments, call it: its response."""
            endpoint = self.endpoint

            async def respond(scope: Scope, receive: Receive) -> Response:
                # ``solve`` reads the body (JSONRequest.parse) once the caller is known.
                request = JSONRequest(scope, receive)
                response: Response = await endpoint(**await solve(request))
                return response

            return respond

    return HandSolvedRoute
