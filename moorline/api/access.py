"""The access log of ``moorline serve``: a line per request, or per refused or failed request.

``MOORLINE_ACCESS_LOG`` (:class:`~moorline.settings.AccessLog`) chooses. ``all`` is uvicorn's
own access log (logger ``uvicorn.access``). ``errors`` (the default) is :class:`ErrorAccessLog`,
which writes uvicorn's line, through the logger ``moorline.access``, only for the requests
answered with a status of 400 or more: a line costs a LogRecord, the redacting formatter and a
write to stderr, several per cent of a trigger's CPU in a server that accepts hundreds a
second, while the lines an operator looks for are the refusals and the failures. It wraps the
whole application, outside Starlette's ``ServerErrorMiddleware``, so the 500 that middleware
answers is logged too.
"""

import logging
import urllib.parse

from starlette.types import ASGIApp, Message, Receive, Scope, Send

ACCESS_LOGGER = "moorline.access"
"""Not uvicorn's own ``uvicorn.access``: uvicorn writes a line per request to that logger
whenever it has a handler, and it is off (no handler, no propagation) exactly so that uvicorn
does not."""

FIRST_LOGGED_STATUS = 400


class ErrorAccessLog:
    """Log uvicorn's access line for each HTTP response of status 400 or more (module doc)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._logger = logging.getLogger(ACCESS_LOGGER)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_logging_errors(message: Message) -> None:
            if message["type"] == "http.response.start":
                status: int = message["status"]
                if status >= FIRST_LOGGED_STATUS:
                    self._log(scope, status)
            await send(message)

        await self.app(scope, receive, send_logging_errors)

    def _log(self, scope: Scope, status: int) -> None:
        # As uvicorn.protocols.utils.get_client_addr and get_path_with_query_string.
        client = scope.get("client")
        path = urllib.parse.quote(scope["path"])
        query: bytes = scope.get("query_string", b"")
        self._logger.info(
            '%s - "%s %s HTTP/%s" %d',
            f"{client[0]}:{client[1]}" if client else "",
            scope["method"],
            f"{path}?{query.decode('ascii')}" if query else path,
            scope["http_version"],
            status,
        )
