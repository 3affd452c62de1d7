"""Huey with SQLite storage (a file, WAL) or Redis: the no-op task, the probe, and their driver.

``PEERS_HUEY`` chooses the storage: ``sqlite:<file>`` (``SqliteHuey``: WAL, SQLite's default
``synchronous``, FULL) or ``redis:<name>`` (``RedisHuey``). A call to a task enqueues it and
returns once it is stored; the consumer takes a task off the queue before running it (a killed
consumer loses the task it ran). The no-op task returns ``True`` so that its result is stored:
the result store is the record of completion (``huey.result_count()``).

- ``enqueue``: ``noop()`` one at a time. No bulk: huey has no bulk enqueue, so the bulk's
  count is enqueued one at a time too, untimed, for the drain.
- ``drain``: one ``huey_consumer`` at its defaults (one worker thread) runs all of them.
"""

import os
import sys
import time
import uuid
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from huey import RedisHuey, SqliteHuey
from peer_common import REDIS_URL, latency, running, stamp_now
from timing import WARM_UP, measure_drain, rate


def make_huey(spec: str) -> Any:
    kind, _, where = spec.partition(":")
    if kind == "sqlite":
        return SqliteHuey(filename=where)
    return RedisHuey(where, url=REDIS_URL)


huey = make_huey(os.environ.get("PEERS_HUEY", "redis:peers"))


@huey.task()
def noop() -> bool:
    """Does nothing; its result, stored, says it ran."""
    return True


@huey.task()
def stamp(key: str) -> None:
    stamp_now(key)


def run(peer: str, storage: str, config: dict[str, Any]) -> dict[str, float]:
    global huey, noop, stamp
    with TemporaryDirectory() as folder:
        if storage == "sqlite":
            spec = f"sqlite:{Path(folder) / 'huey.db'}"
        else:
            spec = f"redis:peers-{uuid.uuid4().hex[:8]}"
        os.environ["PEERS_HUEY"] = spec
        # The module again, with this storage: its tasks bound to the new huey.
        sys.modules.pop("peer_huey", None)
        import peer_huey

        huey, noop, stamp = peer_huey.huey, peer_huey.noop, peer_huey.stamp
        try:
            for _ in range(WARM_UP):
                noop()
            count = config["runs"]
            started = time.perf_counter()
            for _ in range(count):
                noop()
            figures = {"enqueue": rate(count, started)}
            backlog = config["bulk_runs"]  # no bulk call: as many again, one at a time, untimed
            for _ in range(backlog):
                noop()
            command = [sys.executable, "-m", "huey.bin.huey_consumer", "peer_huey.huey"]
            log = Path(folder) / "worker.log"
            with running(command, {"PEERS_HUEY": spec}, log) as started:
                total = WARM_UP + count + backlog
                figures |= measure_drain(total, huey.result_count, started).as_dict()
            if config["latency_runs"]:
                with running(command, {"PEERS_HUEY": spec}, log):
                    figures |= latency(lambda key: stamp(key), config["latency_runs"])
            return figures
        finally:
            huey.storage.flush_all()
