"""DBOS Transact on PostgreSQL: no-op and one-step workflows, the probe, and their driver.

A workflow enqueued by ``DBOSClient.enqueue`` (the documented way to enqueue from outside the
app) is a committed row of ``dbos.workflow_status``; a worker process (``DBOS.launch()`` with the
queue registered) dequeues it, runs it, and commits its outcome (``SUCCESS``): that table is the
record. A step's outcome is checkpointed (committed) before the workflow goes on.

- ``enqueue``: ``client.enqueue`` one at a time. No bulk: DBOS has no bulk enqueue, so the
  bulk's count is enqueued one at a time too, untimed, for the drain.
- ``drain``: one worker process at DBOS's defaults: a queue without concurrency limits, polled
  every second (``polling_interval_sec`` 1.0); ``drain_step``: the same on workflows of one
  checkpointed step each.

    .venv/bin/python peer_dbos.py worker|setup   (the worker; the schema and queue only)
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from dbos import DBOS, DBOSClient
from peer_common import HERE, fresh_pg_database, latency, pg_count, running, stamp_now
from timing import WARM_UP, measure_drain, rate

NAME = "peers"
QUEUE = "peers"


@DBOS.workflow(name="noop")
async def noop() -> None:
    """Does nothing."""


@DBOS.step(name="nothing")
async def nothing() -> None:
    """The step: nothing to compute, so it costs only its checkpoint."""


@DBOS.workflow(name="one_step")
async def one_step() -> None:
    await nothing()


@DBOS.workflow(name="stamp")
async def stamp(key: str) -> None:
    stamp_now(key)


def launch(url: str) -> None:
    DBOS(config={"name": NAME, "system_database_url": url})
    DBOS.launch()
    DBOS.register_queue(QUEUE)


def worker(url: str, once: bool) -> None:
    launch(url)
    if once:
        DBOS.destroy()
        return
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    stopped.wait()
    DBOS.destroy()


def enqueue_all(client: DBOSClient, workflow: str, count: int) -> None:
    for _ in range(count):
        client.enqueue({"queue_name": QUEUE, "workflow_name": workflow})


def run(peer: str, storage: str, config: dict[str, Any]) -> dict[str, float]:
    with fresh_pg_database() as dsn, TemporaryDirectory() as folder:
        env = {"PEERS_DBOS_URL": dsn}
        command = [sys.executable, "peer_dbos.py", "worker"]
        log = Path(folder) / "worker.log"
        setup = [sys.executable, "peer_dbos.py", "setup"]
        subprocess.run(
            setup, env=dict(os.environ, **env), cwd=HERE, check=True, capture_output=True
        )
        client = DBOSClient(system_database_url=dsn, application_name=NAME)
        try:
            enqueue_all(client, "noop", WARM_UP)
            count = config["runs"]
            started = time.perf_counter()
            enqueue_all(client, "noop", count)
            figures = {"enqueue": rate(count, started)}
            backlog = config["bulk_runs"]  # no bulk call: as many again, one at a time, untimed
            enqueue_all(client, "noop", backlog)
            sql = "SELECT count(*) FROM dbos.workflow_status WHERE status = 'SUCCESS'"
            done = pg_count(dsn, sql)
            with running(command, env, log) as started:
                total = WARM_UP + count + backlog
                figures |= measure_drain(total, done, started).as_dict()
            steps = config["step_runs"]
            enqueue_all(client, "one_step", steps)
            before = done()
            with running(command, env, log) as started:
                drained = measure_drain(steps, done, started, before)
                figures |= drained.as_dict("drain_step")
            if config["latency_runs"]:
                with running(command, env, log):
                    send = lambda key: client.enqueue(  # noqa: E731
                        {"queue_name": QUEUE, "workflow_name": "stamp"}, key
                    )
                    figures |= latency(send, config["latency_runs"])
            return figures
        finally:
            client.destroy()


if __name__ == "__main__":
    worker(os.environ["PEERS_DBOS_URL"], once=sys.argv[1] == "setup")
