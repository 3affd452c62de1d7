"""A PgBouncer of the tests' own, in transaction pooling mode, in front of 127.0.0.1:5432.

Debian's ``pgbouncer`` (``make test`` and ``.ci/run`` install it). It refuses to run as root,
so it runs as ``postgres`` (``-u``), its files in a folder of its own that user can write.
Every database name is passed through to the server of the same name (``* =``), so a test's
database is reached through it by the same name. The server pool is small
(:data:`SERVER_POOL`), so concurrent clients' transactions do share server sessions.
"""

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.servers import PG_ADMIN_URL, servers_required

SERVER_POOL = 20
"""Server sessions per database: fewer than the clients of a busy test, so they are shared."""

RUN_AS = "postgres"


def pgbouncer_binary() -> str | None:
    return shutil.which("pgbouncer") or next(
        (path for path in ("/usr/sbin/pgbouncer",) if os.access(path, os.X_OK)), None
    )


def require_pgbouncer() -> str:
    """The binary's path; skip (in CI: fail) when Debian's package is not installed."""
    binary = pgbouncer_binary()
    if binary is None:
        message = "pgbouncer is not installed; install it with: apt-get install -y pgbouncer"
        if servers_required():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return binary


class PrivateBouncer:
    """``pgbouncer`` on 127.0.0.1 and a free port, its config and log in a temporary folder."""

    def __init__(self, binary: str, *, server_pool: int = SERVER_POOL) -> None:
        self.binary = binary
        self.server_pool = server_pool
        self.folder = Path(tempfile.mkdtemp(prefix="moorline-pgbouncer-"))
        user = pwd.getpwnam(RUN_AS)
        os.chown(self.folder, user.pw_uid, user.pw_gid)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port: int = probe.getsockname()[1]
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, database: str) -> str:
        """The SQLAlchemy URL of ``database`` through this bouncer."""
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{database}"

    def start(self, timeout_s: float = 15.0) -> None:
        """Write the config, start the process and wait until it accepts connections."""
        config = self.folder / "pgbouncer.ini"
        users = self.folder / "users.txt"
        users.write_text('"postgres" ""\n')
        config.write_text(
            "[databases]\n"
            "* = host=127.0.0.1 port=5432\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {users}\n"
            "pool_mode = transaction\n"
            f"default_pool_size = {self.server_pool}\n"
            "max_client_conn = 1000\n"
            # After a failed server login (a test's outage) clients are refused this long.
            "server_login_retry = 1\n"
            # A client waiting for a server session during an outage is disconnected after
            # this long (120 s by default), so the outage shows as errors, not hung queries.
            "query_wait_timeout = 2\n"
            f"logfile = {self.folder / 'pgbouncer.log'}\n"
        )
        self.proc = subprocess.Popen(
            [self.binary, "-u", RUN_AS, str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while True:  # poll with a deadline until the port accepts
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited at start: {self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"pgbouncer did not listen: {self.log_tail()}") from None
            time.sleep(0.05)

    def log_tail(self, lines: int = 20) -> str:
        log = self.folder / "pgbouncer.log"
        return "\n".join(log.read_text().splitlines()[-lines:]) if log.exists() else "(no log)"

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers; the folder is removed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.folder, ignore_errors=True)


def direct_url(database: str) -> str:
    """The URL of ``database`` on the server itself, not through the bouncer."""
    from sqlalchemy.engine import make_url

    return make_url(PG_ADMIN_URL).set(database=database).render_as_string(hide_password=False)
