"""An API app over a database of the test module, driven through ``httpx.ASGITransport``.

Every test gets a fresh app (its own admission state, rate-limit memory, submitter), with a
plans file whose rates are high enough never to bind, except the ``trickle`` and ``burst``
plans', which tests of the limits use. The sandbox plan's rate is per minute, so that its
rate-limit keys in Redis (which expire one window after the last hit) are still there when a
test looks for them.
``make_api`` builds more apps, with Redis for instance. Tests keep
apart by creating their own tenants.

The database is SQLite (a file per module): the routes' SQL lives in repositories whose
contract tests run on every backend. A module whose API tests must run on every backend
overrides ``api_database_url`` with the ``database_url`` fixture.
"""

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import func, select, update

from moorline.api.app import create_app
from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.db.repos.records import Fence
from moorline.db.schema import runs
from moorline.settings import Settings
from moorline.types import Attempt, RunId, RunStatus
from tests.api import workflows

ADMIN_TOKEN = "admin-token-for-tests"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

PLANS_YAML = """
plans:
  sandbox:
    lane: workflow_sandbox
    priority: 10
    daily_quota: 50
    rate_limit: "6000000/minute"
    tenant_concurrency: 2
    lane_slots: 2
  team:
    lane: workflow_team
    priority: 50
    daily_quota: 500
    rate_limit: "100000/second"
    tenant_concurrency: 4
    lane_slots: 4
  trickle:
    lane: workflow_trickle
    priority: 1
    daily_quota: 2
    rate_limit: "3/minute"
    tenant_concurrency: 1
    lane_slots: 1
  burst:
    lane: workflow_burst
    priority: 1
    daily_quota: 100
    rate_limit: "3/minute"
    tenant_concurrency: 1
    lane_slots: 1
"""


@dataclass
class Caller:
    """A tenant created through the admin API, with its key."""

    tenant_id: str
    api_key: str
    plan: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


@dataclass
class Api:
    app: FastAPI
    client: httpx.AsyncClient
    settings: Settings
    db: DatabaseManager
    callers: list[Caller] = field(default_factory=list)

    async def tenant(self, plan: str = "team") -> Caller:
        response = await self.client.post(
            "/v1/admin/tenants",
            json={"name": f"tenant-{uuid.uuid4().hex[:12]}", "plan": plan},
            headers=ADMIN,
        )
        assert response.status_code == 201, response.text
        body = response.json()
        caller = Caller(tenant_id=body["tenant_id"], api_key=body["api_key"], plan=plan)
        self.callers.append(caller)
        return caller

    async def trigger(self, caller: Caller, workflow: str = "echo", **body: Any) -> httpx.Response:
        body.setdefault("input", {})
        return await self.client.post(
            f"/v1/workflows/{workflow}/runs", json=body, headers=caller.headers
        )

    async def count_runs(self, caller: Caller, status: RunStatus | None = None) -> int:
        stmt = select(func.count()).where(runs.c.tenant_id == caller.tenant_id)
        if status is not None:
            stmt = stmt.where(runs.c.status == status.value)
        async with self.db.connect() as conn:
            count: int = (await conn.execute(stmt)).scalar_one()
        return count

    async def start(self, run_id: str) -> Fence:
        """Put a queued run into ``running`` as a worker's claim would, and return its fence."""
        fence = Fence(run_id=RunId(run_id), attempt=Attempt(1), owner="test-worker")
        now = datetime.now(UTC)
        async with self.db.transaction() as conn:
            result = await conn.execute(
                update(runs)
                .where(runs.c.id == run_id, runs.c.status == RunStatus.QUEUED.value)
                .values(
                    status=RunStatus.RUNNING.value,
                    attempt=1,
                    lease_owner=fence.owner,
                    lease_expires_at=now + timedelta(minutes=5),
                    started_at=now,
                    updated_at=now,
                )
            )
        assert result.rowcount == 1
        return fence


MakeApi = Callable[..., AbstractAsyncContextManager[Api]]


@pytest.fixture(scope="module")
def api_database_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("api") / "moorline.db"
    return f"sqlite+aiosqlite:///{path}"


@pytest.fixture(scope="module")
def upgraded() -> set[str]:
    """The database URLs whose schema this module has brought up to date."""
    return set()


@pytest.fixture
def make_api(api_database_url: str, upgraded: set[str], tmp_path: Path) -> MakeApi:
    """Build an app over the module's API database."""
    plans = tmp_path / "plans.yaml"
    plans.write_text(PLANS_YAML, encoding="utf-8")

    @asynccontextmanager
    async def build(**overrides: Any) -> AsyncIterator[Api]:
        values: dict[str, Any] = {
            "database_url": api_database_url,
            "db_retry_base": 0.01,
            "admin_token": ADMIN_TOKEN,
            "plans_file": plans,
            **overrides,
        }
        settings = Settings(**values)
        manager = DatabaseManager(settings)
        if api_database_url not in upgraded:
            await upgrade(manager)
            upgraded.add(api_database_url)
        await manager.initialize()
        app = create_app(settings, manager, workflows=workflows.app)
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://moorline.test") as client,
        ):
            yield Api(app=app, client=client, settings=settings, db=manager)

    return build


@pytest.fixture
async def api(make_api: MakeApi) -> AsyncIterator[Api]:
    async with make_api() as built:
        yield built
