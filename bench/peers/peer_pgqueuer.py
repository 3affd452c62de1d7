"""PgQueuer on PostgreSQL (asyncpg, as its README): the no-op job, the probe, and their driver.

Installed with ``pgq install`` at its default durability (``durable``: logged tables). An
``enqueue`` returns once its job is committed; a job is ``picked`` while it runs, and on success
it leaves the job table (its outcome goes to the log table): done is what left the queue.

- ``enqueue``: ``Queries.enqueue("noop", None)`` one at a time; ``bulk``: ``Queries.enqueue``
  with lists, ``batch`` jobs a call (its documented batch insert);
- ``drain``: one worker process, ``pgqueuer.run(main)`` at its defaults (batch size 10, no
  concurrency limit, LISTEN/NOTIFY): the runner ``pgq run`` calls, in Python, as the CLI of
  pgqueuer 1.6.0 fails at start with this typer (``setup_fancy_logger`` gets a ``str``).
"""

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import asyncpg
import pgqueuer
from peer_common import HERE, blocking, fresh_pg_database, latency, pg_count, running, stamp_now
from pgqueuer import PgQueuer
from pgqueuer.db import AsyncpgDriver
from pgqueuer.models import Job
from pgqueuer.queries import Queries
from timing import WARM_UP, measure_drain, rate


@asynccontextmanager
async def main() -> AsyncIterator[PgQueuer]:
    """The consumer's factory, as ``pgq run`` takes it (the connection from PG* variables)."""
    connection = await asyncpg.connect()
    pgq = PgQueuer(AsyncpgDriver(connection))

    @pgq.entrypoint("noop")
    async def noop(job: Job) -> None:
        """Does nothing."""

    @pgq.entrypoint("stamp")
    async def stamp(job: Job) -> None:
        stamp_now((job.payload or b"").decode())

    try:
        yield pgq
    finally:
        await connection.close()


async def enqueue(queries: Queries, count: int, bulk: int, batch: int) -> dict[str, float]:
    for _ in range(WARM_UP):
        await queries.enqueue("noop", None)
    started = time.perf_counter()
    for _ in range(count):
        await queries.enqueue("noop", None)
    figures = {"enqueue": rate(count, started)}
    await queries.enqueue(["noop"] * WARM_UP, [None] * WARM_UP, [0] * WARM_UP)
    started = time.perf_counter()
    for first in range(0, bulk, batch):
        size = min(batch, bulk - first)
        await queries.enqueue(["noop"] * size, [None] * size, [0] * size)
    figures["bulk"] = rate(bulk, started)
    return figures


async def producer() -> Queries:
    return Queries(AsyncpgDriver(await asyncpg.connect()))


def run(peer: str, storage: str, config: dict[str, Any]) -> dict[str, float]:
    with fresh_pg_database() as dsn, TemporaryDirectory() as folder:
        pgq = [sys.executable, "-m", "pgqueuer"]
        subprocess.run([*pgq, "install"], cwd=HERE, check=True, capture_output=True)
        log = Path(folder) / "worker.log"
        command = [sys.executable, "peer_pgqueuer.py"]
        with asyncio.Runner() as runner:
            queries = runner.run(producer())
            figures = runner.run(
                enqueue(queries, config["runs"], config["bulk_runs"], config["batch"])
            )
            total = config["runs"] + config["bulk_runs"] + 2 * WARM_UP
            queued = pg_count(dsn, "SELECT count(*) FROM pgqueuer")
            done = lambda: total - queued()  # noqa: E731
            with running(command, {}, log) as started:
                figures |= measure_drain(total, done, started).as_dict("drain")
            if config["latency_runs"]:
                with running(command, {}, log):
                    send = blocking(runner, lambda key: queries.enqueue("stamp", key.encode()))
                    figures |= latency(send, config["latency_runs"])
        return figures


if __name__ == "__main__":
    asyncio.run(pgqueuer.run(main))
