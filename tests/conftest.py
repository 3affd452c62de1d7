"""Backend fixtures: every contract test runs on SQLite, PostgreSQL and MariaDB.

The contract suite (``tests/contract``) runs on a fourth backend too, ``pgbouncer``: PostgreSQL
through a private PgBouncer in transaction mode (:mod:`tests.pgbouncer`), one per test process.

A test module gets a fresh database of its own on each backend; tests inside a module share it
and keep apart by creating their own tenants. The schema is built once per module, when its
first test asks for ``db`` (as each test's own ``upgrade`` used to: every later one was a no-op
that cost 0.1-0.3 s of Alembic and reflection, over 500 tests). Capabilities
(``@pytest.mark.requires(...)``) decide which backends a test runs on, never the backend's name.

PostgreSQL test databases commit asynchronously (``synchronous_commit = off``): no test of a
module database crashes the server, and nothing else about a commit changes (the failover
drill and the soak, which stop or kill servers, make databases of their own).
"""

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from moorline.db.backends import PgBouncerBackend, backend_for
from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.settings import DatabasePooler, Settings
from tests.pgbouncer import PrivateBouncer, direct_url, require_pgbouncer
from tests.redis_topologies import (  # noqa: F401 - fixtures, found by name in every package
    cluster_redis,
    sentinel_redis,
)
from tests.servers import MYSQL_ADMIN_URL, PG_ADMIN_URL, require_server, run_sql, unique_name

BACKENDS = ["sqlite", "postgresql", "mysql"]

# The same Capabilities the code branches on: one vocabulary for code and tests.
CAPABILITIES: dict[str, frozenset[str]] = {
    **{name: backend_for(name).capabilities.names() for name in ("sqlite", "postgresql", "mysql")},
    "pgbouncer": PgBouncerBackend.capabilities.names(),
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


@pytest.fixture(scope="session")
def pgbouncer() -> Iterator[PrivateBouncer]:
    """This test process's PgBouncer (transaction mode), started when first asked for."""
    require_server("postgresql")
    bouncer = PrivateBouncer(require_pgbouncer())
    bouncer.start()
    try:
        yield bouncer
    finally:
        bouncer.stop()


@pytest.fixture(scope="module")
def database_url(
    backend: str, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[str]:
    """A fresh, empty database on ``backend`` for this test module."""
    if backend == "sqlite":
        path: Path = tmp_path_factory.mktemp("sqlite") / "moorline.db"
        yield f"sqlite+aiosqlite:///{path}"
        return
    server = "postgresql" if backend == "pgbouncer" else backend
    require_server(server)
    name = unique_name()
    run_sql(server, f"CREATE DATABASE {name}")
    if server == "postgresql":
        run_sql(server, f"ALTER DATABASE {name} SET synchronous_commit = off")
    admin = PG_ADMIN_URL if server == "postgresql" else MYSQL_ADMIN_URL
    try:
        if backend == "pgbouncer":
            bouncer: PrivateBouncer = request.getfixturevalue("pgbouncer")
            yield bouncer.url(name)
        else:
            yield make_url(admin).set(database=name).render_as_string(hide_password=False)
    finally:
        drop = (
            f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"
            if server == "postgresql"
            else f"DROP DATABASE IF EXISTS {name}"
        )
        run_sql(server, drop)


@pytest.fixture(scope="module")
def schema_built() -> set[str]:
    """The database URLs whose schema this module has built (migrated to head)."""
    return set()


@pytest.fixture
def settings(backend: str, database_url: str) -> Settings:
    if backend == "pgbouncer":
        # As deployed behind PgBouncer: LISTEN on a direct connection to the same database.
        listen_url = direct_url(make_url(database_url).database or "")
        return Settings(
            database_url=database_url,
            db_retry_base=0.01,
            database_pooler=DatabasePooler.PGBOUNCER,
            listen_url=listen_url,
        )
    return Settings(database_url=database_url, db_retry_base=0.01)


@pytest.fixture
async def db(settings: Settings, schema_built: set[str]) -> AsyncIterator[DatabaseManager]:
    """A DatabaseManager over this module's database, schema in place."""
    manager = DatabaseManager(settings)
    if settings.database_url not in schema_built:
        await upgrade(manager)
        schema_built.add(settings.database_url)
    try:
        yield manager
    finally:
        await manager.dispose()


# Modules that take minutes go first. Under `--dist loadfile` a module runs whole in one
# process, in the order collected: one of them started last would be the suite's tail, run
# alone while the other processes idle.
SLOW_FIRST = (
    "tests/model/test_run_state_machine.py",
    "tests/soak/",
    "tests/engine/test_children_property.py",
    "tests/runtime/test_redis_store.py",
    "tests/faults/",
    "tests/integration/test_peers_bench.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        for index, prefix in enumerate(SLOW_FIRST):
            if item.nodeid.startswith(prefix):
                return index
        return len(SLOW_FIRST)

    items.sort(key=rank)  # stable: the order within a rank stays pytest's
