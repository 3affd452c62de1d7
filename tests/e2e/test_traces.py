"""One trace from a trigger to the worker's steps and model call, across two processes.

``moorline serve --workers 0`` and ``moorline worker`` run as separate processes on one SQLite
file, each with the OpenTelemetry SDK's in-memory exporter (:mod:`tests.e2e.traced`). The test
triggers a run with a ``traceparent`` of its own; the spans both processes recorded must form
one trace under it: trigger → run attempt → two steps, the second → the model call.
"""

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from moorline.llm import Message
from moorline.llm.simulated import simulated_usage
from tests.api.conftest import ADMIN, ADMIN_TOKEN, PLANS_YAML
from tests.e2e.conftest import _stop, _wait_ready, _wait_serving
from tests.integration.test_cli import cli_env, free_port

RUN_S = 30.0


def _start(args: list[str], env: dict[str, str], root: Path, name: str) -> subprocess.Popen[bytes]:
    with (root / f"{name}.log").open("wb") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.traced", *args],
            cwd=root,
            env=cli_env(**env, TRACE_SPANS_FILE=str(root / f"{name}.spans")),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )


def _spans(root: Path, name: str) -> list[dict[str, Any]]:
    lines = (root / f"{name}.spans").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


@contextmanager
def _cluster(root: Path) -> Iterator[str]:
    """Both processes, until the block ends; then stopped, so they have written their spans."""
    (root / "plans.yaml").write_text(PLANS_YAML, encoding="utf-8")
    env = {
        "MOORLINE_ADMIN_TOKEN": ADMIN_TOKEN,
        "MOORLINE_PLANS_FILE": str(root / "plans.yaml"),
        "MOORLINE_APP": "tests.e2e.traced:app",
        "MOORLINE_DATABASE_URL": f"sqlite+aiosqlite:///{root / 'moorline.db'}",
    }
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = _start(["serve", "--port", str(port), "--workers", "0"], env, root, "serve")
    worker: subprocess.Popen[bytes] | None = None
    try:
        _wait_ready(url, server, root / "serve.log")
        worker = _start(["worker", "--grace", "1"], env, root, "worker")
        _wait_serving(worker, root / "worker.log")
        yield url
    finally:
        codes = [_stop(p) for p in (worker, server) if p is not None]
    logs = "\n".join((root / f"{n}.log").read_text(errors="replace") for n in ("serve", "worker"))
    assert codes == [0] * len(codes), logs


def test_a_trigger_and_its_attempt_form_one_trace(tmp_path: Path) -> None:
    caller_trace, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    with _cluster(tmp_path) as url, httpx.Client(base_url=url, timeout=10.0) as client:
        made = client.post(
            "/v1/admin/tenants", json={"name": "tracer", "plan": "team"}, headers=ADMIN
        )
        assert made.status_code == 201, made.text
        key = {"Authorization": f"Bearer {made.json()['api_key']}"}
        started = client.post(
            "/v1/workflows/traced/runs",
            json={"input": {"topic": "lighthouses"}},
            headers={**key, "traceparent": f"00-{caller_trace}-{caller_span}-01"},
        )
        assert started.status_code == 202, started.text
        run_id = started.json()["run_id"]
        deadline = time.monotonic() + RUN_S
        while (run := client.get(f"/v1/runs/{run_id}", headers=key).json())["status"] != (
            "succeeded"
        ):
            assert run["status"] in {"queued", "running"}, run
            assert time.monotonic() < deadline, f"the run did not finish: {run}"
            time.sleep(0.05)
    # Both processes have exited: their spans are written.
    served, worked = _spans(tmp_path, "serve"), _spans(tmp_path, "worker")

    # FastAPI's request span, a child of the caller's; the trigger's span in it.
    [request] = [s for s in served if s["name"] == "POST /v1/workflows/{workflow}/runs"]
    assert request["kind"] == "SERVER"
    assert (request["trace_id"], request["parent_id"]) == (caller_trace, caller_span)
    [trigger] = [s for s in served if s["name"] == "trigger traced"]
    assert (trigger["trace_id"], trigger["parent_id"]) == (caller_trace, request["span_id"])
    assert trigger["attributes"]["moorline.run_id"] == run_id

    by_name = {s["name"]: s for s in worked}
    assert sorted(by_name) == ["chat moorline-simulated", "run traced", "step ask", "step prepare"]
    assert {s["trace_id"] for s in worked} == {caller_trace}
    attempt = by_name["run traced"]
    assert (attempt["kind"], attempt["parent_id"]) == ("CONSUMER", trigger["span_id"])
    assert attempt["attributes"]["moorline.run_id"] == run_id
    assert attempt["attributes"]["moorline.attempt"] == 1
    for step in ("step prepare", "step ask"):
        assert by_name[step]["parent_id"] == attempt["span_id"]
    model = by_name["chat moorline-simulated"]
    assert (model["kind"], model["parent_id"]) == ("CLIENT", by_name["step ask"]["span_id"])
    assert model["attributes"]["gen_ai.operation.name"] == "chat"
    assert model["attributes"]["gen_ai.request.model"] == "moorline-simulated"
    assert model["attributes"]["gen_ai.response.model"] == "moorline-simulated"
    # The simulated model's count, the one its usage reports: a token per 4 characters.
    asked = simulated_usage([Message.user("Say something about lighthouses.")])
    assert model["attributes"]["gen_ai.usage.input_tokens"] == asked.prompt_tokens
    assert model["attributes"]["gen_ai.usage.output_tokens"] == asked.completion_tokens
    assert all(s["status"] != "ERROR" for s in [*worked, trigger])
