"""The ``moorline`` command line as a real subprocess (``python -m moorline``).

Errors must be one line on stderr with a non-zero exit and no traceback; ``serve`` must answer
its health endpoints and stop cleanly (status 0) on SIGTERM.
"""

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import make_url

import moorline
from moorline.db.manager import DatabaseManager
from moorline.db.migrate import current_revision, head_revision
from moorline.settings import Settings
from tests.helpers import wait_for
from tests.servers import PG_ADMIN_URL, require_server, run_sql, unique_name

SOURCE_ROOT = Path(moorline.__file__).resolve().parent.parent
CLI_TIMEOUT_S = 60.0


def cli_env(**settings: str) -> dict[str, str]:
    """The test's environment without any MOORLINE_* setting, plus ``settings``."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("MOORLINE_")}
    # The package need not be installed: run it from this checkout.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SOURCE_ROOT), env.get("PYTHONPATH")]))
    env.update(settings)
    return env


def run_cli(*args: str, cwd: Path, **settings: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "moorline", *args],
        cwd=cwd,
        env=cli_env(**settings),
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.fixture
def pg_database_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database, dropped after the test."""
    require_server("postgresql")
    name = unique_name("moorline_cli")
    run_sql("postgresql", f"CREATE DATABASE {name}")
    try:
        yield make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        run_sql("postgresql", f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.mark.parametrize(
    "command",
    [[], ["serve"], ["db"], ["db", "upgrade"], ["workers"], ["schedules", "create"]],
    ids=["moorline", "serve", "db", "upgrade", "workers", "schedules-create"],
)
def test_every_command_has_help(command: list[str], tmp_path: Path) -> None:
    result = run_cli(*command, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Usage: moorline" in result.stdout


def test_serve_help_names_every_option(tmp_path: Path) -> None:
    result = run_cli("serve", "--help", cwd=tmp_path, COLUMNS="200")
    assert result.returncode == 0, result.stderr
    for option in ("--host", "--port", "--app", "--workers"):
        assert option in result.stdout
    assert "In-process worker loops" in result.stdout  # --workers
    assert "validates" in result.stdout  # --app: the API only validates against it


async def test_db_upgrade_brings_a_fresh_postgres_database_to_head(
    pg_database_url: str, tmp_path: Path
) -> None:
    head = head_revision()
    first = run_cli("db", "upgrade", "--database-url", pg_database_url, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert f"revision {head}" in first.stdout
    # Again, from the environment this time: nothing left to do, same answer.
    again = run_cli("db", "upgrade", cwd=tmp_path, MOORLINE_DATABASE_URL=pg_database_url)
    assert again.returncode == 0, again.stderr
    assert f"revision {head}" in again.stdout

    db = DatabaseManager(Settings(database_url=pg_database_url))
    try:
        assert await current_revision(db) == head
    finally:
        await db.dispose()


def test_serve_refuses_a_postgres_database_that_was_not_upgraded(
    pg_database_url: str, tmp_path: Path
) -> None:
    result = run_cli(
        "serve", "--port", str(free_port()), cwd=tmp_path, MOORLINE_DATABASE_URL=pg_database_url
    )
    assert_one_line_error(
        result, f"schema is at empty, code needs {head_revision()}", "run `moorline db upgrade`"
    )


@pytest.mark.parametrize("command", [["serve"], ["db", "upgrade"]], ids=["serve", "upgrade"])
def test_a_bad_setting_is_one_line_naming_it(command: list[str], tmp_path: Path) -> None:
    result = run_cli(*command, cwd=tmp_path, MOORLINE_LEASE_TTL="abc")
    assert_one_line_error(result, "MOORLINE_LEASE_TTL")


@pytest.mark.parametrize(
    "command", [["serve", "--workers", "0"], ["worker"]], ids=["serve", "worker"]
)
def test_a_bad_models_file_is_one_line_naming_the_key(command: list[str], tmp_path: Path) -> None:
    models = tmp_path / "models.yaml"
    models.write_text("models: {gpt-x: {input_per_million: 1}}\n", encoding="utf-8")
    result = run_cli(
        *command,
        cwd=tmp_path,
        MOORLINE_DATABASE_URL=f"sqlite+aiosqlite:///{tmp_path}/m.db",
        MOORLINE_MODELS_FILE=str(models),
    )
    assert_one_line_error(result, str(models), "models.gpt-x.output_per_million")


def test_an_unreachable_database_is_one_line(tmp_path: Path) -> None:
    url = "postgresql+asyncpg://moorline@127.0.0.1:1/none"
    result = run_cli("db", "upgrade", "--database-url", url, cwd=tmp_path)
    assert_one_line_error(result, "no database address answered", "127.0.0.1:1")


async def test_serve_on_sqlite_is_ready_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "moorline",
        "serve",
        "--port",
        str(port),
        cwd=tmp_path,
        env=cli_env(MOORLINE_DATABASE_URL=f"sqlite+aiosqlite:///{tmp_path / 'moorline.db'}"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    # Drain both pipes from the start so a chatty server can never block on a full pipe.
    output = asyncio.ensure_future(proc.communicate())
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5.0) as client:

            async def answered(path: str) -> httpx.Response | None:
                assert not output.done(), "moorline serve exited before it answered"
                try:
                    response = await client.get(path)
                except httpx.TransportError:  # not listening yet
                    return None
                return response if response.status_code == 200 else None

            health = await wait_for(lambda: answered("/healthz"), timeout_s=30, message="/healthz")
            ready = await wait_for(lambda: answered("/readyz"), timeout_s=10, message="/readyz")
        assert health is not None and ready is not None
        assert health.json() == {"status": "ok"}
        assert ready.json() == {"status": "ready", "checks": {"database": "ok"}}

        proc.send_signal(signal.SIGTERM)
        stdout, stderr = await asyncio.wait_for(asyncio.shield(output), timeout=30)
    finally:
        if proc.returncode is None:
            proc.kill()
        await output
    assert proc.returncode == 0, stderr.decode()
    assert b"Traceback" not in stderr
    assert f"http://127.0.0.1:{port}".encode() in stdout
    assert (tmp_path / "moorline.db").exists()


def test_serve_on_a_port_in_use_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        database = tmp_path / "moorline.db"
        result = run_cli(
            "serve",
            "--port",
            str(port),
            cwd=tmp_path,
            MOORLINE_DATABASE_URL=f"sqlite+aiosqlite:///{database}",
        )
    assert_one_line_error(result, f"127.0.0.1:{port}", "in use")
    assert result.stdout == ""  # no banner, no generated admin token
    assert not database.exists()  # nothing connected to the database


def test_serve_on_a_read_only_database_is_one_line_at_once(tmp_path: Path) -> None:
    database = tmp_path / "moorline.db"
    made = run_cli(
        "db", "upgrade", cwd=tmp_path, MOORLINE_DATABASE_URL=f"sqlite+aiosqlite:///{database}"
    )
    assert made.returncode == 0, made.stderr
    read_only = f"sqlite+aiosqlite:///file:{database}?mode=ro&uri=true"
    result = run_cli(
        "serve", "--port", str(free_port()), cwd=tmp_path, MOORLINE_DATABASE_URL=read_only
    )
    assert_one_line_error(result, "database is down", "read-only")
    assert result.stdout == ""  # no banner: it never started
    assert "retry" not in result.stderr
