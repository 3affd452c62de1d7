"""Trigger → start latency with the API and the worker in separate processes (issue 19, item 5).

Starts ``moorline serve --workers 0`` and a separate ``moorline worker`` on one fresh database
(``sqlite``: a file, no Redis, the wake-ups are datagrams between the two processes;
``postgresql``: with Redis, under a fresh key prefix, or with ``--without-redis`` alone, woken
by LISTEN/NOTIFY), then triggers ``echo`` runs one at a time
through ``moorline.Client``, each after the previous one has started and a short random pause
(so every run finds the worker idle, waiting for a wake-up), and prints p50, p99 and max of

    started_at (the worker's claim, stamped by the database) minus the moment the client sent the
    trigger (this host's clock; the database runs on the same host),

and the same from the run's ``created_at`` (stamped at admission), which leaves out the trigger's
HTTP round trip.

SQLite stamps times to the millisecond, so its figures are ±1 ms. ``--poll`` sets the
worker's slow poll (``MOORLINE_POLL_INTERVAL``, default 1 s): a run that starts within far
less than it was woken. ``--embedded`` runs the worker loop inside ``moorline serve`` instead
(in-process wake-ups: the floor the separate processes are compared with). ``--source DIR``
runs the servers from another source tree (an export of an earlier commit, say:
``git archive COMMIT | tar -x -C DIR``) for a before/after figure.

    PYTHONPATH=. .venv/bin/python bench/latency.py [--runs 200] [--backends sqlite,postgresql]
        [--poll 1.0] [--embedded] [--source DIR] [--without-redis]
"""

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from api import ADMIN_TOKEN, PLANS_YAML, REDIS_URL, SOURCE_ROOT, delete_keys, serving, upgrade_with
from common import on_fresh_database, percentile

from moorline import Client
from moorline.types import JSONObject

WORKER_START_S = 60.0
PAUSE_S = (0.005, 0.03)
"""Random pause between a run's start and the next trigger."""
FIRST_READ_S = 0.03
"""Wait before each read of the run: a read while the worker claims would compete with it for
the CPU (the API answers it beside the worker), and the figure is the database's stamp anyway."""


def _log_text(log: Path) -> str:
    return log.read_text(errors="replace")


async def start_worker(
    settings: dict[str, str], source: Path, log: Path, args: Sequence[str] = ()
) -> "asyncio.subprocess.Process":
    """A ``moorline worker [args]`` process, once it logs that it serves its lanes."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("MOORLINE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(source), env.get("PYTHONPATH")]))
    env.update(settings)
    with log.open("wb") as sink:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "moorline", "worker", "--grace", "1", *args,
            env=env, cwd=source, stdout=sink, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + WORKER_START_S
    while " serving " not in _log_text(log):
        if process.returncode is not None or time.monotonic() > deadline:
            raise SystemExit(f"moorline worker did not start:\n{_log_text(log)}")
        await asyncio.sleep(0.05)
    return process


async def stop(process: "asyncio.subprocess.Process") -> None:
    process.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), timeout=30)
    except TimeoutError:
        process.kill()
        await process.wait()


async def measure(
    url: str,
    runs: int,
    *,
    workflow: str = "echo",
    input: JSONObject | None = None,
    plan: str = "bench",
) -> list[tuple[float, float]]:
    """(trigger → start, created → start) of ``runs`` runs of ``workflow`` (by default
    ``echo``), one at a time, in milliseconds, for a new tenant on ``plan``."""
    payload: JSONObject | None = input
    if payload is None and workflow == "echo":
        payload = {"message": "latency"}
    async with Client(url, admin_token=ADMIN_TOKEN) as admin:
        key = (await admin.create_tenant(f"bench-{uuid.uuid4().hex[:8]}", plan)).api_key
    latencies: list[tuple[float, float]] = []
    async with Client(url, key, timeout_s=60.0) as client:
        for index in range(runs + 10):  # the first 10 warm up
            sent_at = time.time()
            run = await client.trigger(workflow, payload)
            deadline = time.monotonic() + 30
            while True:
                await asyncio.sleep(FIRST_READ_S)
                read = await client.get_run(run.run_id)
                started: datetime | None = read.started_at
                if started is not None:
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"run {run.run_id} did not start within 30 s")
            if index >= 10:
                started_s = started.timestamp()
                created_s = read.created_at.timestamp()
                latencies.append(((started_s - sent_at) * 1000, (started_s - created_s) * 1000))
            await asyncio.sleep(random.uniform(*PAUSE_S))
    return latencies


async def run_backend(
    backend: str, args: argparse.Namespace, root: Path
) -> list[tuple[float, float]]:
    async def on(url: str) -> list[tuple[float, float]]:
        settings = {
            "MOORLINE_DATABASE_URL": url,
            "MOORLINE_ADMIN_TOKEN": ADMIN_TOKEN,
            "MOORLINE_PLANS_FILE": str(root / "plans.yaml"),
            "MOORLINE_APP": "moorline.examples.app:app",
            "MOORLINE_POLL_INTERVAL": str(args.poll),
            # The bench reads each run until it has started: not to be refused for it.
            "MOORLINE_REQUEST_RATE_LIMIT": "1000000/second",
        }
        prefix = f"bench_{uuid.uuid4().hex[:10]}"
        if backend == "postgresql":
            await upgrade_with(args.source, url)
            if not args.without_redis:
                settings |= {"MOORLINE_REDIS_URL": REDIS_URL, "MOORLINE_REDIS_PREFIX": prefix}
        try:
            loops = 1 if args.embedded else 0
            async with serving(settings, None, source=args.source, workers=loops) as server:
                if args.embedded:
                    return await measure(server.url, args.runs)
                worker = await start_worker(settings, args.source, root / f"{backend}.log")
                try:
                    return await measure(server.url, args.runs)
                finally:
                    await stop(worker)
        finally:
            if backend == "postgresql":
                await delete_keys(prefix)

    return await on_fresh_database(backend, on)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument(
        "--backends", type=lambda text: text.split(","), default=["sqlite", "postgresql"]
    )
    parser.add_argument("--poll", type=float, default=1.0, help="The worker's slow poll, s.")
    parser.add_argument(
        "--embedded",
        action="store_true",
        help="One process: moorline serve with a worker loop (the in-process wake-up's floor).",
    )
    parser.add_argument("--source", type=Path, default=SOURCE_ROOT, help="Source tree to run.")
    parser.add_argument(
        "--without-redis",
        action="store_true",
        help="PostgreSQL alone: its LISTEN/NOTIFY wakes the worker.",
    )
    args = parser.parse_args()
    args.source = args.source.resolve()
    print(
        f"{args.runs} runs one at a time, poll {args.poll} s, source {args.source}; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "plans.yaml").write_text(PLANS_YAML, encoding="utf-8")
        for backend in args.backends:
            measured = await run_backend(backend, args, root)
            label = backend if backend == "sqlite" or args.without_redis else f"{backend}+redis"
            columns = zip(*measured, strict=True)
            for name, ms in zip(("trigger → start", "created → start"), columns, strict=True):
                print(
                    f"{label:18} {name}  p50 {percentile(list(ms), 0.5):7.1f} ms  "
                    f"p99 {percentile(list(ms), 0.99):7.1f} ms  max {max(ms):7.1f} ms  "
                    f"mean {statistics.mean(ms):7.1f} ms",
                    flush=True,
                )


if __name__ == "__main__":
    asyncio.run(main())
