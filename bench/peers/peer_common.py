"""What every peer's driver shares: a fresh PostgreSQL database, worker processes, latency probes.

Runs in the peers' venv (``bench/peers/.venv``), never Moorline's. Each peer module
(``peer_<name>.py``) holds the peer's app (tasks as its documentation writes them) and a
``run(storage, config)`` that measures the workloads :mod:`run` asks for through that peer's
documented public API, and returns the figures.

The latency probe is the same for every peer: the task ``stamp(key)`` pushes ``time.time()`` to
the Redis list ``key`` as its first act, and the driver takes the time just before its enqueue
call and pops the stamp (Redis here only carries the measurement, whatever the peer's storage).
"""

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import redis
from timing import WARM_UP, latency_figures, pause, stop

HERE = Path(__file__).resolve().parent
REDIS_URL = os.environ.get("PEERS_REDIS_URL", "redis://127.0.0.1:6379/0")
PG_DSN = os.environ.get("PEERS_PG_DSN", "postgresql://postgres@127.0.0.1:5432/{db}")


def stamp_now(key: str) -> None:
    """The latency task's body: the time it started, pushed to ``key``."""
    started = time.time()
    client = _stamps()
    client.rpush(key, repr(started))


_client: Any = None


def _stamps() -> Any:
    global _client
    if _client is None:
        _client = redis.Redis.from_url(REDIS_URL)
    return _client


@contextmanager
def fresh_pg_database() -> Iterator[str]:
    """A new PostgreSQL database's DSN, dropped afterwards; named by ``PGDATABASE`` meanwhile
    (with ``PGHOST``, ``PGPORT``, ``PGUSER``), which peers connecting from libpq's variables
    read, as their documentation shows, and which worker processes inherit."""
    name = f"peers_{uuid.uuid4().hex[:8]}"
    admin = PG_DSN.format(db="postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    dsn = PG_DSN.format(db=name)
    parts = psycopg.conninfo.conninfo_to_dict(dsn)
    os.environ.update(
        PGHOST=str(parts.get("host", "127.0.0.1")),
        PGPORT=str(parts.get("port", 5432)),
        PGUSER=str(parts.get("user", "postgres")),
        PGDATABASE=name,
    )
    try:
        yield dsn
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def pg_count(dsn: str, sql: str) -> Callable[[], int]:
    """A counter reading ``sql``'s one integer on a kept-open connection."""
    conn = psycopg.connect(dsn, autocommit=True)

    def count() -> int:
        row = conn.execute(sql).fetchone()
        return int(row[0]) if row else 0

    return count


def start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """One worker process started from this folder, its output to ``log``."""
    env = dict(os.environ, PYTHONPATH=str(HERE), **env)
    return subprocess.Popen(
        command, cwd=HERE, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT
    )


@contextmanager
def running(command: list[str], env: dict[str, str], log: Path) -> Iterator[float]:
    """A worker process for the ``with`` block; yields the ``perf_counter`` it started at."""
    started = time.perf_counter()
    proc = start(command, env, log)
    try:
        yield started
    except BaseException:
        stop([proc])
        print(f"{command}:\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
        raise
    stop([proc])


def latency(send: Callable[[str], Any], runs: int) -> dict[str, float]:
    """Enqueue ``stamp(key)`` one at a time through ``send(key)``; p50/p99 of enqueue → start."""
    # The first probes wait for the worker's start-up: longer than redis-py's read timeout.
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=60)
    key = f"peers-stamp-{uuid.uuid4().hex[:8]}"
    measured: list[float] = []
    try:
        for index in range(runs + WARM_UP):
            sent = time.time()
            send(key)
            popped = client.blpop([key], timeout=30)
            if popped is None:
                raise SystemExit("latency: the task did not start within 30 s")
            if index >= WARM_UP:
                measured.append((float(popped[1]) - sent) * 1000)
            time.sleep(pause())
    finally:
        client.delete(key)
        client.close()
    return latency_figures(measured)


def blocking(runner: asyncio.Runner, coroutine_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``coroutine_fn`` called to completion on ``runner``'s loop (for the sync probe)."""
    return lambda *args: runner.run(coroutine_fn(*args))
