"""Raw sockets against a real ``moorline serve``: the limits of moorline.api.protocol.

Each test is a client uvicorn alone would serve for ever or without bound: a huge or
unterminated head, too many headers, a head or a body sent a byte at a time, a connection that
says nothing, more connections than allowed. The server runs with small limits so that each
refusal comes within a second or two.
"""

import asyncio
import contextlib
import json
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import ADMIN, ADMIN_TOKEN
from tests.integration.test_cli import cli_env, free_port

MAX_HEADER_BYTES = 8192
MAX_HEADERS = 40
HEADER_TIMEOUT_S = 1.5
BODY_TIMEOUT_S = 1.5
MAX_CONNECTIONS = 6
ANSWER_WITHIN_S = 15.0
"""How long a test waits for an answer the server owes it: generous, since a refusal that never
comes fails the test either way, and the machine may be loaded."""


@dataclass
class Server:
    host: str
    port: int
    api_key: str
    process: subprocess.Popen[bytes]
    log: Path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("limits")
    port = free_port()
    log = root / "serve.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "moorline", "serve", "--port", str(port), "--workers", "0"],
            cwd=root,
            env=cli_env(
                MOORLINE_DATABASE_URL=f"sqlite+aiosqlite:///{root / 'moorline.db'}",
                MOORLINE_ADMIN_TOKEN=ADMIN_TOKEN,
                MOORLINE_APP="tests.api.workflows:app",
                MOORLINE_MAX_HEADER_BYTES=str(MAX_HEADER_BYTES),
                MOORLINE_MAX_HEADERS=str(MAX_HEADERS),
                MOORLINE_HEADER_TIMEOUT=str(HEADER_TIMEOUT_S),
                MOORLINE_BODY_TIMEOUT=str(BODY_TIMEOUT_S),
                MOORLINE_MAX_CONNECTIONS=str(MAX_CONNECTIONS),
            ),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        with httpx.Client(base_url=url, timeout=5.0) as client:
            while True:
                assert process.poll() is None, log.read_text()
                with contextlib.suppress(httpx.TransportError):
                    if client.get("/readyz").status_code == 200:
                        break
                assert time.monotonic() < deadline, "moorline serve did not become ready"
                time.sleep(0.05)
            created = client.post(
                "/v1/admin/tenants", json={"name": "limits", "plan": "team"}, headers=ADMIN
            )
            assert created.status_code == 201, created.text
        yield Server("127.0.0.1", port, created.json()["api_key"], process, log)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.asynccontextmanager
async def connection(
    server: Server,
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """The status, headers and body of the next response (a Content-Length one)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_WITHIN_S)
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in filter(None, lines):
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(status_line.split()[1]), headers, body


def error_code(body: bytes) -> str:
    code: str = json.loads(body)["error"]["code"]
    return code


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Whether the server closes the connection (after whatever it still sends) in time."""
    with contextlib.suppress(ConnectionError):
        await asyncio.wait_for(reader.read(), seconds)
    return reader.at_eof()


def head(server: Server, *lines: str, method: str = "GET", path: str = "/healthz") -> bytes:
    return "\r\n".join(
        [f"{method} {path} HTTP/1.1", f"Host: {server.host}", *lines, "", ""]
    ).encode()


async def test_a_head_under_the_limits_is_served(server: Server) -> None:
    async with connection(server) as (reader, writer):
        writer.write(head(server, *(f"X-Pad-{i}: {'a' * 100}" for i in range(MAX_HEADERS - 2))))
        status, _, _ = await read_answer(reader)
    assert status == 200


async def test_headers_over_the_byte_limit_are_431(server: Server) -> None:
    async with connection(server) as (reader, writer):
        writer.write(head(server, f"X-Big: {'a' * MAX_HEADER_BYTES}"))
        status, headers, body = await read_answer(reader)
        assert await closed_within(reader, ANSWER_WITHIN_S)
    assert (status, error_code(body)) == (431, "headers_too_large")
    assert headers["connection"] == "close"


async def test_more_headers_than_allowed_are_431(server: Server) -> None:
    async with connection(server) as (reader, writer):
        writer.write(head(server, *(f"X-{i}: 1" for i in range(MAX_HEADERS + 1))))
        status, _, body = await read_answer(reader)
    assert (status, error_code(body)) == (431, "headers_too_large")


async def test_an_unterminated_header_is_refused_after_about_the_limit(server: Server) -> None:
    # One header that never ends: uvicorn with httptools buffered all of it (64 MiB: ~62 MiB
    # of server memory per connection). Refused once the limit is passed, so only socket
    # buffers' worth is ever sent.
    sent, answer = await asyncio.to_thread(send_until_answered, server, 64 * 1024 * 1024)
    status_line, _, body = answer.partition(b"\r\n\r\n")
    assert status_line.startswith(b"HTTP/1.1 431"), answer
    assert error_code(body) == "headers_too_large"
    assert sent < 16 * 1024 * 1024, sent


def send_until_answered(server: Server, limit: int) -> tuple[int, bytes]:
    """Send a head whose last header never ends, reading whenever the server has answered.

    A plain socket and select(): an answer is read as soon as it arrives, never left in the
    kernel's buffer while more is sent (a server that then closes would reset it away).
    """
    answer = b""
    sent = 0
    with socket.create_connection((server.host, server.port), timeout=ANSWER_WITHIN_S) as sock:
        sock.sendall(head(server)[:-2] + b"X-Endless: ")
        chunk = b"a" * 65536
        deadline = time.monotonic() + ANSWER_WITHIN_S
        while time.monotonic() < deadline:
            readable, writable, _ = select.select([sock], [sock] if sent < limit else [], [], 1.0)
            if readable:
                try:
                    received = sock.recv(65536)
                except ConnectionError:
                    break
                if not received:
                    break
                answer += received
            elif writable:
                try:
                    sent += sock.send(chunk)
                except ConnectionError:
                    break
    return sent, answer


async def test_a_head_sent_too_slowly_is_408(server: Server) -> None:
    async with connection(server) as (reader, writer):
        writer.write(head(server)[:-2])
        started = time.monotonic()

        async def trickle() -> None:
            with contextlib.suppress(ConnectionError):
                for i in range(1000):  # a header line every 0.2 s, each resetting nothing
                    writer.write(f"X-Slow-{i}: 1\r\n".encode())
                    await writer.drain()
                    await asyncio.sleep(0.2)

        sending = asyncio.create_task(trickle())
        try:
            status, _, body = await read_answer(reader)
        finally:
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
    assert (status, error_code(body)) == (408, "request_timeout")
    assert time.monotonic() - started >= HEADER_TIMEOUT_S - 0.1


async def test_a_connection_that_sends_nothing_is_closed(server: Server) -> None:
    async with connection(server) as (reader, _):
        assert await closed_within(reader, ANSWER_WITHIN_S)
        assert await reader.read() == b""  # closed without an answer: nothing was asked


async def test_a_body_sent_too_slowly_is_408(server: Server) -> None:
    body = json.dumps({"input": {"message": "x" * 200}}).encode()
    async with connection(server) as (reader, writer):
        writer.write(
            head(
                server,
                f"Authorization: Bearer {server.api_key}",
                "Content-Type: application/json",
                f"Content-Length: {len(body)}",
                method="POST",
                path="/v1/workflows/echo/runs",
            )
            + body[:10]
        )
        status, _, answer = await read_answer(reader)
        assert await closed_within(reader, ANSWER_WITHIN_S)
    assert (status, error_code(answer)) == (408, "request_timeout")


async def test_a_chunked_body_sent_a_chunk_at_a_time_too_slowly_is_408(server: Server) -> None:
    async with connection(server) as (reader, writer):
        writer.write(
            head(
                server,
                f"Authorization: Bearer {server.api_key}",
                "Content-Type: application/json",
                "Transfer-Encoding: chunked",
                method="POST",
                path="/v1/workflows/echo/runs",
            )
        )

        async def trickle() -> None:
            with contextlib.suppress(ConnectionError):
                for _ in range(1000):  # a one-byte chunk every 0.2 s, never the last one
                    writer.write(b"1\r\n \r\n")
                    await writer.drain()
                    await asyncio.sleep(0.2)

        sending = asyncio.create_task(trickle())
        try:
            status, _, answer = await read_answer(reader)
        finally:
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
    assert (status, error_code(answer)) == (408, "request_timeout")


async def test_a_kept_alive_connection_serves_request_after_request(server: Server) -> None:
    # The head timeout runs per request, from its first byte: a connection that lives longer
    # than it, busy, is never cut.
    async with connection(server) as (reader, writer):
        started = time.monotonic()
        served = 0
        while time.monotonic() - started < HEADER_TIMEOUT_S * 2:
            writer.write(head(server))
            status, _, _ = await read_answer(reader)
            assert status == 200
            served += 1
    assert served > 1


async def test_connections_beyond_the_limit_are_503(server: Server) -> None:
    async with contextlib.AsyncExitStack() as held:
        served = 0
        refused: tuple[int, bytes] | None = None
        for _ in range(MAX_CONNECTIONS + 1):
            reader, writer = await held.enter_async_context(connection(server))
            writer.write(head(server))  # kept alive: the connection stays counted
            status, _, body = await read_answer(reader)
            if status != 200:
                refused = (status, body)
                break
            served += 1
        assert refused is not None, "every connection was served"
        assert (refused[0], error_code(refused[1])) == (503, "server_busy")
        assert served == MAX_CONNECTIONS
    # Once they close, the server takes connections again.
    deadline = time.monotonic() + ANSWER_WITHIN_S
    while True:
        async with connection(server) as (reader, writer):
            writer.write(head(server))
            status, _, _ = await read_answer(reader)
        if status == 200:
            break
        assert time.monotonic() < deadline, "the server kept refusing connections"
        await asyncio.sleep(0.05)
