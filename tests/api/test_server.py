"""Against a real ``moorline serve`` process: what only a real HTTP server shows.

- A chunked body (no ``Content-Length``) over the limit is answered 413 after about the limit,
  while the client is still sending (docs/reliability.md I7).
- A key in a query string is refused and appears in no log line (I5).
- Schemathesis generates requests from the served ``/openapi.json``: no answer is a 5xx and
  every answer matches the documented status codes, content types, headers and schemas.
  ``MOORLINE_FULL=1`` raises the example count.
"""

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import APIOperation
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.result import Ok

from tests.api.conftest import ADMIN, ADMIN_TOKEN, PLANS_YAML
from tests.helpers import wait_for
from tests.integration.test_cli import cli_env, free_port

MAX_BODY_BYTES = 64 * 1024
EXAMPLES = int(
    os.environ.get("MOORLINE_FUZZ_EXAMPLES", 200 if os.environ.get("MOORLINE_FULL") == "1" else 15)
)
"""Examples per operation: 15 in ``make test``, 200 with ``MOORLINE_FULL=1``; ``make fuzz``
sets ``MOORLINE_FUZZ_EXAMPLES`` higher."""
STARTUP_S = 30.0


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    api_key: str
    known: dict[str, str]
    """Path parameters that name real objects of the tenant (a run, a webhook, …)."""

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("serve")
    plans = root / "plans.yaml"
    plans.write_text(PLANS_YAML, encoding="utf-8")
    port = free_port()
    log = root / "serve.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "moorline", "serve", "--port", str(port)],
            cwd=root,
            env=cli_env(
                MOORLINE_DATABASE_URL=f"sqlite+aiosqlite:///{root / 'moorline.db'}",
                MOORLINE_ADMIN_TOKEN=ADMIN_TOKEN,
                MOORLINE_PLANS_FILE=str(plans),
                MOORLINE_MAX_BODY_BYTES=str(MAX_BODY_BYTES),
                MOORLINE_APP="tests.api.workflows:app",
                # Rates a fuzzer does not exhaust, so that it reaches the success answers; the
                # 429s are tested in tests/api/test_request_rates.py.
                MOORLINE_REQUEST_RATE_LIMIT="1000000/second",
                MOORLINE_STREAM_RATE_LIMIT="1000000/second",
                MOORLINE_WEBHOOK_RATE_LIMIT="1000000/second",
            ),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        api_key, known = _wait_until_serving(url, process)
        yield Server(url=url, process=process, log=log, api_key=api_key, known=known)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    assert process.returncode == 0, log.read_text()


def _wait_until_serving(url: str, process: subprocess.Popen[bytes]) -> tuple[str, dict[str, str]]:
    """Poll ``/readyz`` until the server answers; then create the objects the tests use."""
    deadline = time.monotonic() + STARTUP_S
    with httpx.Client(base_url=url, timeout=5.0) as client:
        while True:
            assert process.poll() is None, "moorline serve exited before it answered"
            try:
                if client.get("/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "moorline serve did not become ready"
            time.sleep(0.05)
        created = client.post(
            "/v1/admin/tenants", json={"name": "schemathesis", "plan": "team"}, headers=ADMIN
        )
        assert created.status_code == 201, created.text
        key: str = created.json()["api_key"]
        tenant = {"Authorization": f"Bearer {key}"}
        run = client.post("/v1/workflows/echo/runs", json={"input": {}}, headers=tenant)
        hook = client.post("/v1/webhooks", json={"workflow": "review"}, headers=tenant)
        schedule = client.post(
            "/v1/schedules", json={"workflow": "echo", "every_seconds": 3600}, headers=tenant
        )
        assert schedule.status_code == 201, schedule.text
        # A second key for the key routes: revoking it leaves the tests' own key working.
        spare = client.post(f"/v1/admin/tenants/{created.json()['tenant_id']}/keys", headers=ADMIN)
        assert (run.status_code, hook.status_code, spare.status_code) == (202, 201, 201)
        # A bulk job for the job routes; the run is not failed, so it acts on nothing.
        job = client.post(
            "/v1/runs/bulk/retry", json={"ids": [run.json()["run_id"]]}, headers=tenant
        )
        assert job.status_code == 202, job.text
        # The server's own worker loop, for the worker routes (it registers as it starts).
        while not (workers := client.get("/v1/admin/workers", headers=ADMIN).json()["workers"]):
            assert time.monotonic() < deadline + STARTUP_S, "no worker registered"
            time.sleep(0.05)
        return key, {
            "worker_id": workers[0]["worker_id"],
            "job_id": job.json()["job_id"],
            "key_id": spare.json()["key_id"],
            "tenant_id": created.json()["tenant_id"],
            "run_id": run.json()["run_id"],
            "webhook_id": hook.json()["webhook_id"],
            "schedule_id": schedule.json()["schedule_id"],
            "workflow": "echo",
        }


class Flooder(asyncio.Protocol):
    """A client socket that keeps what it receives even once the connection is reset.

    asyncio's StreamReader raises the reset and hides an answer already received, which is
    exactly what a client flooding past its refusal gets; this keeps the answer readable.
    """

    def __init__(self) -> None:
        self.received = bytearray()
        self.lost = asyncio.Event()
        self.writable = asyncio.Event()
        self.writable.set()

    def data_received(self, data: bytes) -> None:
        self.received += data

    def eof_received(self) -> bool:
        self.lost.set()  # the server half-closed: it reads no more
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set()
        self.writable.set()

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()


async def test_a_chunked_body_over_the_limit_is_refused_and_cut_off(server: Server) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    transport, client = await asyncio.get_running_loop().create_connection(Flooder, host, int(port))
    transport.write(
        (
            "POST /v1/workflows/echo/runs HTTP/1.1\r\n"
            f"Host: {host}\r\n"
            f"Authorization: Bearer {server.api_key}\r\n"
            "Content-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        ).encode()
    )
    chunk = b"x" * 65536
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    sent = 0
    give_up_after = 256 * 1024 * 1024  # a server that reads everything lets all of it through
    try:
        # The client goes on sending until the server closes its side: the server must close
        # after the answer, not read and drop an endless body to keep the connection.
        async with asyncio.timeout(60):
            while sent < give_up_after and not client.lost.is_set():
                transport.write(frame)
                sent += len(chunk)
                await client.writable.wait()
                await asyncio.sleep(0)  # a turn for the socket's reads
    finally:
        transport.abort()
    head = bytes(client.received).split(b"\r\n\r\n")[0]
    assert head.startswith(b"HTTP/1.1 413"), head
    assert b"content-type: application/json" in head.lower()
    # Closed long before the client gave up: the refusal, then only socket buffers' worth.
    assert client.lost.is_set()
    assert sent < 64 * 1024 * 1024


async def test_serve_runs_triggered_workflows_in_its_own_worker_loop(server: Server) -> None:
    # The fixture's server runs with the default --workers 1: no `moorline worker` exists,
    # so only the in-process loop can finish this run.
    tenant = {"Authorization": f"Bearer {server.api_key}"}
    async with httpx.AsyncClient(base_url=server.url, headers=tenant) as client:
        created = await client.post("/v1/workflows/echo/runs", json={"input": {"message": "hi"}})
        assert created.status_code == 202, created.text
        run_id = created.json()["run_id"]

        async def finished() -> dict[str, Any] | None:
            body: dict[str, Any] = (await client.get(f"/v1/runs/{run_id}")).json()
            return body if body["status"] == "succeeded" else None

        run = await wait_for(finished, message=f"run {run_id} to succeed")
    assert run is not None
    assert (run["output"]["message"], run["attempt"]) == ("hi", 1)


async def test_a_key_in_the_url_is_refused_and_never_logged(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url) as client:
        response = await client.get(f"/v1/runs?api_key={server.api_key}&marker=query-key-probe")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "key_in_query"
    deadline = time.monotonic() + 10
    while "query-key-probe" not in server.output():
        assert time.monotonic() < deadline, "the request never reached the access log"
        await asyncio.sleep(0.05)
    assert server.api_key not in server.output()
    assert server.api_key[:20] not in server.output()


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@dataclass
class Tally:
    """What the fuzz sent and got back, for its summary line."""

    requests: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)

    def summary(self) -> str:
        statuses = ", ".join(f"{status}: {n}" for status, n in sorted(self.statuses.items()))
        return (
            f"schemathesis: {self.requests.total()} requests over {len(self.requests)} "
            f"operations, every one as documented; statuses {statuses}"
        )


def check_operation(
    server: Server,
    operation: APIOperation[Any, Any, Any, Any],
    headers: dict[str, str],
    tally: Tally,
) -> None:
    @given(case=operation.as_strategy(), real=st.booleans())
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def answers_as_documented(case: schemathesis.Case[Any], real: bool) -> None:
        if real:
            # Random ids and plans name nothing: half the time, name real objects, so the
            # success answers are checked against their schemas too.
            for name in case.path_parameters or {}:
                case.path_parameters[name] = server.known[name]
            if isinstance(case.body, dict):
                real_values = {"plan": "team", "workflow": "review"}
                case.body.update({k: v for k, v in real_values.items() if k in case.body})
        response = case.call_and_validate(headers=headers, checks=CHECKS)
        tally.requests[operation.label] += 1
        tally.statuses[response.status_code] += 1

    answers_as_documented()


def test_every_operation_answers_as_its_openapi_document_says(server: Server) -> None:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    tenant = {"Authorization": f"Bearer {server.api_key}"}
    operations = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result
        operations.append(result.ok())
    assert len(operations) >= 12
    tally = Tally()
    for operation in operations:
        check_operation(
            server, operation, ADMIN if operation.path.startswith("/v1/admin") else tenant, tally
        )
    print(tally.summary())  # shown with -s (make fuzz)
    assert len(tally.requests) == len(operations)
