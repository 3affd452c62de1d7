"""The real servers tests talk to, and per-test-module databases on them.

Outside CI a server that is down skips its tests with one line saying how to start it; with
``CI=true`` (``MOORLINE_REQUIRE_SERVERS=1``) a missing server fails the run instead.
"""

import os
import socket
import subprocess
import uuid
from dataclasses import dataclass

import pytest

PG_ADMIN_URL = os.environ.get(
    "MOORLINE_TEST_PG", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
)
MYSQL_ADMIN_URL = os.environ.get("MOORLINE_TEST_MYSQL", "mysql+aiomysql://root@127.0.0.1:3306/test")
REDIS_TEST_URL = os.environ.get("MOORLINE_TEST_REDIS", "redis://127.0.0.1:6379/0")


@dataclass(frozen=True)
class Server:
    name: str
    host: str
    port: int
    start_hint: str


SERVERS = {
    "postgresql": Server(
        "PostgreSQL",
        "127.0.0.1",
        5432,
        "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
    ),
    "mysql": Server(
        "MariaDB",
        "127.0.0.1",
        3306,
        "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd",
    ),
    "redis": Server(
        "Redis",
        "127.0.0.1",
        6379,
        'redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" '
        "--appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log",
    ),
}


def servers_required() -> bool:
    return os.environ.get("CI", "").lower() == "true" or os.environ.get(
        "MOORLINE_REQUIRE_SERVERS", ""
    ) in ("1", "true")


def is_listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def require_server(kind: str) -> None:
    """Skip (or, in CI, fail) when the server of ``kind`` is not answering."""
    server = SERVERS[kind]
    if is_listening(server.host, server.port):
        return
    message = (
        f"{server.name} is not running on {server.host}:{server.port}; "
        f"start it with: {server.start_hint}"
    )
    if servers_required():
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def unique_name(prefix: str = "moorline_test") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


def run_sql(kind: str, sql: str) -> None:
    """Run one administrative statement through the server's command-line client."""
    if kind == "postgresql":
        cmd = [
            "psql",
            "-h",
            "127.0.0.1",
            "-U",
            "postgres",
            "-d",
            "test",
            "-v",
            "ON_ERROR_STOP=1",
            "-qc",
            sql,
        ]
    else:
        cmd = ["mysql", "-uroot", "-h", "127.0.0.1", "-P", "3306", "-e", sql]
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)
