"""A real deployment for end-to-end tests: ``moorline serve`` and a separate ``moorline worker``.

The API process runs no worker loop (``--workers 0``; its reaper runs), so every run is
executed by the worker process, which shares only the database (and Redis, when configured)
with it. Tests reach them only as a user would: ``moorline.Client`` and the CLI.

The lease TTL is short so that a cancel recorded by the API reaches the worker's heartbeat
within about a second when there is no Redis to signal it.
"""

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from redis import Redis
from sqlalchemy import make_url

from tests.api.conftest import ADMIN_TOKEN, PLANS_YAML
from tests.integration.test_cli import cli_env, free_port
from tests.servers import PG_ADMIN_URL, REDIS_TEST_URL, require_server, run_sql, unique_name

STARTUP_S = 30.0
STOP_S = 30.0
APP = "tests.e2e.workflows:app"


@dataclass
class Cluster:
    """A running API process and worker process, and the settings both were started with."""

    url: str
    env: dict[str, str]
    root: Path
    logs: list[Path]

    def output(self) -> str:
        return "\n".join(log.read_text(encoding="utf-8", errors="replace") for log in self.logs)

    def cli(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        """Run ``moorline *args`` against the cluster (``MOORLINE_URL`` set, plus ``env``)."""
        return subprocess.run(
            [sys.executable, "-m", "moorline", *args],
            cwd=self.root,
            env={**cli_env(MOORLINE_URL=self.url), **env},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )


def _start(args: list[str], env: dict[str, str], root: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "moorline", *args],
            cwd=root,
            env=cli_env(**env),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )


def _stop(process: subprocess.Popen[bytes]) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return -9


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    with httpx.Client(base_url=url, timeout=2.0) as client:
        while True:
            assert process.poll() is None, f"moorline serve exited:\n{log.read_text()}"
            try:
                if client.get("/readyz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "moorline serve did not become ready"
            time.sleep(0.05)


def _wait_serving(process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while " serving " not in log.read_text(encoding="utf-8", errors="replace"):
        assert process.poll() is None, f"moorline worker exited:\n{log.read_text()}"
        assert time.monotonic() < deadline, "moorline worker did not start serving"
        time.sleep(0.05)


@contextmanager
def run_cluster(root: Path, **settings: str) -> Iterator[Cluster]:
    """``moorline serve --workers 0`` and ``moorline worker`` with ``settings``, until exit."""
    plans = root / "plans.yaml"
    plans.write_text(PLANS_YAML, encoding="utf-8")
    env = {
        "MOORLINE_ADMIN_TOKEN": ADMIN_TOKEN,
        "MOORLINE_PLANS_FILE": str(plans),
        "MOORLINE_APP": APP,
        "MOORLINE_LEASE_TTL": "3",
        **settings,
    }
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logs = [root / "serve.log", root / "worker.log"]
    server = _start(["serve", "--port", str(port), "--workers", "0"], env, root, logs[0])
    worker: subprocess.Popen[bytes] | None = None
    try:
        _wait_ready(url, server, logs[0])
        worker = _start(["worker", "--grace", "1"], env, root, logs[1])
        # Serving means its stop signals are handled: a module whose tests end sooner would
        # otherwise SIGTERM a worker still importing, which dies of the signal (-15).
        _wait_serving(worker, logs[1])
        yield Cluster(url=url, env=env, root=root, logs=logs)
        assert worker.poll() is None, f"the worker died:\n{logs[1].read_text()}"
    finally:
        codes = [_stop(process) for process in (worker, server) if process is not None]
    output = "\n".join(log.read_text(errors="replace") for log in logs)
    assert codes == [0] * len(codes), output
    assert unexpected_tracebacks(output) == [], output


def unexpected_tracebacks(output: str) -> list[str]:
    """The log lines followed by a traceback, except a workflow's failure (logged with it)."""
    lines = output.splitlines()
    return [
        lines[index - 1] if index else ""
        for index, line in enumerate(lines)
        if line.startswith("Traceback")
        and not (index and re.search(r"run \S+ attempt \d+ failed \(", lines[index - 1]))
    ]


def upgrade_with_cli(settings: dict[str, str]) -> None:
    """``moorline db upgrade`` as an operator runs it, with these settings."""
    upgrade = subprocess.run(
        [sys.executable, "-m", "moorline", "db", "upgrade"],
        env=cli_env(**settings),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert upgrade.returncode == 0, upgrade.stderr


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The deployment on a SQLite file, without Redis."""
    root = tmp_path_factory.mktemp("e2e")
    with run_cluster(
        root, MOORLINE_DATABASE_URL=f"sqlite+aiosqlite:///{root / 'moorline.db'}"
    ) as c:
        yield c


@pytest.fixture(scope="module")
def pg_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The deployment on a fresh PostgreSQL database, with Redis under a fresh key prefix."""
    require_server("postgresql")
    require_server("redis")
    root = tmp_path_factory.mktemp("e2e_pg")
    name = unique_name("moorline_e2e")
    prefix = unique_name("e2e")
    run_sql("postgresql", f"CREATE DATABASE {name}")
    database_url = make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    settings = {
        "MOORLINE_DATABASE_URL": database_url,
        "MOORLINE_REDIS_URL": REDIS_TEST_URL,
        "MOORLINE_REDIS_PREFIX": prefix,
    }
    try:
        upgrade_with_cli(settings)
        with run_cluster(root, **settings) as c:
            yield c
    finally:
        run_sql("postgresql", f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        with Redis.from_url(REDIS_TEST_URL) as redis:
            keys = list(redis.scan_iter(match=f"{prefix}:*", count=1000))
            if keys:
                redis.delete(*keys)
