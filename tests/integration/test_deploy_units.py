"""The systemd units and env file under ``deploy/``: valid, and they serve, work and stop.

systemd is not PID 1 here, so the units cannot be started by systemd itself. Two checks stand
in: ``systemd-analyze verify`` reads each unit as systemd would (an unknown key, a bad value
or a missing executable is reported), and each unit's ``ExecStart`` is run as systemd would
run it (its ``Environment=`` and ``EnvironmentFile=`` lines, ``${VAR}`` and ``%i`` expanded,
in its working directory) against a temporary SQLite database, then stopped with its
``KillSignal`` and must exit 0 within its ``TimeoutStopSec``. The env example itself must name
only real settings and parse (its database URLs through the manager's checks).
"""

import asyncio
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from moorline import Client
from moorline.db.manager import DatabaseManager
from moorline.settings import ENV_PREFIX, Settings, unknown_variables
from moorline.types import RunStatus
from tests.api.conftest import ADMIN_TOKEN, PLANS_YAML
from tests.integration.test_cli import cli_env, free_port

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
API_UNIT = DEPLOY / "moorline-api.service"
WORKER_UNIT = DEPLOY / "moorline-worker@.service"
ENV_EXAMPLE = DEPLOY / "moorline.env.example"
INSTALLED_BINARY = "/opt/moorline/bin/moorline"
"""Where the units expect the console script (a virtualenv at ``/opt/moorline``)."""

INSTANCE = "t-1"
STARTUP_S = 30.0


def unit_entries(path: Path) -> dict[str, list[str]]:
    """``Section.Key`` → its values in order (systemd allows repeated keys)."""
    entries: dict[str, list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        entries.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return entries


def env_file(path: Path) -> dict[str, str]:
    """An ``EnvironmentFile``: ``NAME=value`` lines; comments and blank lines skipped."""
    values: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            values[name.strip()] = value.strip().strip('"')
    return values


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(s|min)?", value)
    assert match, f"unexpected time span {value!r}"
    return float(match[1]) * (60 if match[2] == "min" else 1)


def unit_environment(unit: Path, files: dict[str, dict[str, str]], instance: str) -> dict[str, str]:
    """What systemd gives the service: ``Environment=``, then each ``EnvironmentFile=``."""
    entries = unit_entries(unit)
    environment: dict[str, str] = {}
    for line in entries.get("Service.Environment", []):
        for assignment in shlex.split(line):
            name, _, value = assignment.partition("=")
            environment[name] = value
    for spec in entries.get("Service.EnvironmentFile", []):
        optional = spec.startswith("-")
        path = spec.removeprefix("-").replace("%i", instance)
        if path in files:
            environment.update(files[path])
        else:
            assert optional, f"{unit.name} needs {path}, which the test does not provide"
    return environment


def command_line(unit: Path, environment: dict[str, str], instance: str) -> list[str]:
    """``ExecStart`` with ``%i`` and ``${VAR}`` expanded, run from this checkout."""
    [exec_start] = unit_entries(unit)["Service.ExecStart"]
    words = shlex.split(exec_start.replace("%i", instance))
    assert words[0] == INSTALLED_BINARY, words
    expanded = [
        re.sub(r"\$\{(\w+)\}", lambda m: environment.get(m[1], ""), word) for word in words[1:]
    ]
    return [sys.executable, "-m", "moorline", *expanded]


@contextmanager
def started(unit: Path, files: dict[str, dict[str, str]], root: Path) -> Iterator[Path]:
    """The unit's ``ExecStart`` running; on exit its ``KillSignal``, and exit 0 in time."""
    environment = unit_environment(unit, files, INSTANCE)
    log = root / f"{unit.stem}.log"
    entries = unit_entries(unit)
    kill = getattr(signal, entries["Service.KillSignal"][0])
    stop_s = seconds(entries["Service.TimeoutStopSec"][0])
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command_line(unit, environment, INSTANCE),
            cwd=root,  # WorkingDirectory=
            env=cli_env(**environment),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        yield log
        assert process.poll() is None, log.read_text()
    finally:
        process.send_signal(kill)
        try:
            code = process.wait(stop_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            code = -9
    assert code == 0, f"{unit.name} exited {code} on {kill.name}:\n{log.read_text()}"


def _wait_until(condition: str, check: Callable[[], bool], process_log: Path) -> None:
    """Poll ``check`` with a deadline; the process's log is the failure's message."""
    deadline = time.monotonic() + STARTUP_S
    while not check():
        assert time.monotonic() < deadline, f"{condition}:\n{process_log.read_text()}"
        time.sleep(0.05)


def test_the_env_example_names_only_settings() -> None:
    values = env_file(ENV_EXAMPLE)
    assert unknown_variables(values) == []
    assert {"MOORLINE_DATABASE_URLS", "MOORLINE_DATABASE_POOLER", "MOORLINE_LISTEN_URL"} <= set(
        values
    )


async def test_the_env_example_passes_the_start_checks() -> None:
    values = env_file(ENV_EXAMPLE)
    fields: dict[str, Any] = {
        name.removeprefix(ENV_PREFIX).lower(): value
        for name, value in values.items()
        if name.startswith(ENV_PREFIX)
    }
    settings = Settings(**fields)
    # The URLs' checks, the pooler's and the LISTEN URLs', as at start; nothing connects.
    manager = DatabaseManager(settings)
    try:
        assert len(manager.targets) == 2 and len(manager.listen_targets) == 2
        assert not manager.backend.capabilities.session_state
    finally:
        await manager.dispose()


def test_systemd_analyze_verifies_the_units(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian's systemd package)")
    # The units as installed, except that ExecStart names an executable this host has.
    binary = Path(sys.executable).with_name("moorline")
    executable = str(binary) if os.access(binary, os.X_OK) else shutil.which("true") or "/bin/true"
    for unit in (API_UNIT, WORKER_UNIT):
        (tmp_path / unit.name).write_text(unit.read_text().replace(INSTALLED_BINARY, executable))
    checked = [tmp_path / API_UNIT.name, tmp_path / WORKER_UNIT.name.replace("@", f"@{INSTANCE}")]
    result = subprocess.run(
        [analyze, "verify", *map(str, checked)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # verify exits 0 on warnings too ("Unknown key ... ignoring"): any output is a finding.
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_the_units_serve_work_and_stop_on_their_kill_signal(tmp_path: Path) -> None:
    plans = tmp_path / "plans.yaml"
    plans.write_text(PLANS_YAML, encoding="utf-8")
    shared = env_file(ENV_EXAMPLE)
    # The example's servers are not here: one SQLite file both processes share, no Redis.
    for name in ("MOORLINE_DATABASE_URLS", "MOORLINE_LISTEN_URL", "MOORLINE_REDIS_URL"):
        shared.pop(name)
    port = free_port()
    shared |= {
        "MOORLINE_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'moorline.db'}",
        "MOORLINE_DATABASE_POOLER": "none",
        "MOORLINE_APP": "tests.e2e.workflows:app",
        "MOORLINE_PLANS_FILE": str(plans),
        "MOORLINE_ADMIN_TOKEN": ADMIN_TOKEN,
        "MOORLINE_PUBLIC_URL": f"http://127.0.0.1:{port}",
        "API_HOST": "127.0.0.1",
        "API_PORT": str(port),
    }
    files = {
        "/etc/moorline/moorline.env": shared,
        f"/etc/moorline/worker-{INSTANCE}.env": {"WORKER_LANES": "", "WORKER_GRACE": "5"},
    }
    url = f"http://127.0.0.1:{port}"
    with started(API_UNIT, files, tmp_path) as api_log:

        def ready() -> bool:
            try:
                return httpx.get(f"{url}/readyz", timeout=2.0).status_code == 200
            except httpx.TransportError:
                return False

        _wait_until("moorline-api did not become ready", ready, api_log)
        with started(WORKER_UNIT, files, tmp_path) as worker_log:
            _wait_until(
                "the worker did not start serving",
                lambda: " serving " in worker_log.read_text(errors="replace"),
                worker_log,
            )
            run = asyncio.run(_one_run(url))
            assert run == RunStatus.SUCCEEDED, worker_log.read_text()


async def _one_run(url: str) -> RunStatus:
    async with Client(url, admin_token=ADMIN_TOKEN) as admin:
        key = (await admin.create_tenant(f"unit-{uuid.uuid4().hex[:8]}", "team")).api_key
    assert key is not None
    async with Client(url, key) as client:
        accepted = await client.trigger("greet", {"name": "systemd"})
        return (await client.wait(accepted.run_id, timeout=STARTUP_S)).status
