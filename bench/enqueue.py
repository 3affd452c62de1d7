"""Enqueue rate through the group-commit Submitter, per backend, against run-by-run writes.

``--producers`` concurrent coroutines (one process, as an API process under load) each submit
runs one after another until ``--runs`` are stored. Each round measures three ways on the same
database: through one shared ``Submitter`` (concurrent submissions coalesced into one
``submit_many`` transaction per batch), through ``RunsRepo.submit_many([run])`` per run (one
transaction each) from the same concurrent producers, and the latter from one producer (the
plain commit rate). Prints the median of ``--rounds`` rounds with min and max, the mean batch,
and the ratio of the Submitter to the better of the two run-by-run figures.

    .venv/bin/python bench/enqueue.py [--runs 20000] [--producers 64] [--rounds 3]
        [--backends sqlite,postgresql,mysql]
"""

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

from common import on_fresh_database, seed_tenant, summary

from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.db.repos.records import Run
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.dispatch.submit import Submitter
from moorline.settings import Settings
from moorline.types import TenantId


async def produce(
    submit: Callable[[NewRun], Awaitable[Run]], tenant: TenantId, runs: int, producers: int
) -> float:
    """Runs stored per second by ``producers`` concurrent loops sharing ``runs`` submissions."""
    remaining = runs

    async def producer() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await submit(
                NewRun(tenant_id=tenant, workflow="bench", input={"n": remaining}, lane="workflow")
            )

    started = time.perf_counter()
    await asyncio.gather(*(producer() for _ in range(producers)))
    return runs / (time.perf_counter() - started)


Measured = tuple[list[float], list[float], list[float], list[float]]


async def measure(url: str, runs: int, producers: int, rounds: int) -> Measured:
    db = DatabaseManager(Settings(database_url=url))
    await upgrade(db)
    await db.initialize()
    repo = RunsRepo(db)
    grouped: list[float] = []
    single: list[float] = []
    sequential: list[float] = []
    batch_sizes: list[float] = []

    async def one_by_one(new: NewRun) -> Run:
        [run] = await repo.submit_many([new])
        return run

    try:
        tenant = await seed_tenant(db)
        for _ in range(rounds):
            submitter = Submitter(repo)
            try:
                grouped.append(await produce(submitter.submit, tenant, runs, producers))
            finally:
                await submitter.close()
            batch_sizes.append(submitter.runs_written / max(1, submitter.batches_written))
            # Run by run is slower by an order of magnitude; a tenth of the runs is plenty.
            single.append(await produce(one_by_one, tenant, max(producers, runs // 10), producers))
            sequential.append(await produce(one_by_one, tenant, max(100, runs // 10), 1))
        return grouped, single, sequential, batch_sizes
    finally:
        await db.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20_000)
    parser.add_argument("--producers", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default="sqlite,postgresql,mysql")
    args = parser.parse_args()
    print(
        f"enqueue, {args.producers} concurrent producers, {args.runs} runs per round, "
        f"median of {args.rounds}"
    )
    for backend in args.backends.split(","):
        grouped, single, sequential, batches = asyncio.run(
            on_fresh_database(
                backend, lambda url: measure(url, args.runs, args.producers, args.rounds)
            )
        )
        best_single = max(statistics.median(single), statistics.median(sequential))
        ratio = statistics.median(grouped) / best_single
        print(
            f"{backend:10} Submitter {summary(grouped)} mean batch {statistics.mean(batches):.1f}\n"
            f"{'':10} run by run, {args.producers} producers {summary(single)}\n"
            f"{'':10} run by run, 1 producer {summary(sequential)}\n"
            f"{'':10} Submitter / best run by run: {ratio:.1f}x"
        )


if __name__ == "__main__":
    main()
