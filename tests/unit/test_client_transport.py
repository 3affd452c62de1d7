"""The async client's transport (moorline.client.transport) against a real HTTP/1.1 server.

The server is a small asyncio one written here, so that each test can see what a real server
cannot show: how many connections the client opened, and answers framed every way HTTP/1.1
allows (a length, chunks, the end of the connection).
"""

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from moorline import Client, SyncClient
from moorline.api.protocol import uvicorn_limits
from moorline.client import calls
from moorline.client.calls import RequestBuilder, get_run
from moorline.client.transport import IDLE_EXPIRY_S, KeepAliveTransport
from moorline.settings import Settings


@dataclass
class Server:
    url: str
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    drop_next_reused: bool = False
    """Close the next request on a kept-alive connection unanswered (its idle timeout, say)."""


async def _answer(path: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
    """Write the answer for ``path``; False when the connection must close after it."""
    if path == b"/chunked":
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for part in (b"data: 1\n\n", b"data: 2\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
            await asyncio.sleep(0)
        writer.write(b"0\r\n\r\n")
        return True
    if path == b"/close":
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
        return False
    answer = b'{"echo": "%s"}' % body
    writer.write(b"HTTP/1.1 202 Accepted\r\nContent-Length: %d\r\n\r\n%s" % (len(answer), answer))
    return True


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    state = Server(url="")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.connections += 1
        state.writers.append(writer)
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if served and state.drop_next_reused:
                    state.drop_next_reused = False
                    break
                served += 1
                lines = head.split(b"\r\n")
                path = lines[0].split(b" ")[1]
                length = 0
                for line in lines[1:]:
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                state.requests.append(path)
                if not await _answer(path, body, writer):
                    break
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    listening = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    state.url = f"http://127.0.0.1:{port}"
    async with listening:
        yield state


async def test_concurrent_requests_reuse_one_connection_each(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, transport=KeepAliveTransport()) as http:

        async def loop(n: int) -> None:
            for i in range(25):
                response = await http.post("/runs", content=f"{n}-{i}".encode())
                assert response.status_code == 202
                assert response.json() == {"echo": f"{n}-{i}"}

        await asyncio.gather(*(loop(n) for n in range(8)))
    assert len(server.requests) == 200
    # Kept alive: at most one connection per request in flight, never one per request.
    assert server.connections <= 8


async def test_chunked_and_close_delimited_answers_are_read_whole(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, transport=KeepAliveTransport()) as http:
        async with http.stream("GET", "/chunked") as response:
            lines = [line async for line in response.aiter_lines() if line]
        assert lines == ["data: 1", "data: 2"]
        assert (await http.get("/close")).text == "until the end"
        assert (await http.post("/runs", content=b"after")).json() == {"echo": "after"}
    # The chunked answer's connection was reused; the closed one was not.
    assert server.connections == 2


async def test_a_connection_the_server_closed_while_idle_is_not_reused(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, transport=KeepAliveTransport()) as http:
        assert (await http.post("/runs", content=b"one")).status_code == 202
        for writer in server.writers:
            writer.close()  # the server's keep-alive timeout, say
        await asyncio.sleep(0.05)  # let the client's loop read the end of the connection
        assert (await http.post("/runs", content=b"two")).json() == {"echo": "two"}
    assert server.connections == 2


async def test_a_request_the_server_dropped_on_a_reused_connection(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, transport=KeepAliveTransport()) as http:
        assert (await http.post("/runs", content=b"one")).status_code == 202
        server.drop_next_reused = True
        # A GET may be repeated: sent again on a fresh connection, answered.
        assert (await http.get("/runs")).status_code == 202
        server.drop_next_reused = True
        # A POST may have landed: the error is the caller's to handle.
        with pytest.raises(httpx.RemoteProtocolError):
            await http.post("/runs", content=b"three")
    assert server.requests == [b"/runs", b"/runs"]


async def test_an_unreachable_server_is_a_connect_error() -> None:
    with socket_closed() as url:
        async with httpx.AsyncClient(base_url=url, transport=KeepAliveTransport()) as http:
            with pytest.raises(httpx.ConnectError):
                await http.get("/healthz")


class socket_closed:
    """A URL on a port nothing listens on (bound, then closed)."""

    def __enter__(self) -> str:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc_info: object) -> None:
        return None


def test_requests_keep_the_base_url_path_and_quote_ids() -> None:
    built = RequestBuilder("http://h:1/prefix/", 5.0).build(get_run("a/b"), {"X": "y"})
    assert str(built.url) == "http://h:1/prefix/v1/runs/a%2Fb"
    assert built.headers["x"] == "y" and built.headers["accept"] == "application/json"
    assert str(RequestBuilder("http://h:1", 5.0).build(get_run("r"), {}).url) == (
        "http://h:1/v1/runs/r"
    )


ENCODED_CALLS = [
    calls.trigger(
        "echo é/1",
        {"x": "é", "n": [1, 2.5, None]},
        idempotency_key="k",
        conversation_id="c",
        delay_seconds=1.5,
    ),
    calls.trigger("echo", None, idempotency_key=None, conversation_id=None, delay_seconds=None),
    calls.trigger_batch("echo", [{"input": {"i": 1}}, {"input": {}, "idempotency_key": "b"}]),
    calls.get_run("a/b?c"),
    calls.list_runs({"status": "queued", "workflow": "a b&c"}, limit=5, cursor="x+y=="),
    calls.list_tenants(limit=None, cursor=None),
    calls.cancel("r"),
    calls.rerun("r", idempotency_key=None, admin=True),
    calls.delete_schedule("s 1"),
    calls.edit_schedule("s", {"paused": True}),
    calls.post_message("r", "hello \u2603"),
]


@pytest.mark.parametrize("base", ["http://h:1", "http://h:1/prefix/", "https://example.org"])
@pytest.mark.parametrize("call", ENCODED_CALLS, ids=lambda call: f"{call.method} {call.path}")
async def test_encoded_requests_are_the_bytes_httpx_would_send(
    base: str, call: calls.Call[Any]
) -> None:
    """The client's own calls skip ``httpx.Request``: what they send must not change."""
    builder = RequestBuilder(base, 5.0)
    headers = {"Authorization": "Bearer secret"}
    built = builder.build(call, headers)
    head = [built.method.encode(), b" ", built.url.raw_path, b" HTTP/1.1\r\n"]
    for name, value in built.headers.raw:
        head += (name, b": ", value, b"\r\n")
    assert builder.encode(call, headers) == b"".join(head) + b"\r\n" + await built.aread()


async def test_a_proxy_in_the_environment_leaves_the_requests_to_httpx(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with Client("http://127.0.0.1:1", "key") as direct:
        assert isinstance(direct._transport, KeepAliveTransport)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    async with Client("http://127.0.0.1:1", "key") as proxied:
        assert proxied._transport is None
    with SyncClient("http://127.0.0.1:1", "key") as sync:
        assert sync._transport is None


def test_the_server_keeps_idle_connections_longer_than_clients_do() -> None:
    # Whoever drops an idle connection first must be the client: a server closing it as a
    # request goes out loses that request unanswered (a POST raises). httpx's own pool and
    # moorline.Client both expire idle connections before `moorline serve` closes them.
    server_s = uvicorn_limits(Settings())["timeout_keep_alive"]
    httpx_expiry = httpx.Limits().keepalive_expiry
    assert httpx_expiry is not None
    assert IDLE_EXPIRY_S < server_s
    assert httpx_expiry < server_s
