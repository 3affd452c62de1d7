"""Enqueue rate through the public API (issue 19): ``app.submit``, ``submit_many``, HTTP batch.

Every figure here comes from what a user can call, with admission in the way (rate limit, input
validation, quota, group commit), on a tenant whose plan never binds:

- ``app.submit`` one at a time: one producer awaiting each run before the next (as a web
  handler enqueues), through an app that opened its own connections (``Moorline.submit``);
- ``submit_many``: the same app, ``--batch`` runs a call, one call at a time;
- HTTP batch: ``moorline.Client.trigger_many`` against a real ``moorline serve --workers 0``,
  ``--batch`` items a request (at most 1,000), one request at a time.

Each is measured ``--rounds`` times on a fresh database per backend; the line shows the median
runs/s with min and max. ``postgresql`` runs without Redis, ``postgresql+redis`` with it (the
counters and wake-ups in Redis, under a fresh key prefix, deleted afterwards).

    .venv/bin/python bench/submit.py [--runs 2000] [--bulk-runs 20000] [--batch 1000]
        [--rounds 3] [--backends sqlite,postgresql,postgresql+redis]
"""

import argparse
import asyncio
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from api import (
    ADMIN_TOKEN,
    PLANS_YAML,
    REDIS_URL,
    SOURCE_ROOT,
    delete_keys,
    serving,
    upgrade_with,
)
from common import on_fresh_database, seed_tenant, summary

from moorline import Client, Context, Moorline, Settings, Submission
from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.types import JSONObject


def build_app(settings: Settings) -> Moorline:
    """The example app's ``echo``, as the server below serves it."""
    app = Moorline(settings)

    @app.workflow("echo")
    async def echo(ctx: Context, message: str = "") -> JSONObject:
        return {"message": message}

    return app


async def timed(runs: int, work: Callable[[], Awaitable[None]]) -> float:
    started = time.perf_counter()
    await work()
    return runs / (time.perf_counter() - started)


async def one_at_a_time(app: Moorline, tenant: str, runs: int) -> float:
    async def work() -> None:
        for n in range(runs):
            await app.submit("echo", {"message": f"m{n}"}, tenant=tenant)

    return await timed(runs, work)


async def in_batches(app: Moorline, tenant: str, runs: int, batch: int) -> float:
    async def work() -> None:
        for start in range(0, runs, batch):
            items = [
                Submission(workflow="echo", input={"message": f"m{n}"})
                for n in range(start, min(runs, start + batch))
            ]
            results = await app.submit_many(items, tenant=tenant)
            refused = [r for r in results if isinstance(r, Exception)]
            if refused:
                raise SystemExit(f"submit_many refused {len(refused)} runs: {refused[0]!r}")

    return await timed(runs, work)


async def over_http(client: Client, runs: int, batch: int) -> float:
    async def work() -> None:
        for start in range(0, runs, batch):
            items = [
                {"input": {"message": f"m{n}"}} for n in range(start, min(runs, start + batch))
            ]
            answers = await client.trigger_many("echo", items)
            refused = [a for a in answers if a.error is not None]
            if refused:
                raise SystemExit(f"the batch refused {len(refused)} runs: {refused[0].error}")

    return await timed(runs, work)


async def measure(
    url: str, backend: str, args: argparse.Namespace, plans: Path
) -> dict[str, list[float]]:
    figures: dict[str, list[float]] = {"app.submit": [], "submit_many": [], "HTTP batch": []}
    settings = Settings(database_url=url, plans_file=plans)
    env = {
        "MOORLINE_DATABASE_URL": url,
        "MOORLINE_ADMIN_TOKEN": ADMIN_TOKEN,
        "MOORLINE_PLANS_FILE": str(plans),
        "MOORLINE_APP": "moorline.examples.app:app",
    }
    prefix = f"bench_{uuid.uuid4().hex[:10]}"
    if backend.endswith("+redis"):
        settings = settings.model_copy(update={"redis_url": REDIS_URL, "redis_prefix": prefix})
        env |= {"MOORLINE_REDIS_URL": REDIS_URL, "MOORLINE_REDIS_PREFIX": prefix}
    db = DatabaseManager(Settings(database_url=url))
    try:
        if backend.startswith("postgresql"):
            await upgrade_with(SOURCE_ROOT, url)
        else:
            await upgrade(db)
        tenant = await seed_tenant(db)
        app = build_app(settings)
        async with app:
            await one_at_a_time(app, tenant, 100)  # warm-up: connections, caches
            for _ in range(args.rounds):
                figures["app.submit"].append(await one_at_a_time(app, tenant, args.runs))
                figures["submit_many"].append(
                    await in_batches(app, tenant, args.bulk_runs, args.batch)
                )
        async with serving(env, None) as server:
            async with Client(server.url, admin_token=ADMIN_TOKEN) as admin:
                key = (await admin.create_tenant(f"bench-{uuid.uuid4().hex[:8]}", "bench")).api_key
            async with Client(server.url, key, timeout_s=120.0) as client:
                await over_http(client, 1_000, args.batch)  # warm-up
                for _ in range(args.rounds):
                    figures["HTTP batch"].append(
                        await over_http(client, args.bulk_runs, args.batch)
                    )
        return figures
    finally:
        await db.dispose()
        if backend.endswith("+redis"):
            await delete_keys(prefix)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2_000, help="runs of app.submit a round")
    parser.add_argument("--bulk-runs", type=int, default=20_000, help="runs of the bulk paths")
    parser.add_argument("--batch", type=int, default=1_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default="sqlite,postgresql,postgresql+redis")
    args = parser.parse_args()
    if not 1 <= args.batch <= 1_000:
        parser.error("--batch: 1 to 1000 (the HTTP batch's limit)")
    print(
        f"enqueue through the public API, one producer, median of {args.rounds} rounds "
        f"(app.submit: {args.runs} runs one at a time; bulk: {args.bulk_runs} runs, "
        f"{args.batch} a call)"
    )
    with tempfile.TemporaryDirectory() as folder:
        plans = Path(folder) / "plans.yaml"
        plans.write_text(PLANS_YAML, encoding="utf-8")
        for backend in args.backends.split(","):

            async def on(url: str, backend: str = backend) -> dict[str, list[float]]:
                return await measure(url, backend, args, plans)

            figures = asyncio.run(on_fresh_database(backend.removesuffix("+redis"), on))
            for label, rates in figures.items():
                print(f"{backend:17} {label:12} {summary(rates)} runs/s")


if __name__ == "__main__":
    main()
