"""Runs the no-op workload through one peer; executed by the peers' own venv, not Moorline's.

    bench/peers/.venv/bin/python bench/peers/peer_driver.py PEER RUNS PRODUCERS WORKERS CONCURRENCY

PEER is ``celery``, ``celery-acks-late`` or ``procrastinate``. Prints one JSON object as its last
line: ``enqueue`` and ``drain`` in tasks/s, and how the drain was measured. Timing is
:mod:`timing`'s, the same as Moorline's driver: producers warmed up outside the clock; the drain
clock starts at the 10 % completion, once the worker processes run.

- Celery (Redis broker): ``PRODUCERS`` threads call ``apply_async`` (one ``LPUSH`` each);
  ``WORKERS`` ``celery worker --pool solo`` processes (one task at a time each: for no-op tasks
  the fastest pool, with no IPC to a child process; ``CONCURRENCY`` does not apply), prefetch 64.
  Each task increments a Redis counter, so done means it ran.
- Procrastinate (PostgreSQL): ``PRODUCERS`` coroutines call ``defer_async`` (one committed
  insert each); ``WORKERS`` ``procrastinate worker --concurrency CONCURRENCY`` processes. Done
  means the job's ``succeeded`` status is committed.
"""

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from timing import WARM_UP_PER_PRODUCER, measure_drain

HERE = Path(__file__).resolve().parent
REDIS_URL = os.environ.get("PEERS_REDIS_URL", "redis://127.0.0.1:6379/0")
PG_DSN = os.environ.get("PEERS_PG_DSN", "postgresql://postgres@127.0.0.1:5432/{db}")


def shares(count, producers):
    return [count // producers + (index < count % producers) for index in range(producers)]


def stop(procs):
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_celery(runs, producers, workers, acks_late):
    import redis

    queue = f"peers-{uuid.uuid4().hex[:8]}"
    env = dict(
        os.environ,
        PEERS_QUEUE=queue,
        PEERS_REDIS_URL=REDIS_URL,
        PEERS_ACKS_LATE="1" if acks_late else "",
        PYTHONPATH=str(HERE),
    )
    os.environ.update(env)
    from celery_app import counter_key, noop

    client = redis.Redis.from_url(REDIS_URL)

    def produce(share):
        for _ in range(share):
            noop.apply_async(queue=queue)

    try:
        with ThreadPoolExecutor(producers) as pool:
            list(pool.map(produce, [WARM_UP_PER_PRODUCER] * producers))
            started = time.perf_counter()
            list(pool.map(produce, shares(runs, producers)))
            enqueue = runs / (time.perf_counter() - started)
        command = [sys.executable, "-m", "celery", "-A", "celery_app", "worker", "--pool", "solo"]
        command += ["-Q", queue, "--without-heartbeat", "--without-mingle", "--without-gossip"]
        command += ["--loglevel", "WARNING"]
        started = time.perf_counter()
        procs = [subprocess.Popen(command, cwd=HERE, env=env) for _ in range(workers)]
        try:
            total = runs + WARM_UP_PER_PRODUCER * producers
            drain = measure_drain(total, lambda: int(client.get(counter_key(queue)) or 0), started)
        finally:
            stop(procs)
        return {"enqueue": enqueue, **drain.as_dict()}
    finally:
        # Kombu's routing set for the queue has no TTL: without this every round left one.
        client.delete(counter_key(queue), queue, f"_kombu.binding.{queue}")
        client.close()


def run_procrastinate(runs, producers, workers, concurrency):
    import psycopg

    name = f"peers_{uuid.uuid4().hex[:8]}"
    admin = PG_DSN.format(db="test")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    dsn = PG_DSN.format(db=name)
    env = dict(os.environ, PEERS_PG=dsn, PYTHONPATH=str(HERE))
    os.environ.update(env)
    try:
        command = [sys.executable, "-m", "procrastinate", "--app", "procrastinate_app.app"]
        subprocess.run(
            [*command, "schema", "--apply"], cwd=HERE, env=env, check=True, capture_output=True
        )
        from procrastinate_app import app, noop

        async def enqueue_all():
            async with app.open_async():

                async def produce(share):
                    for _ in range(share):
                        await noop.defer_async()

                await asyncio.gather(*(produce(WARM_UP_PER_PRODUCER) for _ in range(producers)))
                started = time.perf_counter()
                await asyncio.gather(*(produce(share) for share in shares(runs, producers)))
                return runs / (time.perf_counter() - started)

        enqueue = asyncio.run(enqueue_all())
        started = time.perf_counter()
        procs = [
            subprocess.Popen(
                [*command, "worker", "--concurrency", str(concurrency)],
                cwd=HERE,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for _ in range(workers)
        ]
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:

                def succeeded():
                    row = conn.execute(
                        "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
                    ).fetchone()
                    return row[0]

                drain = measure_drain(runs + WARM_UP_PER_PRODUCER * producers, succeeded, started)
        finally:
            stop(procs)
        return {"enqueue": enqueue, **drain.as_dict()}
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


if __name__ == "__main__":
    peer = sys.argv[1]
    count, producers, workers, concurrency = (int(arg) for arg in sys.argv[2:6])
    if peer == "procrastinate":
        result = run_procrastinate(count, producers, workers, concurrency)
    else:
        result = run_celery(count, producers, workers, acks_late=peer == "celery-acks-late")
    print(json.dumps(result))
