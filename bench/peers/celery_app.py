"""The Celery side of the peer workload: a no-op task that counts itself done in Redis.

Celery acknowledges a message when a worker *takes* it (``acks_late`` off, the default): a
worker killed mid-task loses that task. With ``PEERS_ACKS_LATE=1`` it acknowledges after the
task ran (``acks_late`` on), the durability closest to Moorline's that its Redis broker offers.
"""

import os

import redis
from celery import Celery

QUEUE = os.environ.get("PEERS_QUEUE", "peers")
REDIS_URL = os.environ.get("PEERS_REDIS_URL", "redis://127.0.0.1:6379/0")

app = Celery("peers", broker=REDIS_URL)
app.conf.task_ignore_result = True
app.conf.worker_prefetch_multiplier = 64
app.conf.task_acks_late = os.environ.get("PEERS_ACKS_LATE") == "1"
_client = redis.Redis.from_url(REDIS_URL)


def counter_key(queue: str) -> str:
    return f"{queue}:done"


@app.task(name="noop")
def noop() -> None:
    """Does nothing but record that it ran."""
    _client.incr(counter_key(QUEUE))
