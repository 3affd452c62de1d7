"""``app.submit`` one run at a time (or ``app.submit_many``) from one producer, against another
tree (issue 19).

The public in-process path: the app of ``bench/peers/moorline_app.py`` on a fresh database, the
shipped ``professional`` plan with its quota and rate limit raised out of the way (its quota is
still taken, one unit per run), one coroutine awaiting ``app.submit`` after ``app.submit`` (with
``--bulk N``: ``app.submit_many`` of N runs after ``app.submit_many``; ``--keyed``: each run
with an idempotency key of its own, as a retry-safe enqueue sends them). A backend ``X+redis``
adds Redis (counters and wake-ups) under a fresh key prefix, deleted after. Prints runs/s and
this process's CPU per run. ``--baseline DIR`` measures the tree in
DIR (``git archive COMMIT | tar -x -C DIR``) the same way, each round running both trees in
turn, each in a process of its own.

    PYTHONPATH=. .venv/bin/python bench/app_submit.py [--runs 3000] [--rounds 2]
        [--backends postgresql,postgresql+redis] [--bulk N] [--keyed] [--baseline DIR]
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
WARM_UP = 50


async def measure(url: str, runs: int, bulk: int, keyed: bool) -> dict[str, float]:
    """Runs/s and CPU ms per run of ``runs`` submitted on ``url`` (``bulk`` a call, or one)."""
    from moorline_app import app  # its settings: the MOORLINE_* set by main

    from moorline.benchmarks.common import seed_tenant
    from moorline.db.manager import DatabaseManager
    from moorline.db.migrate import upgrade
    from moorline.engine.submitting import Submission
    from moorline.settings import Settings

    db = DatabaseManager(Settings(database_url=url))
    try:
        await upgrade(db)
        tenant = await seed_tenant(db, plan="professional")
    finally:
        await db.dispose()

    sent = 0

    def key() -> str | None:
        nonlocal sent
        sent += 1
        return f"run-{sent}" if keyed else None

    async def submit(count: int) -> None:
        if not bulk:
            for _ in range(count):
                await app.submit("noop", tenant=tenant, idempotency_key=key())
            return
        for first in range(0, count, bulk):
            size = min(bulk, count - first)
            items = [Submission(workflow="noop", idempotency_key=key()) for _ in range(size)]
            for result in await app.submit_many(items, tenant=tenant):
                if isinstance(result, Exception):
                    raise SystemExit(f"submit_many refused a run: {result!r}")

    async with app:
        await submit(WARM_UP)
        cpu, started = time.process_time(), time.perf_counter()
        await submit(runs)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {"rate": runs / wall, "cpu_ms": 1000 * cpu / runs}


def child(backend: str, runs: int, bulk: int, keyed: bool) -> None:
    """In a process of its own (its tree first on ``sys.path``): one measurement, as JSON."""
    from api import WITH_REDIS, redis_beside
    from moorline_driver import PLAN, plans_yaml

    from moorline.benchmarks.common import on_fresh_database
    from moorline.plans import DEFAULT_PLANS

    plan = replace(DEFAULT_PLANS[PLAN], daily_quota=100_000_000, rate_limit="1000000/second")
    with tempfile.TemporaryDirectory() as folder:
        plans = Path(folder) / "plans.yaml"
        plans.write_text(plans_yaml(plan))
        os.environ["MOORLINE_PLANS_FILE"] = str(plans)

        async def on(url: str) -> dict[str, float]:
            os.environ["MOORLINE_DATABASE_URL"] = url
            async with redis_beside(backend, "bench-submit") as redis:
                os.environ.update(redis)
                return await measure(url, runs, bulk, keyed)

        storage = backend.removesuffix(WITH_REDIS)
        print(json.dumps(asyncio.run(on_fresh_database(storage, on))))


def run_tree(source: Path, backend: str, runs: int, bulk: int, keyed: bool) -> dict[str, float]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("MOORLINE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(source), str(HERE / "peers"), str(HERE)])
    command = [sys.executable, str(Path(__file__)), "--child", backend, "--runs", str(runs)]
    command += ["--bulk", str(bulk), *(["--keyed"] if keyed else [])]
    done = subprocess.run(command, env=env, cwd=source, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{source}: {done.stderr[-2000:]}")
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backends", default="postgresql")
    parser.add_argument("--bulk", type=int, default=0, help="runs an app.submit_many call")
    parser.add_argument("--keyed", action="store_true", help="an idempotency key per run")
    parser.add_argument("--baseline", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.runs, args.bulk, args.keyed)
        return
    trees = [("this tree", HERE.parent)]
    if args.baseline:
        trees.append(("baseline", args.baseline.resolve()))
    for round_ in range(1, args.rounds + 1):
        for backend in args.backends.split(","):
            for label, source in trees:
                got = run_tree(source, backend, args.runs, args.bulk, args.keyed)
                print(
                    f"round {round_} {backend:<16} {label:<9} {got['rate']:7.0f} runs/s, "
                    f"CPU {got['cpu_ms']:.3f} ms per run",
                    flush=True,
                )


if __name__ == "__main__":
    main()
