"""Procrastinate on PostgreSQL: the no-op task, the latency probe, and their driver.

A defer returns once its job is committed (``synchronous_commit`` on); the job is ``doing``
while it runs and its outcome (``succeeded``) is committed after: its table is the record.

- ``enqueue``: ``noop.defer_async()`` one at a time; ``bulk``: ``noop.batch_defer_async``,
  ``batch`` jobs a call;
- ``drain``: one ``procrastinate worker`` at its defaults (concurrency 1, LISTEN/NOTIFY).
"""

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from peer_common import HERE, blocking, fresh_pg_database, latency, pg_count, running, stamp_now
from procrastinate import App, PsycopgConnector
from timing import WARM_UP, measure_drain, rate

# No conninfo: libpq's PG* variables, set by the driver (and inherited by the worker).
app = App(connector=PsycopgConnector())


@app.task(name="noop")
async def noop() -> None:
    """Does nothing."""


@app.task(name="stamp")
async def stamp(key: str) -> None:
    stamp_now(key)


async def enqueue(count: int, bulk: int, batch: int) -> dict[str, float]:
    for _ in range(WARM_UP):
        await noop.defer_async()
    started = time.perf_counter()
    for _ in range(count):
        await noop.defer_async()
    figures = {"enqueue": rate(count, started)}
    await noop.batch_defer_async(*[{}] * WARM_UP)
    started = time.perf_counter()
    for first in range(0, bulk, batch):
        await noop.batch_defer_async(*[{}] * min(batch, bulk - first))
    figures["bulk"] = rate(bulk, started)
    return figures


async def opened() -> None:
    await app.open_async()


def run(peer: str, storage: str, config: dict[str, Any]) -> dict[str, float]:
    with fresh_pg_database() as dsn, TemporaryDirectory() as folder:
        env: dict[str, str] = {}
        command = [sys.executable, "-m", "procrastinate", "--app", "peer_procrastinate.app"]
        schema = [*command, "schema", "--apply"]
        subprocess.run(schema, env=dict(os.environ, PYTHONPATH=str(HERE)), cwd=HERE, check=True)
        log = Path(folder) / "worker.log"
        with asyncio.Runner() as runner:
            runner.run(opened())
            figures = runner.run(enqueue(config["runs"], config["bulk_runs"], config["batch"]))
            total = config["runs"] + config["bulk_runs"] + 2 * WARM_UP
            done = pg_count(
                dsn, "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
            )
            with running([*command, "worker"], env, log) as started:
                figures |= measure_drain(total, done, started).as_dict("drain")
            if config["latency_runs"]:
                with running([*command, "worker"], env, log):
                    send = blocking(runner, lambda key: stamp.defer_async(key=key))
                    figures |= latency(send, config["latency_runs"])
            runner.run(app.close_async())
        return figures
