"""uvicorn's httptools protocol, with the writes of one loop iteration sent as one.

uvicorn writes a response's status line and headers when the application sends
``http.response.start``, and its body when it sends ``http.response.body``: two ``send``
system calls, and on the client's side two reads, for every response, although a Starlette
response sends both messages one after the other without ever giving the event loop a turn.
:class:`CoalescingHttpToolsProtocol` hands uvicorn a :class:`CoalescingTransport` instead of the
connection's transport: it keeps what is written, and writes it all at once when the event loop
next runs its callbacks (or at once, when the connection is closed). A response is then one
write; a stream (Server-Sent Events) is written as soon as it yields to the loop, as before.
"""

import asyncio
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescingTransport:
    """A transport that writes what it was given during one loop iteration in one write.

    Everything else is the wrapped transport's: closing writes what is pending first.

    Args:
        transport: The connection's transport.
        loop: The event loop the protocol runs on.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        """Keep ``data`` to write with the rest of this loop iteration's writes."""
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(data)

    def flush(self) -> None:
        """Write what is pending now, in one write."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        if not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        """Write what is pending, then close the connection."""
        self.flush()
        self._transport.close()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        """Hand the connection to another protocol (an upgrade) after what is pending."""
        self.flush()
        self._transport.set_protocol(protocol)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over a :class:`CoalescingTransport` (see the module doc)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        coalescing = CoalescingTransport(transport, self.loop)
        super().connection_made(cast(asyncio.Transport, coalescing))
