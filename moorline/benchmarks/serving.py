"""An in-process ``moorline serve`` for benchmarks that go through the public path.

:func:`serving` builds what ``moorline serve --workers 1`` builds (the API application over a
fresh database, its RuntimeStore and wake-ups, and one worker process's loops: a
:class:`~moorline.worker.worker.Worker`, the reaper and the timer sweep, all at default
settings) and hands back a :class:`~moorline.client.Client` of a new tenant. The client reaches
the API through httpx's ASGI transport: every request runs the real routes (authentication,
validation, the repositories, the store's wake-up, the lane notification) in this process, as
a request to ``moorline serve`` does, without the socket and uvicorn's HTTP parsing.
"""

import asyncio
import tempfile
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from moorline.api.app import create_app
from moorline.api.deps import Services
from moorline.client import Client
from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.engine.registry import Moorline
from moorline.runtime.redis_client import RedisConnector
from moorline.settings import Settings
from moorline.worker.process import run_worker_process

REDIS_URL = "redis://127.0.0.1:6379/0"
ADMIN_TOKEN = "bench-admin-token"
LANE = "workflow_bench"
PLAN = "bench"
LANE_SLOTS = 64
PLANS_YAML = f"""
plans:
  {PLAN}:
    lane: {LANE}
    priority: 50
    daily_quota: 100000000
    rate_limit: "1000000/second"
    tenant_concurrency: 100000
    lane_slots: {LANE_SLOTS}
"""
"""A plan that never binds: the figures measure waits, not admission."""

STOP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Served:
    """A running in-process server: a tenant's client, and the database behind it."""

    client: Client
    db: DatabaseManager
    settings: Settings


@asynccontextmanager
async def serving(url: str, store: str, workflows: Moorline) -> AsyncIterator[Served]:
    """API, worker, reaper and timer sweep over the database at ``url``, default settings.

    Args:
        url: An empty database; its schema is created here.
        store: ``memory`` or ``redis`` (keys under a fresh prefix, deleted afterwards).
        workflows: The app whose workflows the server triggers and the worker runs.
    """
    prefix = f"bench_susp_{uuid.uuid4().hex[:10]}"
    with tempfile.TemporaryDirectory() as folder:
        plans_file = Path(folder) / "plans.yaml"
        plans_file.write_text(PLANS_YAML, encoding="utf-8")
        settings = Settings(
            database_url=url,
            redis_url=REDIS_URL if store == "redis" else None,
            redis_prefix=prefix,
            admin_token=ADMIN_TOKEN,
            plans_file=plans_file,
        )
        try:
            async with _server(settings, workflows) as served:
                yield served
        finally:
            if store == "redis":
                await delete_keys(prefix)


@asynccontextmanager
async def _server(settings: Settings, workflows: Moorline) -> AsyncIterator[Served]:
    db = DatabaseManager(settings)
    await upgrade(db)
    await db.initialize()
    api = create_app(settings, db, workflows=workflows)  # disposes db when its lifespan ends
    services: Services = api.state.services
    transport = httpx.ASGITransport(app=api)
    async with api.router.lifespan_context(api):
        # As ``moorline serve`` does in its lifespan (moorline.cli.serve).
        await services.waiter.start()
        stop = asyncio.Event()
        workers = asyncio.create_task(
            run_worker_process(
                settings,
                workflows,
                db,
                lanes={LANE: LANE_SLOTS},
                stop=stop,
                notifier=services.notifier,
                waiter=services.waiter,
                store=services.store,
                metrics=services.metrics,
                grace_s=1.0,
            ),
            name="bench-workers",
        )
        try:
            async with Client(
                "http://bench", admin_token=ADMIN_TOKEN, transport=transport
            ) as admin:
                tenant = await admin.create_tenant(f"bench-{uuid.uuid4().hex[:8]}", PLAN)
            async with Client("http://bench", tenant.api_key, transport=transport) as client:
                yield Served(client=client, db=db, settings=settings)
        finally:
            stop.set()
            async with asyncio.timeout(STOP_TIMEOUT_S):
                await workers


async def delete_keys(prefix: str) -> None:
    """Every Redis key of this server (they all start with its prefix)."""
    redis = RedisConnector(REDIS_URL).client()
    try:
        keys = [key async for key in redis.scan_iter(match=f"{prefix}:*", count=1000)]
        for start in range(0, len(keys), 1000):
            await redis.delete(*keys[start : start + 1000])
    finally:
        await redis.aclose()
