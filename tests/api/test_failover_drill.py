"""Database failover drill (issue 7): stop the primary under load, promote its replica.

Two PostgreSQL clusters of this test alone (``pg_createcluster`` on free ports, so the shared
server is never touched): a primary, and a streaming replica made with ``pg_basebackup``. The
API runs with ``MOORLINE_DATABASE_URLS=primary,replica`` while clients trigger runs, each with
its own idempotency key, re-submitting with the same key until they get an answer. Mid-load the
primary is killed (``stop -m immediate``) and the replica promoted. Checked:

- before the promotion the replica refuses to be used at all: no write reaches a read-only node;
- after it, new connections go to the promoted node and triggers are accepted again;
- every key that was triggered names exactly one run, whatever failed in between;
- the old primary, brought back as a standby (demoted) while still first in the list, gets no
  connection: the failover creator skips read-only nodes.
"""

import asyncio
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.engine import make_url

from moorline.db.dsn import DatabaseUnreachable
from moorline.db.manager import DatabaseManager
from moorline.db.schema import runs
from moorline.settings import Settings
from tests.api.conftest import Api, Caller, MakeApi
from tests.helpers import wait_for

pytestmark = pytest.mark.faults

DATABASE = "moorline_drill"
LOAD_CLIENTS = 4
TRIGGERS_BEFORE = 20
TRIGGERS_AFTER = 20
TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed: {done.stdout}{done.stderr}")
    return done.stdout


@dataclass
class Cluster:
    """A Debian-managed PostgreSQL cluster: created, started, stopped and dropped by name."""

    version: str
    name: str
    port: int

    @property
    def data_dir(self) -> Path:
        return Path("/var/lib/postgresql") / self.version / self.name

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{DATABASE}"

    def create(self) -> None:
        run(
            "pg_createcluster", self.version, self.name, "-p", str(self.port),
            "-o", "fsync=off", "-o", "synchronous_commit=on",
            "--", "--auth=trust",
        )  # fmt: skip

    def ctl(self, *action: str) -> None:
        run("pg_ctlcluster", self.version, self.name, *action)

    def sql(self, statement: str, database: str = "postgres") -> str:
        return run(
            "psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-d", database,
            "-Atc", statement,
        ).strip()  # fmt: skip

    def drop(self) -> None:
        subprocess.run(
            ["pg_dropcluster", "--stop", self.version, self.name], capture_output=True, timeout=60
        )


@pytest.fixture(scope="module")
def clusters() -> Iterator[tuple[Cluster, Cluster]]:
    if shutil.which("pg_createcluster") is None or not Path("/etc/postgresql").is_dir():
        pytest.fail("the drill needs Debian's postgresql-common (pg_createcluster)")
    version = sorted(os.listdir("/etc/postgresql"))[-1]
    tag = uuid.uuid4().hex[:8]
    primary = Cluster(version, f"mo_drill_{tag}_a", free_port())
    replica = Cluster(version, f"mo_drill_{tag}_b", free_port())
    try:
        primary.create()
        primary.ctl("start")
        primary.sql(f"CREATE DATABASE {DATABASE}")
        replica.create()
        for entry in replica.data_dir.iterdir():
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        run(
            "runuser", "-u", "postgres", "--", "pg_basebackup", "-h", "127.0.0.1",
            "-p", str(primary.port), "-U", "postgres", "-D", str(replica.data_dir),
            "-R", "-X", "stream", "-c", "fast",
        )  # fmt: skip
        replica.ctl("start")
        deadline = time.monotonic() + TIMEOUT_S
        while primary.sql("SELECT count(*) FROM pg_stat_replication") != "1":
            assert time.monotonic() < deadline, "the replica never started streaming"
            time.sleep(0.1)
        yield primary, replica
    finally:
        primary.drop()
        replica.drop()


@pytest.fixture(scope="module")
def api_database_url(clusters: tuple[Cluster, Cluster]) -> str:
    primary, _ = clusters
    return make_url(primary.url).set(drivername="postgresql+asyncpg").render_as_string(False)


@dataclass
class Load:
    """Clients that trigger runs, each key re-submitted until it gets an answer."""

    api: Api
    caller: Caller
    answered: dict[str, str]
    """Idempotency key → the run id the API answered with (the first answer)."""
    disagreements: list[str]
    failures: int = 0
    stop: bool = False

    async def client(self, number: int) -> None:
        sequence = 0
        while not self.stop:
            key = f"client-{number}-{sequence}"
            sequence += 1
            body = {"input": {"message": key}, "idempotency_key": key}
            answer: str | None = None
            while answer is None:
                try:
                    response = await self.api.trigger(self.caller, "echo", **body)
                except Exception:  # the request died with the database: re-submit
                    response = None
                if response is not None and response.status_code in (200, 202):
                    answer = response.json()["run_id"]
                else:
                    self.failures += 1
                    await asyncio.sleep(0.05)
            # A second answer for the same key must name the same run.
            again = await self.api.trigger(self.caller, "echo", **body)
            if again.status_code != 200 or again.json()["run_id"] != answer:
                self.disagreements.append(f"{key}: {answer} then {again.status_code} {again.text}")
            self.answered[key] = answer


async def server_port(db: DatabaseManager) -> int:
    async with db.connect() as conn:
        port: int = (await conn.execute(text("SELECT inet_server_port()"))).scalar_one()
    return port


async def test_failover_drill(clusters: tuple[Cluster, Cluster], make_api: MakeApi) -> None:
    primary, replica = clusters
    replica_only = DatabaseManager(Settings(database_url=replica.url, db_retry_base=0.01))
    with pytest.raises(DatabaseUnreachable, match="read-only"):
        async with replica_only.connect():
            pass
    await replica_only.dispose()

    async with make_api(database_urls=[primary.url, replica.url]) as api:
        assert await server_port(api.db) == primary.port
        caller = await api.tenant("team")
        load = Load(api, caller, answered={}, disagreements=[])
        clients = [asyncio.create_task(load.client(n)) for n in range(LOAD_CLIENTS)]

        async def answered_at_least(count: int) -> bool:
            return len(load.answered) >= count

        await wait_for(lambda: answered_at_least(TRIGGERS_BEFORE), timeout_s=TIMEOUT_S)
        primary.ctl("stop", "-m", "immediate")
        replica.ctl("promote")
        promoted_at = len(load.answered)
        await wait_for(
            lambda: answered_at_least(promoted_at + TRIGGERS_AFTER),
            timeout_s=TIMEOUT_S,
            message="triggers to be accepted again after the promotion",
        )
        assert await server_port(api.db) == replica.port
        # The load pauses while the pool is replaced below: SQLAlchemy's dispose() cannot
        # close a connection that is checked out, and a disposed async pool leaves those to
        # the garbage collector.
        load.stop = True
        await asyncio.gather(*clients)

        # The old primary comes back demoted (a standby of the new one), still first in the
        # list: no new connection may use it.
        (primary.data_dir / "standby.signal").touch()
        auto_conf = primary.data_dir / "postgresql.auto.conf"
        auto_conf.write_text(
            f"primary_conninfo = 'host=127.0.0.1 port={replica.port} user=postgres'\n"
        )
        shutil.chown(auto_conf, "postgres", "postgres")
        shutil.chown(primary.data_dir / "standby.signal", "postgres", "postgres")
        primary.ctl("start")
        assert primary.sql("SELECT pg_is_in_recovery()") == "t"
        await api.db.engine.dispose()  # every pooled connection is new from here on
        load.stop = False
        clients = [asyncio.create_task(load.client(LOAD_CLIENTS + n)) for n in range(LOAD_CLIENTS)]
        demoted_at = len(load.answered)
        await wait_for(lambda: answered_at_least(demoted_at + TRIGGERS_AFTER), timeout_s=TIMEOUT_S)
        assert await server_port(api.db) == replica.port

        load.stop = True
        await asyncio.gather(*clients)

        assert load.disagreements == []
        async with api.db.connect() as conn:
            rows = await conn.execute(
                select(runs.c.idempotency_key, func.count(), func.min(runs.c.id))
                .where(runs.c.tenant_id == caller.tenant_id)
                .group_by(runs.c.idempotency_key)
            )
            stored = {key: (count, run_id) for key, count, run_id in rows}
        assert {key: count for key, (count, _) in stored.items()} == dict.fromkeys(
            load.answered, 1
        ), "a key with no run or with several"
        assert {key: run_id for key, (_, run_id) in stored.items()} == load.answered
        print(
            f"failover drill: {len(load.answered)} keys, {load.failures} failed attempts "
            "re-submitted, one run per key"
        )
