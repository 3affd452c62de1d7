"""Backend fixtures: every contract test runs on SQLite, PostgreSQL and MariaDB.

A test module gets a fresh database of its own on each backend; tests inside a module share it
and keep apart by creating their own tenants. Capabilities (``@pytest.mark.requires(...)``)
decide which backends a test runs on, never the backend's name.
"""

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.settings import Settings
from tests.servers import MYSQL_ADMIN_URL, PG_ADMIN_URL, require_server, run_sql, unique_name

BACKENDS = ["sqlite", "postgresql", "mysql"]

CAPABILITIES: dict[str, frozenset[str]] = {
    "sqlite": frozenset({"embedded"}),
    "postgresql": frozenset({"server", "skip_locked", "listen_notify", "terminate_backend"}),
    "mysql": frozenset({"server", "skip_locked"}),
}


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(autouse=True)
def _check_capabilities(request: pytest.FixtureRequest) -> None:
    if "backend" not in request.fixturenames:
        return
    name = request.getfixturevalue("backend")
    for marker in request.node.iter_markers("requires"):
        missing = set(marker.args) - CAPABILITIES[name]
        if missing:
            pytest.skip(f"{name} lacks {', '.join(sorted(missing))}")


@pytest.fixture(scope="module")
def database_url(backend: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A fresh, empty database on ``backend`` for this test module."""
    if backend == "sqlite":
        path: Path = tmp_path_factory.mktemp("sqlite") / "moorline.db"
        yield f"sqlite+aiosqlite:///{path}"
        return
    require_server(backend)
    name = unique_name()
    run_sql(backend, f"CREATE DATABASE {name}")
    admin = PG_ADMIN_URL if backend == "postgresql" else MYSQL_ADMIN_URL
    try:
        yield make_url(admin).set(database=name).render_as_string(hide_password=False)
    finally:
        drop = (
            f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"
            if backend == "postgresql"
            else f"DROP DATABASE IF EXISTS {name}"
        )
        run_sql(backend, drop)


@pytest.fixture
def settings(database_url: str) -> Settings:
    return Settings(database_url=database_url, db_retry_base=0.01)


@pytest.fixture
async def db(settings: Settings) -> AsyncIterator[DatabaseManager]:
    """A DatabaseManager over this module's database, schema in place."""
    manager = DatabaseManager(settings)
    await upgrade(manager)
    await manager.initialize()
    try:
        yield manager
    finally:
        await manager.dispose()
