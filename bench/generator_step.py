"""Items a second through a generator step, as deltas, on one backend (issue 15 item 9).

One run, one step over a generator of ``--items`` short strings: each item crosses the thread
bridge (a sync generator) or comes from the loop (an async one), is buffered as a ``delta``
event and written in batches; the step returns the items joined. Through the real runner on a
claimed run, the in-memory store:

    .venv/bin/python bench/generator_step.py sqlite [--items 20000]

Prints items per second for a sync and for an async generator, the deltas' writes included.
"""

import argparse
import asyncio
import time
from collections.abc import AsyncIterator, Iterator

from moorline.benchmarks.common import on_fresh_database, seed_tenant
from moorline.benchmarks.engine import CAPS, LANE, app, with_manager, with_store
from moorline.db.manager import DatabaseManager
from moorline.db.repos.queue import QueueRepo
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.engine.context import Context
from moorline.engine.runner import WorkflowRunner
from moorline.runtime.base import RuntimeStore
from moorline.settings import Settings
from moorline.types import JSONValue


def sync_chunks(count: int) -> Iterator[str]:
    for _ in range(count):
        yield "tok "


async def async_chunks(count: int) -> AsyncIterator[str]:
    for _ in range(count):
        yield "tok "


@app.workflow("generator_steps")
async def generator_steps(ctx: Context, count: int) -> JSONValue:
    """One sync and one async generator step of ``count`` items; their items per second."""
    rates: dict[str, JSONValue] = {}
    for name, fn in (("sync", sync_chunks), ("async", async_chunks)):
        started = time.perf_counter()
        joined = await ctx.step(name, fn, count)
        assert joined == "tok " * count
        rates[name] = count / (time.perf_counter() - started)
    return rates


async def measure(url: str, items: int) -> JSONValue:
    """The figures of one run on the empty database at ``url``."""

    async def work(db: DatabaseManager) -> JSONValue:
        async def run(store: RuntimeStore) -> JSONValue:
            runner = WorkflowRunner(app, db=db, store=store, settings=Settings())
            tenant = await seed_tenant(db)
            new = NewRun(
                tenant_id=tenant, workflow="generator_steps", input={"count": items}, lane=LANE
            )
            await RunsRepo(db).submit_many([new])
            [claim] = await QueueRepo(db).claim_batch(
                LANE, "bench", limit=1, lease_ttl_s=600.0, tenant_caps=CAPS
            )
            return await runner.run(claim)

        return await with_store("memory", run)

    return await with_manager(url, work)


def main() -> None:
    """Parse the options, measure, print."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("backend", help="sqlite, postgresql or mysql")
    parser.add_argument("--items", type=int, default=20000)
    args = parser.parse_args()
    found = asyncio.run(on_fresh_database(args.backend, lambda url: measure(url, args.items)))
    assert isinstance(found, dict)
    for name, rate in found.items():
        assert isinstance(rate, float)
        print(f"{args.backend}: {name} generator step, {rate:,.0f} items/s ({args.items} items)")


if __name__ == "__main__":
    main()
