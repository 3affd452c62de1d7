"""Client CPU per run of ``RunsRepo.submit_many`` batches, in-process, per batch size.

One process writes ``--batches`` batches of ``N`` runs one after another (``N`` from
``--sizes``), as the Submitter does under load, and prints the process's CPU time per run and
per batch (``time.process_time``: this process only, not the database server's) and the wall
time per batch. What it measures is what the API process pays to store a batch: building the
statement's parameters, SQLAlchemy's compile cache and bind processing, the driver, the result.

``--baseline DIR`` measures another source tree (a ``git worktree`` of the commit to compare
against) the same way: each round runs this script once per tree in a subprocess (the tree
first on ``PYTHONPATH``), the trees alternating, and the table shows the median of the rounds
for both and the ratio of this tree to the baseline.

    .venv/bin/python bench/submit_cpu.py [--backend postgresql] [--sizes 1,2,4,8]
        [--batches 400] [--rounds 5] [--baseline DIR]
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import on_fresh_database, seed_tenant

from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.settings import Settings

HERE = Path(__file__).resolve().parent


async def measure(url: str, sizes: list[int], batches: int) -> dict[str, list[float]]:
    """``{size: [cpu µs per run, cpu µs per batch, wall µs per batch]}`` on database ``url``."""
    db = DatabaseManager(Settings(database_url=url))
    await upgrade(db)
    await db.initialize()
    repo = RunsRepo(db)
    results: dict[str, list[float]] = {}
    try:
        tenant = await seed_tenant(db)
        serial = 0

        def batch(size: int) -> list[NewRun]:
            nonlocal serial
            serial += size
            return [
                NewRun(
                    tenant_id=tenant,
                    workflow="echo",
                    input={"message": "hello", "n": serial + index},
                    lane="workflow",
                    priority=50,
                )
                for index in range(size)
            ]

        for size in sizes:
            for _ in range(max(20, batches // 10)):  # warm-up: caches, prepared statements
                await repo.submit_many(batch(size))
            work = [batch(size) for _ in range(batches)]
            cpu, wall = time.process_time(), time.perf_counter()
            for new in work:
                await repo.submit_many(new)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            results[str(size)] = [
                cpu / (batches * size) * 1e6,
                cpu / batches * 1e6,
                wall / batches * 1e6,
            ]
    finally:
        await db.dispose()
    return results


def run_child(tree: Path | None, args: argparse.Namespace) -> dict[str, list[float]]:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = f"{tree}{os.pathsep}{env.get('PYTHONPATH', '')}"
    command = [
        sys.executable,
        str(HERE / "submit_cpu.py"),
        "--child",
        f"--backend={args.backend}",
        f"--sizes={args.sizes}",
        f"--batches={args.batches}",
    ]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    result: dict[str, list[float]] = json.loads(out.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="postgresql")
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    if args.child:
        work = lambda url: measure(url, sizes, args.batches)  # noqa: E731
        print(json.dumps(asyncio.run(on_fresh_database(args.backend, work))))
        return
    trees: dict[str, Path | None] = {"this": HERE.parent}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    rounds: dict[str, list[dict[str, list[float]]]] = {name: [] for name in trees}
    for index in range(args.rounds):
        # Alternate which tree goes first, so neither always meets the same machine state.
        order = list(trees.items()) if index % 2 == 0 else list(reversed(trees.items()))
        for name, tree in order:
            rounds[name].append(run_child(tree, args))
    print(f"{args.backend}: client CPU per stored run, median of {args.rounds} rounds")
    print(f"{'batch':>5} {'tree':>9} {'cpu µs/run':>11} {'cpu µs/batch':>13} {'wall µs/batch':>14}")
    medians: dict[str, dict[int, list[float]]] = {}
    for size in sizes:
        for name in trees:
            figures = [statistics.median(r[str(size)][i] for r in rounds[name]) for i in range(3)]
            medians.setdefault(name, {})[size] = figures
            print(
                f"{size:>5} {name:>9} {figures[0]:>11.1f} {figures[1]:>13.1f} {figures[2]:>14.1f}"
            )
        if "baseline" in medians:
            this, base = medians["this"][size], medians["baseline"][size]
            ratios = [t / b for t, b in zip(this, base, strict=True)]
            print(
                f"{size:>5} {'ratio':>9} {ratios[0]:>11.2f} {ratios[1]:>13.2f} {ratios[2]:>14.2f}"
            )


if __name__ == "__main__":
    main()
