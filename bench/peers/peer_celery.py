"""Celery with its Redis broker: the no-op task, the latency probe, and their driver.

At its defaults Celery acknowledges a message when a worker *takes* it (``acks_late`` off): a
worker killed mid-task loses that task. The peer ``celery-acks-late`` sets ``acks_late`` (ack
after the task ran), the durability closest to Moorline's its Redis broker offers. Results are
not stored (``task_ignore_result``); the no-op task counts itself done in Redis.

- ``enqueue``: ``noop.apply_async()`` one at a time (one ``LPUSH`` each). No bulk: Celery has no
  documented bulk enqueue (a ``group`` sends one message per task), so the bulk's count is
  enqueued one at a time too, untimed, for the drain.
- ``drain``: one ``celery worker`` at its defaults: the prefork pool, one child per CPU, prefetch
  multiplier 4.
"""

import os
import sys
import time
import uuid
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from celery import Celery
from peer_common import REDIS_URL, latency, running, stamp_now
from timing import WARM_UP, measure_drain, rate

QUEUE = os.environ.get("PEERS_QUEUE", "peers")

app = Celery("peers", broker=REDIS_URL)
app.conf.task_ignore_result = True
app.conf.task_acks_late = os.environ.get("PEERS_ACKS_LATE") == "1"
app.conf.task_default_queue = QUEUE


def counter_key(queue: str) -> str:
    return f"{queue}:done"


@app.task(name="noop")
def noop() -> None:
    """Does nothing but record that it ran."""
    _counter().incr(counter_key(QUEUE))


@app.task(name="stamp")
def stamp(key: str) -> None:
    stamp_now(key)


_redis: Any = None


def _counter() -> Any:
    global _redis
    if _redis is None:
        import redis

        _redis = redis.Redis.from_url(REDIS_URL)
    return _redis


def run(peer: str, storage: str, config: dict[str, Any]) -> dict[str, float]:
    import redis

    queue = f"peers-{uuid.uuid4().hex[:8]}"
    env = {"PEERS_QUEUE": queue, "PEERS_ACKS_LATE": "1" if peer.endswith("acks-late") else ""}
    app.conf.task_default_queue = queue
    client = redis.Redis.from_url(REDIS_URL)
    command = [sys.executable, "-m", "celery", "-A", "peer_celery", "worker"]
    command += ["--loglevel", "WARNING"]
    figures: dict[str, float] = {}
    try:
        with TemporaryDirectory() as folder:
            log = Path(folder) / "worker.log"
            for _ in range(WARM_UP):
                noop.apply_async(queue=queue)
            count = config["runs"]
            started = time.perf_counter()
            for _ in range(count):
                noop.apply_async(queue=queue)
            figures["enqueue"] = rate(count, started)
            backlog = config["bulk_runs"]  # no bulk call: as many again, one at a time, untimed
            for _ in range(backlog):
                noop.apply_async(queue=queue)
            done = lambda: int(client.get(counter_key(queue)) or 0)  # noqa: E731
            with running(command, env, log) as started:
                total = WARM_UP + count + backlog
                figures |= measure_drain(total, done, started).as_dict("drain")
            if config["latency_runs"]:
                with running(command, env, log):
                    send = lambda key: stamp.apply_async((key,), queue=queue)  # noqa: E731
                    figures |= latency(send, config["latency_runs"])
        return figures
    finally:
        # Kombu's routing sets for the queue have no TTL: without this every round left one
        # (``binding_permanent`` is kombu 5.5's name). Its ``binding_deadlines`` holds Celery's
        # own three broadcast queues whatever the round, so it stays.
        client.delete(
            counter_key(queue),
            queue,
            f"_kombu.binding.{queue}",
            f"_kombu.binding_permanent.{queue}",
        )
        client.close()
