"""Shared pieces of the benchmarks: a throwaway database per backend, a tenant, summaries."""

import statistics
import subprocess
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from sqlalchemy import insert
from sqlalchemy.engine import make_url

from moorline.db.manager import DatabaseManager
from moorline.db.schema import tenants
from moorline.db.types import utcnow
from moorline.types import TenantId

T = TypeVar("T")

BACKENDS = ("sqlite", "postgresql", "mysql")
ADMIN = {
    "postgresql": "postgresql+asyncpg://postgres@127.0.0.1:5432/test",
    "mysql": "mysql+aiomysql://root@127.0.0.1:3306/test",
}


def admin_sql(backend: str, sql: str) -> None:
    """Run one administrative statement through the server's command-line client."""
    if backend == "postgresql":
        cmd = ["psql", "-h", "127.0.0.1", "-U", "postgres", "-d", "test", "-qc", sql]
    else:
        cmd = ["mysql", "-uroot", "-h", "127.0.0.1", "-e", sql]
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)


async def on_fresh_database(backend: str, work: Callable[[str], Awaitable[T]]) -> T:
    """Run ``work(url)`` on a new, empty database of ``backend``, dropped afterwards."""
    if backend == "sqlite":
        with tempfile.TemporaryDirectory() as folder:
            return await work(f"sqlite+aiosqlite:///{folder}/bench.db")
    name = f"moorline_bench_{uuid.uuid4().hex[:10]}"
    admin_sql(backend, f"CREATE DATABASE {name}")
    try:
        url = make_url(ADMIN[backend]).set(database=name).render_as_string(hide_password=False)
        return await work(url)
    finally:
        force = " WITH (FORCE)" if backend == "postgresql" else ""
        admin_sql(backend, f"DROP DATABASE IF EXISTS {name}{force}")


async def seed_tenant(db: DatabaseManager, plan: str = "bench") -> TenantId:
    """A new tenant on ``plan``, written directly (no admission in the way)."""
    tenant_id = TenantId(str(uuid.uuid4()))
    now = utcnow()
    async with db.transaction() as conn:
        await conn.execute(
            insert(tenants).values(
                id=tenant_id, name=f"bench-{tenant_id}", plan=plan, created_at=now, updated_at=now
            )
        )
    return tenant_id


async def analyze(db: DatabaseManager) -> None:
    """Refresh the planner's statistics after a bulk load.

    A production database has them: autovacuum (PostgreSQL) and InnoDB's persistent statistics
    refresh within about a minute of a large change. A table filled seconds ago has none yet,
    and plans made without them are not what a running system gets.
    """
    statement = db.backend.analyze_statement(("runs", "events", "tenants"))
    async with db.engine.connect() as conn:
        await conn.exec_driver_sql(statement)
        await conn.commit()


def summary(values: list[float], unit: str = "/s") -> str:
    """``median (min, max)`` of several rounds."""
    return f"{statistics.median(values):8.1f}{unit} (min {min(values):.1f}, max {max(values):.1f})"


def percentile(values: list[float], share: float) -> float:
    """The ``share`` quantile (0..1) of ``values``, nearest-rank."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(share * len(ordered)) - 1))
    return ordered[index]
