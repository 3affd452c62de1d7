"""The async client's HTTP/1.1 transport: kept-alive connections, parsed by httptools.

Why not httpx's own pool (httpcore): with many requests in flight it costs far more CPU than
the requests. Every request and every answer rescans all pending requests against all
connections (quadratic in the concurrency) and probes each idle connection's socket, and the
anyio layer under it adds a few context managers per read; at 64 in flight one client spent
about 1 ms of CPU per trigger there (bench/client_cpu.py). Here an idle connection is popped
from a stack, its socket is an :class:`asyncio.Protocol` (no stream layer), and httptools,
already a dependency for ``moorline serve``, parses the answers. httpx stays the interface for
everything but the client's own calls (event streams, tests that pass their own transport:
``httpx.Request`` in, ``httpx.Response`` out); :class:`~moorline.client.Client`'s calls are
written as bytes and read back as bytes (:meth:`KeepAliveTransport.send`), since building
those two objects cost more CPU than the rest of a request.

What it does not do, because a Moorline server does not need it: HTTP/2, proxies, and
``Expect: 100-continue``. ``https`` URLs get a default TLS context (certificates verified).
"""

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import httptools
import httpx

MAX_CONNECTIONS = 256
"""Connections open at once; a request beyond them waits for one (the pool timeout)."""

IDLE_EXPIRY_S = 4.0
"""An idle connection older than this is closed instead of reused: below uvicorn's default
keep-alive timeout (5 s) and ``moorline serve``'s (20 s), so a request is not written to a
socket the server is closing at that moment."""

IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
"""Requests sent again when a kept-alive connection turns out closed before any answer."""

HIGH_WATER_BYTES = 256 * 1024
"""Unread body bytes after which the connection stops reading until the caller catches up."""


def origin_of(url: httpx.URL) -> tuple[bytes, bytes, int]:
    """The server of ``url`` as the transport keys its connections: scheme, host and port."""
    port = url.port or (443 if url.scheme == "https" else 80)
    return url.raw_scheme, url.raw_host, port


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection; it carries one exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.key: tuple[bytes, bytes, int] | None = None
        self.closed = False
        self.answered = False
        """Whether any byte of the current exchange's answer arrived."""
        self.idle_since = 0.0
        self._parser: Any = None
        self._status = 0
        self._headers: list[tuple[bytes, bytes]] = []
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._head_done = False
        self.complete = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    # --- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.answered = True
        if self._parser is None:  # bytes nobody asked for: the connection is unusable
            self._fail(httpx.RemoteProtocolError("the server sent data without a request"))
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed answer: {exc}"))

    def eof_received(self) -> bool:
        self._end_of_input()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_of_input(exc)

    # --- httptools callbacks ------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()
        self._head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER_BYTES and not self._paused and self.transport:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        if not self._parser.should_keep_alive():
            self.closed = True  # closed once read: see _finish
        self._parser = None
        self._wake()

    # --- the exchange ---------------------------------------------------------------------------

    def start(self, data: bytes) -> None:
        """Send one request (head and body) and get ready for its answer."""
        assert self.transport is not None
        self._parser = httptools.HttpResponseParser(self)
        self.answered = False
        self._status, self._headers = 0, []
        self._head_done = self.complete = False
        self.transport.write(data)

    async def head(self, timeout_s: float | None) -> tuple[int, list[tuple[bytes, bytes]]]:
        """The answer's status and headers."""
        while not self._head_done:
            await self._wait(timeout_s)
        return self._status, self._headers

    async def body(self, timeout_s: float | None) -> AsyncIterator[bytes]:
        """The answer's body, chunk by chunk, as it arrives."""
        while True:
            while self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._paused and self._buffered <= HIGH_WATER_BYTES // 4 and self.transport:
                    self._paused = False
                    self.transport.resume_reading()
                yield chunk
            if self.complete:
                return
            await self._wait(timeout_s)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # --- plumbing ---------------------------------------------------------------------------------

    async def _wait(self, timeout_s: float | None) -> None:
        if self._error is not None:
            raise self._error
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            if timeout_s is None:
                await self._waiter
            else:
                async with asyncio.timeout(timeout_s):
                    await self._waiter
        except TimeoutError:
            self.close()
            raise httpx.ReadTimeout("the server did not answer in time") from None
        finally:
            self._waiter = None
        if self._error is not None:
            raise self._error

    def _is_framed(self) -> bool:
        """Whether the answer says where it ends (a length, or chunks)."""
        for name, value in self._headers:
            lowered = name.lower()
            if lowered == b"content-length" or (
                lowered == b"transfer-encoding" and b"chunked" in value.lower()
            ):
                return True
        return False

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self.close()
        self._wake()

    def _end_of_input(self, exc: Exception | None = None) -> None:
        self.closed = True
        parser = self._parser
        if parser is not None:
            # An answer without a length ends with the connection (httptools has no call for
            # the end of input); anything else was cut off.
            if self._head_done and not self._is_framed():
                self.complete = True
                self._parser = None
            if not self.complete:
                reason = str(exc) if exc else "the server closed the connection"
                self._fail(httpx.RemoteProtocolError(f"incomplete answer: {reason}"))
        self._wake()


class _Body(httpx.AsyncByteStream):
    """An answer's body; closing it hands the connection back to the pool (or closes it)."""

    def __init__(
        self, pool: "KeepAliveTransport", connection: _Connection, timeout_s: float | None
    ) -> None:
        self._pool = pool
        self._connection = connection
        self._timeout_s = timeout_s

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._connection.body(self._timeout_s):
            yield chunk

    async def aclose(self) -> None:
        self._pool.release(self._connection)


class KeepAliveTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 with kept-alive connections, one exchange per connection at a time.

    Args:
        max_connections: Connections open at once (see :data:`MAX_CONNECTIONS`).
        ssl_context: TLS settings for ``https`` URLs; default: verified certificates.
    """

    def __init__(
        self, *, max_connections: int = MAX_CONNECTIONS, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self._idle: dict[tuple[bytes, bytes, int], list[_Connection]] = {}
        self._slots = asyncio.Semaphore(max_connections)
        self._ssl_context = ssl_context
        self._open: set[_Connection] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        url = request.url
        content = await request.aread()
        head = [request.method.encode(), b" ", url.raw_path, b" HTTP/1.1\r\n"]
        for name, value in request.headers.raw:
            head += (name, b": ", value, b"\r\n")
        head.append(b"\r\n")
        data = b"".join(head) + content
        connection, status, headers = await self._exchange(
            origin_of(url), request.method, data, timeouts
        )
        return httpx.Response(
            status,
            headers=headers,
            stream=_Body(self, connection, timeouts.get("read")),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def send(
        self,
        origin: tuple[bytes, bytes, int],
        method: str,
        data: bytes,
        timeouts: dict[str, float | None],
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """Send a request already written as bytes and read its whole answer.

        The client's own calls come this way, with no ``httpx.Request`` or ``httpx.Response``
        built around them (see :meth:`~moorline.client.calls.RequestBuilder.encode`).

        Args:
            origin: The server: scheme, host and port.
            method: The request's method (whether it may be sent again, see
                :data:`IDEMPOTENT_METHODS`).
            data: The whole request, head and body.
            timeouts: ``connect``, ``read`` and ``pool``, in seconds (None: no limit).

        Returns:
            The answer's status, headers and body.
        """
        connection, status, headers = await self._exchange(origin, method, data, timeouts)
        body: list[bytes] = []
        try:
            async for chunk in connection.body(timeouts.get("read")):
                body.append(chunk)
        finally:
            self.release(connection)
        return status, headers, b"".join(body)

    async def _exchange(
        self,
        key: tuple[bytes, bytes, int],
        method: str,
        data: bytes,
        timeouts: dict[str, float | None],
    ) -> tuple[_Connection, int, list[tuple[bytes, bytes]]]:
        """Send ``data`` on an idle connection (or a new one); the connection and answer head."""
        while True:
            connection = self._take_idle(key)
            reused = connection is not None
            if connection is None:
                connection = await self._connect(key, timeouts)
            try:
                connection.start(data)
                status, headers = await connection.head(timeouts.get("read"))
                return connection, status, headers
            except httpx.RemoteProtocolError:
                self._discard(connection)
                # A kept-alive connection the server closed as the request went out (its idle
                # timeout): nothing was answered, so a request that may be repeated is sent
                # again on a fresh connection. Others (a trigger) raise: they may have landed.
                if reused and not connection.answered and method in IDEMPOTENT_METHODS:
                    continue
                raise
            except BaseException:
                self._discard(connection)
                raise

    def release(self, connection: _Connection) -> None:
        """Take back a connection whose answer was read (or abandoned)."""
        if connection.closed or not connection.complete or connection.key is None:
            self._discard(connection)
            return
        connection.idle_since = time.monotonic()
        self._idle.setdefault(connection.key, []).append(connection)

    async def aclose(self) -> None:
        for connection in list(self._open):
            connection.close()
        self._open.clear()
        self._idle.clear()

    def _take_idle(self, key: tuple[bytes, bytes, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            connection = idle.pop()  # the most recently used: the least likely to expire
            if not connection.closed and now - connection.idle_since < IDLE_EXPIRY_S:
                return connection
            self._discard(connection)
        return None

    async def _connect(
        self, key: tuple[bytes, bytes, int], timeouts: dict[str, float | None]
    ) -> _Connection:
        loop = asyncio.get_running_loop()
        host = key[1].decode("ascii")
        tls: ssl.SSLContext | None = None
        if key[0] == b"https":
            if self._ssl_context is None:
                self._ssl_context = ssl.create_default_context()
            tls = self._ssl_context
        try:
            async with asyncio.timeout(timeouts.get("pool")):
                await self._slots.acquire()
        except TimeoutError:
            raise httpx.PoolTimeout("no connection became free in time") from None
        try:
            async with asyncio.timeout(timeouts.get("connect")):
                _, connection = await loop.create_connection(
                    _Connection, host, key[2], ssl=tls, server_hostname=host if tls else None
                )
        except TimeoutError:
            self._slots.release()
            raise httpx.ConnectTimeout(f"could not connect to {host}:{key[2]} in time") from None
        except OSError as exc:
            self._slots.release()
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
        connection.key = key
        self._open.add(connection)
        return connection

    def _discard(self, connection: _Connection) -> None:
        connection.close()
        if connection in self._open:
            self._open.discard(connection)
            self._slots.release()
