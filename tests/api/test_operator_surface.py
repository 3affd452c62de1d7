"""The operator surface of a real ``moorline serve``: ``/metrics`` and the logs (issue 6).

- 200 runs through the HTTP API of ``serve --workers 2`` beside a separate ``moorline worker``
  (metrics in prometheus-client's multiprocess mode) while ``/metrics`` is scraped: every figure
  adds up to what the API reports, during the load (a scrape, then the API, then a scrape
  again: the API's count lies between the two) and after it (equal).
- With ``MOORLINE_LOG_FORMAT=json`` every line of an end-to-end run (a retry, a webhook
  delivery, a key put in a URL) is one JSON object, the lines about a run carry its
  ``run_id``, ``attempt`` and ``tenant_id``, and no API key, admin token, webhook secret or
  ``Authorization`` value appears anywhere in the output.
"""

import asyncio
import contextlib
import json
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from moorline.api.routes.webhooks import sign
from tests.helpers import wait_for
from tests.integration.test_cli import cli_env, free_port

ADMIN_TOKEN = "operator-surface-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
STARTUP_S = 30.0
RUNS = 200
DELAYED = 5
BUSY_LANE = "workflow_busy"
TIGHT_LANE = "workflow_tight"
PLANS_YAML = f"""
plans:
  busy:
    lane: {BUSY_LANE}
    priority: 50
    daily_quota: 100000
    rate_limit: "100000/second"
    tenant_concurrency: 40
    lane_slots: 20
  tight:
    lane: {TIGHT_LANE}
    priority: 10
    daily_quota: 2
    rate_limit: "100000/second"
    tenant_concurrency: 2
    lane_slots: 2
"""

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@dataclass
class Serve:
    url: str
    stdout: Path
    stderr: Path
    """Where the process's output goes (``running`` fills them, ``url`` empty, for a worker)."""

    def output(self) -> str:
        return "".join(
            p.read_text(encoding="utf-8", errors="replace") for p in (self.stdout, self.stderr)
        )


def moorline_env(root: Path, **settings: str) -> dict[str, str]:
    """The environment of the test's ``moorline`` processes: one SQLite file, one plans file."""
    plans = root / "plans.yaml"
    plans.write_text(PLANS_YAML, encoding="utf-8")
    return cli_env(
        MOORLINE_DATABASE_URL=f"sqlite+aiosqlite:///{root / 'moorline.db'}",
        MOORLINE_ADMIN_TOKEN=ADMIN_TOKEN,
        MOORLINE_PLANS_FILE=str(plans),
        MOORLINE_APP="tests.api.observed:app",
        **settings,
    )


@contextlib.contextmanager
def running(
    root: Path, name: str, args: list[str], env: dict[str, str]
) -> Iterator[tuple[subprocess.Popen[bytes], Serve]]:
    """``python -m moorline <args>``, its output in ``<name>.out``/``.err``; SIGTERM'd at exit.

    It must then exit with status 0 (a graceful stop).
    """
    logs = Serve(url="", stdout=root / f"{name}.out", stderr=root / f"{name}.err")
    with logs.stdout.open("wb") as out, logs.stderr.open("wb") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "moorline", *args], cwd=root, env=env, stdout=out, stderr=err
        )
    try:
        yield process, logs
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    assert process.returncode == 0, logs.output()


@contextlib.contextmanager
def serving(root: Path, *, workers: int, **settings: str) -> Iterator[Serve]:
    """A ready ``moorline serve --workers N`` over a fresh SQLite database."""
    port = free_port()
    args = ["serve", "--port", str(port), "--workers", str(workers)]
    with running(root, "serve", args, moorline_env(root, **settings)) as (process, logs):
        serve = Serve(url=f"http://127.0.0.1:{port}", stdout=logs.stdout, stderr=logs.stderr)
        _wait_until_ready(serve.url, process)
        yield serve


def _wait_until_ready(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_S
    with httpx.Client(base_url=url, timeout=5.0) as client:
        while True:
            assert process.poll() is None, "moorline serve exited before it answered"
            with contextlib.suppress(httpx.TransportError):
                if client.get("/readyz").status_code == 200:
                    return
            assert time.monotonic() < deadline, "moorline serve did not become ready"
            time.sleep(0.05)


async def scrape(client: httpx.AsyncClient) -> Samples:
    response = await client.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(value for (n, have), value in samples.items() if n == name and wanted <= have)


async def create_tenant(client: httpx.AsyncClient, name: str, plan: str) -> tuple[str, str]:
    created = await client.post(
        "/v1/admin/tenants", json={"name": name, "plan": plan}, headers=ADMIN
    )
    assert created.status_code == 201, created.text
    return created.json()["tenant_id"], created.json()["api_key"]


async def count_runs(client: httpx.AsyncClient, key: str, status: str) -> int:
    """The tenant's runs in ``status``, every page of ``GET /v1/runs``."""
    counted, cursor = 0, None
    while True:
        params: dict[str, Any] = {"status": status, "limit": 200}
        if cursor is not None:
            params["cursor"] = cursor
        page = await client.get(
            "/v1/runs", params=params, headers={"Authorization": f"Bearer {key}"}
        )
        assert page.status_code == 200, page.text
        counted += len(page.json()["runs"])
        cursor = page.json()["next_cursor"]
        if cursor is None:
            return counted


async def test_metrics_add_up_to_what_the_api_reports(tmp_path: Path) -> None:
    # prometheus-client's multiprocess mode: the server (two worker loops) and a separate
    # ``moorline worker`` share one directory, and the server's /metrics sums both processes'
    # events; the figures read from the database count every process's runs anyway.
    shared = tmp_path / "prometheus"
    shared.mkdir()
    multiprocess = {"PROMETHEUS_MULTIPROC_DIR": str(shared)}
    with serving(tmp_path, workers=2, **multiprocess) as serve:
        env = moorline_env(tmp_path, **multiprocess)
        with running(tmp_path, "worker", ["worker"], env) as (worker, logs):

            async def worker_serving() -> bool:
                assert worker.poll() is None, logs.output()
                return "serving" in logs.stderr.read_text(encoding="utf-8")

            await wait_for(worker_serving, timeout_s=30, message="the worker process to start")
            async with httpx.AsyncClient(base_url=serve.url, timeout=30.0) as client:
                await _load_and_check(client)
    # Both processes wrote their events where the server's scrape read them.
    assert {path.name.rsplit("_", 1)[-1] for path in shared.iterdir()} >= {f"{worker.pid}.db"}


async def _load_and_check(client: httpx.AsyncClient) -> None:
    _, busy_key = await create_tenant(client, "busy", "busy")
    _, tight_key = await create_tenant(client, "tight", "tight")
    busy = {"Authorization": f"Bearer {busy_key}"}
    tight = {"Authorization": f"Bearer {tight_key}"}

    # Runs delayed for an hour stay queued, not claimable: a queue that holds still.
    delayed = [
        await client.post(
            "/v1/workflows/echo/runs", json={"input": {}, "delay_seconds": 3600}, headers=busy
        )
        for _ in range(DELAYED)
    ]
    assert {r.status_code for r in delayed} == {202}

    gate = asyncio.Semaphore(20)

    async def submit(index: int) -> None:
        async with gate:
            answer = await client.post(
                "/v1/workflows/echo/runs", json={"input": {"message": str(index)}}, headers=busy
            )
            assert answer.status_code == 202, answer.text

    submitting = asyncio.gather(*(submit(i) for i in range(RUNS)))
    # During the load: a scrape, the API's count, a scrape. Counters only grow, so the API's
    # count of succeeded runs lies between the two scrapes' (per status, from the database).
    sandwiches = 0
    while not submitting.done() or sandwiches < 3:
        before = await scrape(client)
        succeeded = await count_runs(client, busy_key, "succeeded")
        after = await scrape(client)
        low = total(before, "moorline_runs_total", status="succeeded", lane=BUSY_LANE)
        high = total(after, "moorline_runs_total", status="succeeded", lane=BUSY_LANE)
        assert low <= succeeded <= high, (low, succeeded, high)
        ran_before = total(before, "moorline_run_duration_seconds_count")
        assert ran_before <= total(after, "moorline_run_duration_seconds_count")
        everything = total(after, "moorline_runs_total") + total(after, "moorline_runs_active")
        assert DELAYED <= everything <= DELAYED + RUNS
        sandwiches += 1
    await submitting

    # The tight plan's quota is 2 a day: the third trigger is refused and stored rate_limited.
    answers = [
        await client.post("/v1/workflows/echo/runs", json={"input": {}}, headers=tight)
        for _ in range(3)
    ]
    assert [a.status_code for a in answers] == [202, 202, 429]
    assert answers[2].json()["error"]["code"] == "quota_exceeded"

    async def all_done() -> bool:
        return (
            await count_runs(client, busy_key, "succeeded") == RUNS
            and await count_runs(client, tight_key, "succeeded") == 2
        )

    await wait_for(all_done, timeout_s=60, interval_s=0.1, message="every run to succeed")
    ran = RUNS + 2

    async def every_attempt_counted() -> Samples | None:
        # A worker counts an attempt just after its outcome is committed, which the API may
        # report a moment sooner.
        samples = await scrape(client)
        counted = total(samples, "moorline_run_duration_seconds_count", outcome="succeeded")
        return samples if counted >= ran else None

    counted = await wait_for(every_attempt_counted, message="every attempt to be counted")
    assert counted is not None
    final: Samples = counted
    assert total(final, "moorline_runs_total", status="succeeded", lane=BUSY_LANE) == RUNS
    assert total(final, "moorline_runs_total", status="succeeded", lane=TIGHT_LANE) == 2
    assert total(final, "moorline_runs_total", status="succeeded") == RUNS + 2
    rate_limited = await count_runs(client, tight_key, "rate_limited")
    assert rate_limited == 1
    assert total(final, "moorline_runs_total", status="rate_limited") == rate_limited
    assert total(final, "moorline_rejections_total", reason="quota_exceeded") == 1
    assert total(final, "moorline_rejections_total", reason="rate_limited") == 0
    assert total(final, "moorline_runs_total", status="failed") == 0
    # Each run was claimed once and ran once, in the server's loops or the worker process.
    assert total(final, "moorline_run_duration_seconds_count", outcome="succeeded") == ran
    assert total(final, "moorline_dispatch_latency_seconds_count") == ran
    assert total(final, "moorline_retries_total") == 0
    assert total(final, "moorline_lease_losses_total") == 0
    assert total(final, "moorline_runs_active", status="running") == 0

    # Queue gauges: the same figures as GET /v1/admin/queues, lane by lane.
    queues = (await client.get("/v1/admin/queues", headers=ADMIN)).json()["lanes"]
    assert {lane["lane"] for lane in queues} >= {BUSY_LANE, TIGHT_LANE}
    for lane in queues:
        name = lane["lane"]
        assert total(final, "moorline_queue_depth", lane=name) == lane["queued"], name
        assert total(final, "moorline_runs_active", lane=name, status="queued") == lane["queued"]
        assert total(final, "moorline_queue_oldest_age_seconds", lane=name) == (
            lane["oldest_queued_age_s"] or 0.0
        )
    assert total(final, "moorline_queue_depth", lane=BUSY_LANE) == DELAYED
    assert total(final, "moorline_interrupts_pending") == 0
    assert total(final, "moorline_db_pool_size") >= 1
    assert total(final, "moorline_db_pool_checked_out") >= 0
    assert ("moorline_sqlite_wal_bytes", frozenset()) in final

    # One open event stream is one subscriber, until it closes.
    assert total(final, "moorline_sse_subscribers") == 0
    waiting_run = delayed[0].json()["run_id"]
    async with client.stream("GET", f"/v1/runs/{waiting_run}/events", headers=busy) as stream:
        assert stream.status_code == 200
        assert total(await scrape(client), "moorline_sse_subscribers") == 1

    async def unsubscribed() -> bool:
        return total(await scrape(client), "moorline_sse_subscribers") == 0

    await wait_for(unsubscribed, message="the closed stream to be counted out")


async def test_json_logs_name_the_run_and_never_a_secret(tmp_path: Path) -> None:
    webhook_secret = "whsec-" + secrets.token_hex(16)
    with serving(tmp_path, workers=1, MOORLINE_LOG_FORMAT="json") as serve:
        async with httpx.AsyncClient(base_url=serve.url, timeout=30.0) as client:
            tenant_id, key = await create_tenant(client, "logged", "busy")
            tenant = {"Authorization": f"Bearer {key}"}
            chatty = await client.post(
                "/v1/workflows/chatty/runs", json={"input": {"token": key}}, headers=tenant
            )
            assert chatty.status_code == 202, chatty.text
            hook = await client.post(
                "/v1/webhooks",
                json={"workflow": "hooked", "secret": webhook_secret},
                headers=tenant,
            )
            assert hook.status_code == 201, hook.text
            body = b'{"ref": "main"}'
            delivered = await client.post(
                f"/v1/hooks/{hook.json()['webhook_id']}",
                content=body,
                headers={
                    "X-Hub-Signature-256": sign(webhook_secret, body),
                    "X-GitHub-Event": "push",
                    "X-GitHub-Delivery": "delivery-1",
                    "Content-Type": "application/json",
                },
            )
            assert delivered.status_code == 202, delivered.text
            refused = await client.get(f"/v1/runs?api_key={key}&marker=query-key-probe")
            assert refused.status_code == 400
            run_ids = [chatty.json()["run_id"], delivered.json()["run_id"]]

            async def finished() -> bool:
                for run_id in run_ids:
                    run = (await client.get(f"/v1/runs/{run_id}", headers=tenant)).json()
                    if run["status"] != "succeeded":
                        return False
                return True

            await wait_for(finished, timeout_s=30, message="both runs to succeed")
            metrics = await scrape(client)
            assert total(metrics, "moorline_retries_total") == 1
            assert total(metrics, "moorline_run_duration_seconds_count", outcome="retried") == 1

            async def probe_logged() -> bool:
                return "query-key-probe" in serve.stderr.read_text(encoding="utf-8")

            await wait_for(probe_logged, message="the refused request's access-log line")
    _check_json_logs(serve, run_ids=run_ids, tenant_id=tenant_id)
    output = serve.output()
    for secret in (key, key[:20], ADMIN_TOKEN, webhook_secret):
        assert secret not in output, f"a secret leaked into the logs: {secret[:6]}…"


def _check_json_logs(serve: Serve, *, run_ids: list[str], tenant_id: str) -> None:
    lines = serve.stderr.read_text(encoding="utf-8").splitlines()
    assert lines, "serve logged nothing"
    entries = [json.loads(line) for line in lines]  # every line is one JSON object
    about_runs = 0
    attempts_of_chatty: set[int] = set()
    for entry in entries:
        assert {"time", "level", "logger", "message"} <= entry.keys(), entry
        if entry["logger"] == "uvicorn.access":
            continue  # request lines: their path may name a run, but they are about a request
        named = [run_id for run_id in run_ids if run_id in entry["message"]]
        if entry["logger"] == "tests.api.observed" or named:
            about_runs += 1
            assert entry.get("run_id") in run_ids, entry
            assert entry.get("tenant_id") == tenant_id, entry
            assert isinstance(entry.get("attempt"), int), entry
            if named:
                assert entry["run_id"] == named[0], entry
            if entry["run_id"] == run_ids[0] and entry["logger"] == "tests.api.observed":
                attempts_of_chatty.add(entry["attempt"])
    # The workflow's own lines on both attempts, the worker's retry line, the delivery's line.
    assert attempts_of_chatty == {1, 2}
    assert about_runs >= 4
    assert any("[redacted]" in entry["message"] for entry in entries)
