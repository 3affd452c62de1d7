"""Runs the no-op workload through one peer; executed by the peers' own venv, not Moorline's.

    bench/peers/.venv/bin/python bench/peers/peer_driver.py celery|procrastinate RUNS

Prints one JSON object: ``{"enqueue": runs/s, "drain": runs/s}``. Enqueue: RUNS no-op tasks
submitted from this process, one call each (as an API process would, concurrently for the
async peer). Drain: one worker process started after the enqueue, from its start until the
last task has run (each task records its completion, so "ran" means ran, not fetched).
"""

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
REDIS_URL = os.environ.get("PEERS_REDIS_URL", "redis://127.0.0.1:6379/0")
PG_DSN = os.environ.get("PEERS_PG_DSN", "postgresql://postgres@127.0.0.1:5432/{db}")
DEADLINE_S = 600


def wait_until(done, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not done in {DEADLINE_S} s")
        time.sleep(0.005)


def run_celery(runs: int) -> dict[str, float]:
    import redis

    queue = f"peers-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, PEERS_QUEUE=queue, PEERS_REDIS_URL=REDIS_URL, PYTHONPATH=str(HERE))
    os.environ.update(env)
    from celery_app import counter_key, noop

    client = redis.Redis.from_url(REDIS_URL)
    try:
        started = time.perf_counter()
        for _ in range(runs):
            noop.apply_async(queue=queue)
        enqueue = runs / (time.perf_counter() - started)
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "celery_app",
                "worker",
                "--pool",
                "solo",
                "-Q",
                queue,
                "--without-heartbeat",
                "--without-mingle",
                "--without-gossip",
                "--loglevel",
                "WARNING",
            ],
            cwd=HERE,
            env=env,
        )
        try:
            started = time.perf_counter()
            wait_until(lambda: int(client.get(counter_key(queue)) or 0) >= runs, "celery drain")
            drain = runs / (time.perf_counter() - started)
        finally:
            worker.terminate()
            worker.wait(30)
        return {"enqueue": enqueue, "drain": drain}
    finally:
        client.delete(counter_key(queue), queue)
        client.close()


def run_procrastinate(runs: int) -> dict[str, float]:
    import psycopg

    name = f"peers_{uuid.uuid4().hex[:8]}"
    admin = PG_DSN.format(db="test")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    dsn = PG_DSN.format(db=name)
    env = dict(os.environ, PEERS_PG=dsn, PYTHONPATH=str(HERE))
    os.environ.update(env)
    try:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "procrastinate",
                "--app",
                "procrastinate_app.app",
                "schema",
                "--apply",
            ],
            cwd=HERE,
            env=env,
            check=True,
            capture_output=True,
        )
        from procrastinate_app import app, noop

        async def enqueue_all() -> float:
            async with app.open_async():
                started = time.perf_counter()
                remaining = runs

                async def producer() -> None:
                    nonlocal remaining
                    while remaining > 0:
                        remaining -= 1
                        await noop.defer_async()

                await asyncio.gather(*(producer() for _ in range(16)))
                return runs / (time.perf_counter() - started)

        enqueue = asyncio.run(enqueue_all())
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "procrastinate",
                "--app",
                "procrastinate_app.app",
                "worker",
                "--concurrency",
                "16",
            ],
            cwd=HERE,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:

                def finished() -> bool:
                    row = conn.execute(
                        "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
                    ).fetchone()
                    return row is not None and row[0] >= runs

                started = time.perf_counter()
                wait_until(finished, "procrastinate drain")
                drain = runs / (time.perf_counter() - started)
        finally:
            worker.terminate()
            worker.wait(30)
        return {"enqueue": enqueue, "drain": drain}
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


if __name__ == "__main__":
    peer, count = sys.argv[1], int(sys.argv[2])
    result = run_celery(count) if peer == "celery" else run_procrastinate(count)
    print(json.dumps(result))
