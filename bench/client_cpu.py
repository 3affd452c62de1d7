"""Client CPU per trigger of ``moorline.Client`` (issue 19, item 3: at most 0.3 ms at 64 in flight).

Starts a real ``moorline serve --workers 0`` on a fresh SQLite file (as ``bench/api.py`` does),
creates a tenant whose plan never binds, then has one ``moorline.Client`` send
``POST /v1/workflows/echo/runs`` with ``C`` requests in flight until ``--triggers`` are
accepted. For each ``C`` it prints the median of ``--rounds`` rounds of:

- client CPU per trigger: this process's CPU time (``time.process_time``, all its threads)
  divided by the triggers: what the client costs, whatever the server does;
- triggers/s, wall clock: on a small machine the server shares the cores with the client, so
  this falls when either side spends more.

``--sync`` measures ``moorline.SyncClient`` too, one request at a time (a sync client has one
in flight per thread).

    PYTHONPATH=. .venv/bin/python bench/client_cpu.py [--triggers 3000] [--rounds 3]
        [--in-flight 1,64] [--sync] [--profile FILE]
"""

import argparse
import asyncio
import cProfile
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from api import ADMIN_TOKEN, PLANS_YAML, serving
from common import on_fresh_database

from moorline import Client, SyncClient
from moorline.types import JSONObject

BODY: JSONObject = {"message": "bench"}


async def async_round(client: Client, in_flight: int, triggers: int) -> tuple[float, float]:
    """(client CPU ms per trigger, triggers/s) of one round with ``in_flight`` loops."""
    remaining = triggers

    async def loop() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await client.trigger("echo", BODY)

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(in_flight)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return cpu * 1000 / triggers, triggers / wall


def sync_round(client: SyncClient, triggers: int) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(triggers):
        client.trigger("echo", BODY)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return cpu * 1000 / triggers, triggers / wall


def line(label: str, rounds: list[tuple[float, float]]) -> str:
    cpu = statistics.median(r[0] for r in rounds)
    rate = statistics.median(r[1] for r in rounds)
    spread = ", ".join(f"{r[0]:.3f}" for r in rounds)
    return f"{label:28} client CPU/trigger {cpu:6.3f} ms ({spread})  {rate:7.0f} triggers/s"


async def measure(url: str, args: argparse.Namespace) -> None:
    async with Client(url, admin_token=ADMIN_TOKEN) as admin:
        key = (await admin.create_tenant(f"bench-{uuid.uuid4().hex[:8]}", "bench")).api_key
    profiler = cProfile.Profile() if args.profile else None
    async with Client(url, key, timeout_s=60.0) as client:
        for in_flight in args.in_flight:
            await async_round(client, in_flight, args.warmup)
            if profiler is not None:
                profiler.enable()
            rounds = [
                await async_round(client, in_flight, args.triggers) for _ in range(args.rounds)
            ]
            if profiler is not None:
                profiler.disable()
            print(line(f"Client, {in_flight} in flight", rounds), flush=True)
    if args.sync:
        with SyncClient(url, key, timeout_s=60.0) as sync:
            sync_round(sync, args.warmup)
            rounds = [sync_round(sync, args.triggers) for _ in range(args.rounds)]
            print(line("SyncClient, 1 in flight", rounds), flush=True)
    if profiler is not None:
        profiler.dump_stats(args.profile)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--triggers", type=int, default=3000, help="Triggers per round.")
    parser.add_argument("--warmup", type=int, default=300, help="Unmeasured triggers first.")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--in-flight", type=lambda text: [int(n) for n in text.split(",")], default=[1, 64]
    )
    parser.add_argument("--sync", action="store_true", help="Measure SyncClient too.")
    parser.add_argument("--profile", type=Path, default=None, help="cProfile the client.")
    args = parser.parse_args()
    print(
        f"{args.triggers} triggers per round, median of {args.rounds} rounds (each round's CPU "
        f"in brackets); {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as folder:
        plans = Path(folder) / "plans.yaml"
        plans.write_text(PLANS_YAML, encoding="utf-8")

        async def on(url: str) -> None:
            settings = {
                "MOORLINE_DATABASE_URL": url,
                "MOORLINE_ADMIN_TOKEN": ADMIN_TOKEN,
                "MOORLINE_PLANS_FILE": str(plans),
                "MOORLINE_APP": "moorline.examples.app:app",
            }
            async with serving(settings, None) as server:
                await measure(server.url, args)

        await on_fresh_database("sqlite", on)


if __name__ == "__main__":
    asyncio.run(main())
