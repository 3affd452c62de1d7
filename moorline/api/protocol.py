"""The HTTP/1.1 protocol ``moorline serve`` runs: uvicorn's httptools protocol, with limits.

uvicorn bounds what it has a setting for, and :func:`uvicorn_limits` passes them: requests
in progress (``limit_concurrency``) and idle kept-alive connections (``timeout_keep_alive``).
With httptools it has nothing more: a request head of any size or header count is read whole
into memory (one unterminated 64 MiB header cost ~62 MiB per connection), and neither a head
nor a body has a timeout, so a client sending a byte every few seconds holds its connection and
its buffers for ever. (h11's ``h11_max_incomplete_event_size`` bounds a head, but h11 costs an
API process noticeably more CPU per request than httptools, and times out nothing either.)

An ASGI middleware cannot add these: the app is called once a head is complete, so a head
that never completes never reaches it, and a body the app does not read (a request refused
before its body) is read by the server alone. So :class:`LimitedHttpToolsProtocol` adds them
in the protocol, from the parser's own callbacks:

- **Head size and count.** A request line and headers over ``MOORLINE_MAX_HEADER_BYTES``, or
  more than ``MOORLINE_MAX_HEADERS`` headers: 431 ``headers_too_large``, connection closed, app
  never called. The bytes of a head not yet ended are counted as they arrive, so a connection
  holds at most the limit plus one read of the socket (256 KiB with uvloop).
- **Head timeout.** The head must arrive within ``MOORLINE_HEADER_TIMEOUT`` of its first byte
  (of the connection's opening, for its first request): else 408 ``request_timeout`` and close
  (a connection that sent nothing is closed without an answer).
- **Body timeout.** The body must arrive within ``MOORLINE_BODY_TIMEOUT`` of the head's end,
  chunked or not, read by the app or not; the time the server itself stopped reading (the app
  has not taken what came) does not count. Else 408 (when no answer has started) and close;
  the app's ``receive`` sees a disconnect.
- **Connections.** A connection accepted while ``MOORLINE_MAX_CONNECTIONS`` are open is
  answered 503 ``server_busy`` and closed at once; uvicorn only checks when a request's head is
  complete, so idle connections would pile up before its check.
- **An answer before the body's end** (a chunked body over ``MOORLINE_MAX_BODY_BYTES`` gets its
  413 mid-body): the connection closes after the answer. uvicorn would read and drop the rest of
  the body, however long, to keep the connection alive.

Timeouts cost a request two clock reads, not a timer each: one timer per connection fires at
the earliest deadline, and re-arms itself when the deadline has moved on since.
"""

import asyncio
import logging
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from moorline.api.errors import raw_error_response
from moorline.errors import HeadersTooLarge, MoorlineError, RequestTimeout, ServerBusy
from moorline.settings import Settings

logger = logging.getLogger(__name__)

LINGER_S = 2.0
"""Seconds a refused connection still reads (and drops) what its client sends before it is
closed (see :meth:`LimitedHttpToolsProtocol._answer_and_close`)."""
LINGER_MAX_BYTES = 1024 * 1024
"""Bytes dropped at most while lingering: a client flooding past its refusal costs no more."""

HEADER_LINE_OVERHEAD = 4
"""``": "`` and ``"\\r\\n"`` around each header's name and value."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpLimits:
    """What one connection may send, and how slowly (the settings of the same names)."""

    max_header_bytes: int
    max_headers: int
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int

    @classmethod
    def from_settings(cls, settings: Settings) -> "HttpLimits":
        """The limits ``settings`` set."""
        return cls(
            max_header_bytes=settings.max_header_bytes,
            max_headers=settings.max_headers,
            header_timeout_s=settings.header_timeout,
            body_timeout_s=settings.body_timeout,
            max_connections=settings.max_connections,
        )


class _Reading(Enum):
    NOTHING_YET = "nothing yet"  # a new connection: no byte of a request
    HEAD = "head"
    BODY = "body"
    BETWEEN = "between"  # a request read whole; the answer and keep-alive are uvicorn's


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of the module docstring.

    Built per server by :func:`limited_protocol`, which sets :attr:`limits`.
    """

    limits: ClassVar[HttpLimits]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading = _Reading.NOTHING_YET
        self._unended_head_bytes = 0
        """Bytes received since the last head ended: a bound on the one being read."""
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._refusal: MoorlineError | None = None
        self._refused = False
        """Answered with a refusal: what still comes in is dropped."""
        self._dropped = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            # Never counted or read: the answer goes out and the socket closes.
            self.transport = transport
            self._answer_and_close(
                ServerBusy(
                    "the server holds as many connections as it allows; retry shortly",
                    retry_after_s=1,
                )
            )
            return
        super().connection_made(transport)
        self._set_deadline(self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._deadline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused or self.transport.is_closing():
            # Refused: nothing more is parsed; a client that goes on sending is cut off.
            self._dropped += len(data)
            if self._dropped > LINGER_MAX_BYTES:
                self.transport.close()
            return
        if self._reading is not _Reading.BODY:
            self._unended_head_bytes += len(data)
        super().data_received(data)
        if (
            self._reading in (_Reading.NOTHING_YET, _Reading.HEAD)
            and self._unended_head_bytes > self.limits.max_header_bytes
            and not (self._refused or self.transport.is_closing())
        ):
            # A head that has not ended yet (one huge header, say): refused before the parser
            # buffers more of it.
            self._answer_and_close(self._head_too_large())

    # The parser's callbacks (httptools calls them while data_received feeds it).

    def on_message_begin(self) -> None:
        if self._reading is not _Reading.NOTHING_YET:
            self._set_deadline(self.limits.header_timeout_s)
        self._reading = _Reading.HEAD
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        # Checked once the head is whole rather than header by header: a callback more per
        # header cost every request measurably, and until here the unended head's bytes are
        # bounded by data_received's count (a head complete in one read is at most that read).
        limits = self.limits
        if len(self.headers) > limits.max_headers or (
            len(self.url)
            + sum(len(name) + len(value) for name, value in self.headers)
            + HEADER_LINE_OVERHEAD * len(self.headers)
            > limits.max_header_bytes
        ):
            # Raised through the parser, which stops there; uvicorn's handler of parser errors
            # calls send_400_response, which answers this refusal instead.
            self._refusal = self._head_too_large()
            raise self._refusal
        self._reading = _Reading.BODY
        self._unended_head_bytes = 0
        self._set_deadline(limits.body_timeout_s)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._reading = _Reading.BETWEEN
        self._deadline = None
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._reading is _Reading.BODY and not self.transport.is_closing():
            # Answered before the body ended (a 413 mid-body, say): uvicorn would read and
            # drop the rest, however long, to keep the connection. Not worth it: close. The
            # rest stays unread, so a client still sending is held back by its own socket's
            # buffers, and reads the answer, rather than reset by a quick drop limit.
            self._refused = True
            self._close_lingering(drop=False)

    def send_400_response(self, msg: str) -> None:
        # uvicorn answers 400 to every error the parser raises, those of our callbacks too.
        refusal, self._refusal = self._refusal, None
        if refusal is None:
            super().send_400_response(msg)
        else:
            self._answer_and_close(refusal)

    def _head_too_large(self) -> HeadersTooLarge:
        return HeadersTooLarge(
            f"the request's headers are over the limit of {self.limits.max_header_bytes} bytes "
            f"or {self.limits.max_headers} headers"
        )

    # Timeouts.

    def _set_deadline(self, seconds: float) -> None:
        now = self.loop.time()
        self._deadline = now + seconds
        if self._deadline < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = self._deadline
            self._timer = self.loop.call_at(self._deadline, self._on_timer)

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, math.inf
        if self._deadline is None or self._refused or self.transport.is_closing():
            return
        if self._reading is _Reading.BODY and self.flow.read_paused:
            # The server stopped reading (the app has not taken the body so far, or a
            # pipelined request waits): the client is not the slow one.
            self._set_deadline(self.limits.body_timeout_s)
            return
        if self.loop.time() < self._deadline:
            self._set_deadline(self._deadline - self.loop.time())
            return
        self._time_out()

    def _time_out(self) -> None:
        if self._reading is _Reading.NOTHING_YET:
            self.transport.close()  # nothing was asked: nothing to answer
            return
        what = "headers" if self._reading is _Reading.HEAD else "body"
        limit = (
            self.limits.header_timeout_s
            if self._reading is _Reading.HEAD
            else self.limits.body_timeout_s
        )
        self._answer_and_close(RequestTimeout(f"the request's {what} took over {limit:g}s"))

    def _answer_and_close(self, refusal: MoorlineError) -> None:
        """Answer ``refusal`` (unless a response is under way) and close the connection."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # The app runs this request: it sees a disconnect, and what it sends goes nowhere.
            cycle.disconnected = True
            cycle.message_event.set()
        logger.info(
            "%s %s: %s",
            _address(self.client),
            refusal.status,
            refusal.message,
            extra={"code": refusal.code},
        )
        if cycle is None or cycle.response_complete or not cycle.response_started:
            self.transport.write(raw_error_response(refusal))
        self._refused = True
        self._close_lingering()

    def _close_lingering(self, *, drop: bool = True) -> None:
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        # A lingering close, as nginx's: closing a socket with unread bytes in it sends a
        # reset, which can destroy the answer before the client reads it. So the answer goes
        # out with a FIN, and what still comes in is read and dropped (or, with drop=False,
        # left unread) until the client closes (eof_received), LINGER_S passes or it has sent
        # LINGER_MAX_BYTES more.
        self.transport.write_eof()
        if self.flow is not None:
            if drop:
                self.flow.resume_reading()
            else:
                self.flow.pause_reading()
        self.loop.call_later(LINGER_S, self.transport.close)


def _address(client: tuple[str, int] | None) -> str:
    return "unknown client" if client is None else f"{client[0]}:{client[1]}"


def limited_protocol(limits: HttpLimits) -> type[LimitedHttpToolsProtocol]:
    """A :class:`LimitedHttpToolsProtocol` class holding ``limits``, for one server.

    uvicorn builds a protocol per connection from the class it is given (``http=``), with its
    own arguments only; the class is made per server so that nothing is module-level.
    """
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})


def uvicorn_limits(settings: Settings) -> dict[str, Any]:
    """The ``uvicorn.Config`` arguments that bound connections, for ``moorline serve``."""
    limits = HttpLimits.from_settings(settings)
    return {
        "http": limited_protocol(limits),
        # The protocol refuses a connection beyond max_connections when it opens; uvicorn's own
        # check (a 503 once a request's head is complete) stays for requests in progress whose
        # clients went away, which it counts and the protocol does not: one more, so that it
        # does not also refuse every request of the last admitted connection.
        "limit_concurrency": limits.max_connections + 1,
        "timeout_keep_alive": math.ceil(settings.keep_alive_timeout),
    }
