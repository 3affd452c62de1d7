"""Runs the peer workloads through Moorline's public surfaces only (issue 19, item 6).

    PYTHONPATH=. .venv/bin/python bench/peers/moorline_driver.py STORAGE CONFIG_JSON

``STORAGE`` is ``sqlite`` (a file, no Redis: the API and the worker wake each other with
datagrams), ``postgresql`` or ``postgresql+redis``. ``CONFIG_JSON`` is :mod:`run`'s shape. Prints
one JSON object of figures as its last line. Nothing here calls an internal path: every run is
submitted by ``app.submit`` / ``app.submit_many`` (the app of ``moorline_app``, its settings from
``MOORLINE_*``), or by ``moorline.Client`` against a real ``moorline serve --workers 0``; every
run is executed by a ``moorline worker`` process started from the CLI. The database is read
directly only to count the runs that ``succeeded`` (as each peer's driver reads its own table).

- ``enqueue``: ``app.submit`` one run at a time; ``enqueue_http``: ``Client.trigger`` one at a
  time; ``bulk``: ``app.submit_many``, ``batch`` runs a call; ``bulk_http``:
  ``Client.trigger_many``, ``batch`` items a request;
- ``drain``: one ``moorline worker`` at its defaults (no ``--lanes``: the plans' slots) runs
  every run queued above; ``drain_wide``: ``--lanes LANE=WIDE`` on ``bulk`` more runs, the plan's
  tenant cap raised to match (else the cap, not the slots, would bind); ``drain_step``: the
  default worker on ``step_runs`` runs of ``one_step`` (one checkpointed step each);
- ``latency_p50`` / ``latency_p99``: trigger → start through ``moorline.Client``
  (``bench/latency.py``'s measure: the run's ``started_at``, stamped by the database at the
  claim, minus the moment before the trigger was sent), serve and worker in separate processes.

The tenant's plan is the shipped ``professional`` plan (its tenant cap and lane slots as they
ship) with its daily quota and rate limit raised out of the way.
"""

import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # bench/ (api, latency) and this folder

from api import ADMIN_TOKEN, REDIS_URL, SOURCE_ROOT, delete_keys, serving, upgrade_with  # noqa: E402
from latency import measure as measure_latency  # noqa: E402
from latency import start_worker, stop  # noqa: E402
from sqlalchemy import func, select  # noqa: E402
from timing import WARM_UP, DrainClock, latency_figures, rate  # noqa: E402

from moorline import Client, Moorline, Settings, Submission  # noqa: E402
from moorline.benchmarks.common import on_fresh_database  # noqa: E402
from moorline.db.manager import DatabaseManager  # noqa: E402
from moorline.db.schema import runs  # noqa: E402
from moorline.plans import DEFAULT_PLANS, Plan, default_lane_slots, for_edition  # noqa: E402

PLAN = "professional"


def plans_yaml(plan: Plan) -> str:
    return (
        f"plans:\n  {plan.name}:\n    lane: {plan.lane}\n    priority: {plan.priority}\n"
        f"    daily_quota: {plan.daily_quota}\n    rate_limit: {plan.rate_limit!r}\n"
        f"    tenant_concurrency: {plan.tenant_concurrency}\n    lane_slots: {plan.lane_slots}\n"
    )


class Deployment:
    """One fresh database with its settings, plans files and worker logs."""

    def __init__(self, url: str, storage: str, folder: Path, wide: int) -> None:
        self.url = url
        self.folder = folder
        shipped = DEFAULT_PLANS[PLAN]
        self.plan = replace(shipped, daily_quota=100_000_000, rate_limit="1000000/second")
        edition_plans = for_edition({**DEFAULT_PLANS, PLAN: self.plan}, Settings().edition)
        self.lane = edition_plans[PLAN].lane
        self.default_slots = default_lane_slots(edition_plans)[self.lane]
        (folder / "plans.yaml").write_text(plans_yaml(self.plan))
        wide_plan = replace(self.plan, tenant_concurrency=wide, lane_slots=wide)
        (folder / "plans-wide.yaml").write_text(plans_yaml(wide_plan))
        self.wide = wide
        self.prefix = f"peers_{uuid.uuid4().hex[:10]}"
        self.redis = storage.endswith("+redis")
        self.env = {
            "MOORLINE_DATABASE_URL": url,
            "MOORLINE_ADMIN_TOKEN": ADMIN_TOKEN,
            "MOORLINE_PLANS_FILE": str(folder / "plans.yaml"),
            "MOORLINE_APP": "moorline_app:app",
            # latency.measure reads each run until it has started: not to be refused for it.
            "MOORLINE_REQUEST_RATE_LIMIT": "1000000/second",
        }
        if self.redis:
            self.env |= {"MOORLINE_REDIS_URL": REDIS_URL, "MOORLINE_REDIS_PREFIX": self.prefix}
        self.workers = 0

    async def worker(self, *args: str, plans: str = "plans.yaml") -> Any:
        self.workers += 1
        env = self.env | {"MOORLINE_PLANS_FILE": str(self.folder / plans)}
        return await start_worker(env, SOURCE_ROOT, self.folder / f"w{self.workers}.log", args)


async def succeeded(db: DatabaseManager) -> int:
    async with db.connect() as conn:
        return int(
            await conn.scalar(
                select(func.count()).select_from(runs).where(runs.c.status == "succeeded")
            )
            or 0
        )


async def drain(deploy: Deployment, db: DatabaseManager, total: int, *args: str, **kw: str) -> Any:
    """Start one worker, count its completions of ``total`` new runs, stop it."""
    before = await succeeded(db)
    started = time.perf_counter()
    worker = await deploy.worker(*args, **kw)
    clock = DrainClock(total, started, before)
    try:
        # Polling is the measurement: the same 20 ms poll as every peer's drain.
        while (measured := clock.see(await succeeded(db))) is None:  # noqa: ASYNC110
            await asyncio.sleep(clock.poll_s)
        return measured
    finally:
        await stop(worker)


async def over_http(deploy: Deployment, config: dict[str, Any]) -> tuple[dict[str, float], str]:
    """``Client.trigger`` and ``trigger_many`` against ``moorline serve``; the tenant's id."""
    figures: dict[str, float] = {}
    count, bulk, batch = config["runs"], config["bulk_runs"], config["batch"]
    async with serving(deploy.env, None) as server:
        async with Client(server.url, admin_token=ADMIN_TOKEN) as admin:
            tenant = await admin.create_tenant(f"peers-{uuid.uuid4().hex[:8]}", PLAN)
        async with Client(server.url, tenant.api_key, timeout_s=120.0) as client:
            for _ in range(WARM_UP):
                await client.trigger("noop")
            started = time.perf_counter()
            for _ in range(count):
                await client.trigger("noop")
            figures["enqueue_http"] = rate(count, started)
            await client.trigger_many("noop", [{}] * WARM_UP)
            started = time.perf_counter()
            for first in range(0, bulk, batch):
                answers = await client.trigger_many("noop", [{}] * min(batch, bulk - first))
                if any(answer.error is not None for answer in answers):
                    raise SystemExit(f"trigger_many refused runs: {answers}")
            figures["bulk_http"] = rate(bulk, started)
    return figures, tenant.tenant_id


async def submit_many(app: Moorline, tenant: str, workflow: str, count: int, batch: int) -> None:
    for first in range(0, count, batch):
        items = [Submission(workflow=workflow) for _ in range(min(batch, count - first))]
        results = await app.submit_many(items, tenant=tenant)
        refused = [result for result in results if isinstance(result, Exception)]
        if refused:
            raise SystemExit(f"submit_many refused {len(refused)} runs: {refused[0]!r}")


async def in_process(app: Moorline, tenant: str, config: dict[str, Any]) -> dict[str, float]:
    """``app.submit`` one at a time and ``app.submit_many``."""
    count, bulk, batch = config["runs"], config["bulk_runs"], config["batch"]
    for _ in range(WARM_UP):
        await app.submit("noop", tenant=tenant)
    started = time.perf_counter()
    for _ in range(count):
        await app.submit("noop", tenant=tenant)
    figures = {"enqueue": rate(count, started)}
    await submit_many(app, tenant, "noop", WARM_UP, batch)
    started = time.perf_counter()
    await submit_many(app, tenant, "noop", bulk, batch)
    figures["bulk"] = rate(bulk, started)
    return figures


async def workload(url: str, storage: str, config: dict[str, Any]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as folder:
        deploy = Deployment(url, storage, Path(folder), config["wide_slots"])
        os.environ.update(deploy.env)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(SOURCE_ROOT), str(HERE)])
        from moorline_app import app  # its settings: the MOORLINE_* just set

        figures: dict[str, float] = {
            "slots": deploy.default_slots,
            "tenant_cap": deploy.plan.tenant_concurrency,
        }
        db = DatabaseManager(Settings(database_url=url))
        try:
            await upgrade_with(SOURCE_ROOT, url)
            http, tenant = await over_http(deploy, config)
            figures |= http
            async with app:
                figures |= await in_process(app, tenant, config)
            queued = 2 * (config["runs"] + config["bulk_runs"] + 2 * WARM_UP)
            figures |= (await drain(deploy, db, queued)).as_dict("drain")
            bulk, batch = config["bulk_runs"], config["batch"]
            async with app:
                await submit_many(app, tenant, "noop", bulk, batch)
            lanes = f"{deploy.lane}={deploy.wide}"
            wide = await drain(deploy, db, bulk, "--lanes", lanes, plans="plans-wide.yaml")
            figures |= wide.as_dict("drain_wide")
            async with app:
                await submit_many(app, tenant, "one_step", config["step_runs"], batch)
            figures |= (await drain(deploy, db, config["step_runs"])).as_dict("drain_step")
            if config["latency_runs"]:
                async with serving(deploy.env, None) as server:
                    worker = await deploy.worker()
                    try:
                        measured = await measure_latency(
                            server.url, config["latency_runs"], workflow="noop", plan=PLAN
                        )
                    finally:
                        await stop(worker)
                figures |= latency_figures([trigger for trigger, _ in measured])
        finally:
            await db.dispose()
            if deploy.redis:
                await delete_keys(deploy.prefix)
        return figures


def main() -> None:
    storage, config = sys.argv[1], json.loads(sys.argv[2])

    async def on(url: str) -> dict[str, float]:
        return await workload(url, storage, config)

    figures = asyncio.run(on_fresh_database(storage.removesuffix("+redis"), on))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
