"""``moorline.Client`` without a Moorline server: error bodies become the right classes, the
SSE stream resumes after a dropped connection, and client commands fail in one line.

The resume test serves a real socket (a few lines of asyncio) that drops the first
connection in the middle of a chunked body, as a proxy or a server restart would.
"""

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from moorline import Client, SyncClient
from moorline.cli.banner import start_banner
from moorline.cli.main import main
from moorline.client import ApiError, Event, error_from_response, parse_sse
from moorline.errors import (
    Conflict,
    ConversationBusy,
    InvalidInput,
    InvalidRequest,
    QuotaExceeded,
    RateLimited,
    RunNotFound,
)
from moorline.settings import Settings
from tests.integration.test_cli import free_port


def answer(status: int, body: object, **headers: str) -> httpx.Response:
    request = httpx.Request("GET", "http://moorline.test/v1/x")
    if isinstance(body, str):
        return httpx.Response(status, text=body, headers=headers, request=request)
    return httpx.Response(status, json=body, headers=headers, request=request)


def error(code: str, message: str, **extra: object) -> dict[str, object]:
    return {"error": {"code": code, "message": message, **extra}}


def test_known_codes_become_their_classes_with_message_and_details() -> None:
    exc = error_from_response(answer(404, error("run_not_found", "no run r1")))
    assert type(exc) is RunNotFound and exc.message == "no run r1"

    busy = error_from_response(answer(409, error("conversation_busy", "busy", run_id="r2")))
    assert isinstance(busy, ConversationBusy)
    assert (busy.active_run_id, busy.message, busy.details) == ("r2", "busy", {"run_id": "r2"})

    quota = error_from_response(
        answer(429, error("quota_exceeded", "over", run_id="r3"), **{"Retry-After": "3600"})
    )
    assert isinstance(quota, QuotaExceeded)
    assert (quota.run_id, quota.retry_after_s) == ("r3", 3600)

    limited = error_from_response(
        answer(
            429,
            error("rate_limited", "slow down"),
            **{"Retry-After": "2", "RateLimit-Limit": "10", "RateLimit-Reset": "2"},
        )
    )
    assert isinstance(limited, RateLimited)
    assert (limited.limit, limited.retry_after_s) == (10, 2)

    invalid = error_from_response(answer(422, error("invalid_request", "bad", field="body.x")))
    assert type(invalid) is InvalidRequest and invalid.details == {"field": "body.x"}


def test_an_unknown_code_keeps_its_code_and_status_under_its_status_branch() -> None:
    exc = error_from_response(answer(409, error("interrupt_resolved", "decided already")))
    assert isinstance(exc, ApiError) and isinstance(exc, Conflict)
    assert (exc.code, exc.status, exc.message) == ("interrupt_resolved", 409, "decided already")

    proxy = error_from_response(answer(502, "<html>bad gateway</html>"))
    assert isinstance(proxy, ApiError)
    assert (proxy.code, proxy.status) == ("http_error", 502)
    assert "bad gateway" in proxy.message


async def test_sse_lines_are_parsed_into_events() -> None:
    lines = [": ping", "id: 1", "event: delta", 'data: {"text": "a"}', "", "retry: 5", ""]
    lines += ["id: 2", "event: succeeded", "data: {}", ""]

    async def source() -> AsyncIterator[str]:
        for line in lines:
            yield line

    events = [event async for event in parse_sse(source())]
    assert events == [
        Event(seq=1, type="delta", data={"text": "a"}),
        Event(seq=2, type="succeeded", data={}),
    ]


async def test_events_resume_after_the_last_seq_when_the_connection_drops() -> None:
    seen_last_ids: list[str] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
        last = next(line for line in head.splitlines() if line.startswith("last-event-id:"))
        seen_last_ids.append(last.split(":", 1)[1].strip())
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        if len(seen_last_ids) == 1:
            body = b'id: 1\nevent: started\ndata: {}\n\nid: 2\nevent: delta\ndata: {"text":"x"}\n\n'
            writer.write(f"{len(body):x}\r\n".encode() + body + b"\r\n")
            await writer.drain()
            writer.close()  # mid-body: no final chunk
            return
        body = b"id: 3\nevent: succeeded\ndata: {}\n\n"
        writer.write(f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with Client(f"http://127.0.0.1:{port}", "key") as client:
            events = [event async for event in client.events("r1")]
    finally:
        server.close()
        await server.wait_closed()
    assert [event.seq for event in events] == [1, 2, 3]
    assert events[-1].is_terminal
    assert seen_last_ids == ["0", "2"]


def test_a_client_command_fails_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    cases = [
        (["submit", "greet", "--input", "[1]"], "error: invalid_input: --input: must be"),
        (["submit", "greet", "--input", f"@{tmp_path / 'missing.json'}"], "cannot read it"),
        (["status", "r1", "--key", "k"], "error: server_unreachable: could not reach"),
        (["runs"], "error: unauthorized:"),
        (["status", "r1", "--key", "k\n"], "error: invalid_input: the API key holds a line"),
    ]
    for args, expected in cases:
        with pytest.raises(SystemExit) as exit_info:
            main([*args, "--url", down])
        assert exit_info.value.code == 1
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], (args, lines)


@pytest.mark.parametrize("secret", ["key\n", "ke\ry", "k\x00", "clé"])
def test_a_secret_a_header_cannot_carry_is_refused_when_the_client_is_made(
    secret: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a request with a broken head (a line break would end the header early)."""
    for make in (Client, SyncClient):
        with pytest.raises(InvalidInput, match="API key holds a line break"):
            make("http://127.0.0.1:1", secret)
        with pytest.raises(InvalidInput, match="admin token holds a line break"):
            make("http://127.0.0.1:1", admin_token=secret)
        if "\x00" not in secret:  # the environment cannot hold a NUL
            monkeypatch.setenv("MOORLINE_API_KEY", secret)
            with pytest.raises(InvalidInput, match="API key holds"):
                make("http://127.0.0.1:1")
            monkeypatch.delenv("MOORLINE_API_KEY")
    assert Client("http://127.0.0.1:1", "ml_live_a-b.c~d+e/f=")._api_key == "ml_live_a-b.c~d+e/f="


def test_serve_on_loopback_without_an_admin_token_generates_one_for_the_process() -> None:
    settings = Settings()
    local = start_banner(settings, host="127.0.0.1", port=8000, database="sqlite")
    token = local.settings.admin_token
    assert token is not None and len(token.get_secret_value()) >= 32
    text = "\n".join(local.lines)
    assert "http://127.0.0.1:8000/docs" in text
    assert f"MOORLINE_ADMIN_TOKEN={token.get_secret_value()} moorline tenants create" in text

    public = start_banner(settings, host="0.0.0.0", port=8000, database="sqlite")
    assert public.settings.admin_token is None
    assert "Admin routes are off" in "\n".join(public.lines)

    # Webhook URLs: the address served on, unless MOORLINE_PUBLIC_URL says otherwise.
    assert local.settings.public_url == "http://127.0.0.1:8000"
    assert public.settings.public_url == "http://127.0.0.1:8000"
    chosen = settings.model_copy(
        update={
            "admin_token": SecretStr("operator-secret"),
            "public_url": "https://moorline.example.com",
        }
    )
    configured = start_banner(chosen, host="127.0.0.1", port=8000, database="sqlite")
    assert configured.settings is chosen
    assert "operator-secret" not in "\n".join(configured.lines)
