"""Real worker processes for the fault tests: start, kill -9, SIGSTOP/SIGCONT, SIGTERM.

Each worker is ``python -m moorline worker`` with the fault app, its own log file, and
settings from the environment: short leases and a fast reaper so faults resolve in seconds.
Without ``redis_url`` each worker has its own in-memory RuntimeStore (nothing outside the
process can signal it); with one, they share Redis under ``redis_prefix`` with the test.
"""

import asyncio
import contextlib
import os
import random
import signal
import sqlite3
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from sqlalchemy import func, select, text
from sqlalchemy.engine import make_url

from moorline.api.app import create_app
from moorline.db.manager import DatabaseManager
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.db.schema import events, runs
from moorline.engine.registry import Moorline
from moorline.settings import Settings
from moorline.types import TERMINAL_STATUSES, JSONObject, RunId, RunStatus, TenantId
from tests.helpers import wait_for
from tests.servers import SERVERS

REPO_ROOT = Path(__file__).resolve().parents[2]
LANE = "workflow"  # the community edition's single lane
PLAN = "bulk"
LEASE_TTL_S = 3.0
REAPER_INTERVAL_S = 0.5
RECOVERY_BOUND_S = LEASE_TTL_S + REAPER_INTERVAL_S + 5.0
"""Issue 3: an interrupted run is back within LEASE_TTL + reaper interval + 5 s."""

UNMEASURED = ("COVERAGE_PROCESS_START", "COVERAGE_PROCESS_CONFIG")
"""The variables through which coverage (``patch = subprocess``) measures child processes."""


def plans_file(folder: Path, *, tenant_concurrency: int, daily_tokens: int | None = None) -> Path:
    """The one plan of the fault tests (``PLAN``), with a ``daily_tokens`` budget if given."""
    path = folder / "plans.yaml"
    budget = "" if daily_tokens is None else f"    daily_tokens: {daily_tokens}\n"
    path.write_text(
        "plans:\n"
        f"  {PLAN}:\n"
        f"    lane: {LANE}\n"
        "    priority: 0\n"
        "    daily_quota: 1000000\n"
        '    rate_limit: "1000/second"\n'
        f"    tenant_concurrency: {tenant_concurrency}\n"
        "    lane_slots: 20\n" + budget
    )
    return path


@dataclass
class Workers:
    """The worker processes of one test; every one still alive is killed at the end."""

    database_url: str
    folder: Path
    slots: int = 20
    grace_s: float = 5.0
    tenant_concurrency: int = 1000
    daily_tokens: int | None = None
    """The plan's ``daily_tokens`` budget (None: none)."""
    redis_url: str | None = None
    """The Redis runtime store the workers share; None: each has its own in-memory store."""
    redis_prefix: str = "mo"
    app: str = "tests.faults.app:app"
    """The ``--app`` the workers load (the soak has its own)."""
    extra_env: dict[str, str] = field(default_factory=dict)
    measured: bool = True
    """Whether coverage measures the processes (when the tests run under it). A process that
    ends by SIGKILL never writes its data: tracing it only slows it down (a traced worker takes
    about 1.5 s more CPU to start, on a machine whose two cores the test shares with it). The
    tests that kill workers at random turn it off; the other fault tests measure the worker
    process code that only runs in a real process (signals, shutdown)."""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        plans = plans_file(
            self.folder, tenant_concurrency=self.tenant_concurrency, daily_tokens=self.daily_tokens
        )
        env = dict(os.environ)
        env.update(
            MOORLINE_DATABASE_URL=self.database_url,
            MOORLINE_EDITION="community",
            MOORLINE_PLANS_FILE=str(plans),
            MOORLINE_LEASE_TTL=str(LEASE_TTL_S),
            MOORLINE_REAPER_INTERVAL=str(REAPER_INTERVAL_S),
            PYTHONPATH=str(REPO_ROOT),
        )
        env.pop("MOORLINE_DATABASE_URLS", None)
        env.pop("MOORLINE_REDIS_URL", None)
        if self.redis_url is not None:
            env.update(MOORLINE_REDIS_URL=self.redis_url, MOORLINE_REDIS_PREFIX=self.redis_prefix)
        env.update(self.extra_env)
        if not self.measured:
            for name in UNMEASURED:
                env.pop(name, None)
        return env

    def start(self, wrapper: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        """Start one more worker; ``wrapper`` prefixes its command (e.g. ``ip netns exec``)."""
        index = len(self.procs)
        log = (self.folder / f"worker-{index}.log").open("wb")
        proc = subprocess.Popen(
            [
                *wrapper,
                sys.executable,
                "-m",
                "moorline",
                "worker",
                "--app",
                self.app,
                "--lanes",
                f"{LANE}={self.slots}",
                "--grace",
                str(self.grace_s),
            ],
            cwd=REPO_ROOT,
            env=self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.procs.append(proc)
        return proc

    def log(self, proc: subprocess.Popen[bytes]) -> str:
        return (self.folder / f"worker-{self.procs.index(proc)}.log").read_text(errors="replace")

    def is_serving(self, proc: subprocess.Popen[bytes]) -> bool:
        """Whether the worker has started its loops (and its signal handlers)."""
        return " serving " in self.log(proc)

    def alive(self) -> list[subprocess.Popen[bytes]]:
        return [proc for proc in self.procs if proc.poll() is None]

    def terminate_all(self, timeout_s: float = 30.0) -> None:
        for proc in self.alive():
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill_all(self) -> None:
        for proc in self.alive():
            proc.kill()
            proc.wait()


def owner_pattern(proc: subprocess.Popen[bytes]) -> str:
    """A LIKE pattern matching the lease owner ids of one worker process (host:pid:random)."""
    return f"%:{proc.pid}:%"


async def submit(
    runs: RunsRepo,
    tenant_ids: list[TenantId],
    workflow: str,
    inputs: Sequence[JSONObject],
    *,
    max_attempts: int = 50,
) -> list[RunId]:
    new = [
        NewRun(
            tenant_id=tenant_ids[index % len(tenant_ids)],
            workflow=workflow,
            input=value,
            lane=LANE,
            max_attempts=max_attempts,
        )
        for index, value in enumerate(inputs)
    ]
    return [run.run_id for run in await runs.submit_many(new)]


def client_ports(pid: int, server_port: int) -> list[int]:
    """The local ports of process ``pid``'s TCP connections to ``server_port``.

    Read from ``/proc``: the socket inodes its descriptors point at, then the rows of its
    network namespace's TCP tables that own them. Only connections to the server's port: a
    local port is unique per destination, so the process's connection to Redis may have the
    same local port as another process's session with the database.
    """
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    ports = []
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                remote_port = int(fields[2].rsplit(":", 1)[1], 16)
                if fields[9] in inodes and remote_port == server_port:
                    ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


async def write_locks_held(db: DatabaseManager, pid: int) -> list[str]:
    """The write locks process ``pid`` holds on ``db``'s database, described; empty if none.

    SQLite: its one write lock, when taken (a ``BEGIN IMMEDIATE`` that cannot wait), by
    whomever. The servers: each transaction of the process's sessions (known by their client
    ports) that has written or locked rows (PostgreSQL gives such a transaction an id).
    Other processes' transactions are not what a pause must avoid, and a successor started
    beside the process may be in one at nearly every instant under load.
    """
    if db.backend.name == "sqlite":
        probe = sqlite3.connect(str(make_url(db.urls[0]).database), timeout=0)
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
            return []
        except sqlite3.OperationalError as exc:
            assert "locked" in str(exc), exc
            return ["the database's write lock"]
        finally:
            probe.close()
    url = make_url(db.urls[0])
    ports = client_ports(pid, url.port or SERVERS[db.backend.name].port)
    assert ports, f"process {pid} has no TCP connection to the database"
    listed = ", ".join(str(port) for port in ports)
    # Each such transaction described (its state and statement), for a failure's message.
    query = (
        "SELECT concat_ws(' ', state, 'since', xact_start, ':', left(query, 200)) "
        "FROM pg_stat_activity WHERE datname = current_database() "
        f"AND backend_xid IS NOT NULL AND client_port IN ({listed})"
        if db.backend.name == "postgresql"
        else "SELECT concat_ws(' ', trx_state, 'since', trx_started, 'rows locked', "
        "trx_rows_locked, ':', left(coalesce(trx_query, '(idle)'), 200)) "
        "FROM information_schema.innodb_trx AS trx "
        "JOIN information_schema.processlist AS session ON session.ID = trx.trx_mysql_thread_id "
        "WHERE (trx_rows_locked > 0 OR trx_rows_modified > 0 OR trx_tables_locked > 0) "
        f"AND SUBSTRING_INDEX(session.HOST, ':', -1) IN ({listed})"
    )
    async with db.connect() as conn:
        return [str(row[0]) for row in await conn.execute(text(query))]


INNODB_TRX_CACHE_S = 0.15
"""Longer than MariaDB's refresh interval of the ``innodb_trx`` table's cache (0.1 s)."""


async def pause_between_transactions(db: DatabaseManager, proc: subprocess.Popen[bytes]) -> None:
    """SIGSTOP ``proc`` at an instant it holds no write lock, retrying until one is found.

    A process stopped inside a transaction keeps its locks until it is continued: on SQLite
    the database's one write lock, so no other process can write at all (a successor
    starting then dies with "database is locked" after ``busy_timeout``); on the servers
    the lock of the row it was updating, which the reaper's reclaim would wait on. Neither
    a lease nor a fence can take back a lock from a stopped process: what this test proves
    is what happens to a worker paused mid-run, between its writes, which is nearly always
    where a pause lands (its transactions last milliseconds).
    """
    last_held: list[str] = []

    async def stopped_between_transactions() -> bool:
        proc.send_signal(signal.SIGSTOP)
        if db.backend.name == "mysql":
            # MariaDB refreshes ``information_schema.innodb_trx`` from a cache at most every
            # 0.1 s: read sooner, it may miss a transaction begun just before the stop, or
            # show one ended just before it.
            await asyncio.sleep(INNODB_TRX_CACHE_S)
        held = await write_locks_held(db, proc.pid)
        if not held:
            return True
        last_held[:] = held
        proc.send_signal(signal.SIGCONT)
        # Let it run a random while before the next try: on a loaded machine a process
        # stopped again every 20 ms (the check itself keeps it stopped longer) may never get
        # the CPU to finish the transaction it was caught in, and a fixed cadence could
        # keep landing in the same periodic write.
        await asyncio.sleep(random.uniform(0.02, 0.3))
        return False

    try:
        await wait_for(
            stopped_between_transactions, timeout_s=60, message="a pause between transactions"
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the last write transactions found: {last_held}") from None


@asynccontextmanager
async def in_process_api(
    settings: Settings, workflows: Moorline
) -> AsyncIterator[httpx.AsyncClient]:
    """The API of ``settings`` serving ``workflows`` in this process, and a client of it.

    The app has its own manager, as a server process would; the schema is the test's to build.
    """
    manager = DatabaseManager(settings)
    await manager.initialize()
    app = create_app(settings, manager, workflows=workflows)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://moorline.test") as client,
    ):
        yield client


async def new_tenant(
    api: httpx.AsyncClient, admin_token: str, name: str
) -> tuple[TenantId, dict[str, str]]:
    """A tenant on ``PLAN`` made through the admin API: its id and its key's headers."""
    made = await api.post(
        "/v1/admin/tenants",
        json={"name": f"{name}-{uuid.uuid4().hex[:8]}", "plan": PLAN},
        headers={"Authorization": f"Bearer {admin_token}"},
    )
    assert made.status_code == 201, made.text
    body = made.json()
    return TenantId(body["tenant_id"]), {"Authorization": f"Bearer {body['api_key']}"}


async def held_by(db: DatabaseManager, pattern: str) -> list[tuple[str, int]]:
    """(run, attempt) of the runs still ``running`` under a lease owner matching ``pattern``."""
    async with db.connect() as conn:
        rows = await conn.execute(
            select(runs.c.id, runs.c.attempt).where(
                runs.c.status == RunStatus.RUNNING.value, runs.c.lease_owner.like(pattern)
            )
        )
        return [(row.id, row.attempt) for row in rows]


async def terminal_count(db: DatabaseManager, run_ids: Sequence[str]) -> int:
    """How many of the runs have ended."""
    terminal = [status.value for status in TERMINAL_STATUSES]
    async with db.connect() as conn:
        count: int = (
            await conn.execute(
                select(func.count()).where(runs.c.id.in_(run_ids), runs.c.status.in_(terminal))
            )
        ).scalar_one()
    return count


async def terminal_events(db: DatabaseManager, run_ids: Sequence[str]) -> Counter[str]:
    """How many times each run ended (its ``succeeded``/``failed`` events)."""
    async with db.connect() as conn:
        rows = await conn.execute(
            select(events.c.run_id).where(
                events.c.run_id.in_(run_ids), events.c.type.in_(["succeeded", "failed"])
            )
        )
        return Counter(row.run_id for row in rows)
