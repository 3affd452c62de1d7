"""``/healthz`` and ``/readyz`` through the ASGI app, on every backend.

Readiness means the database accepts *writes*: each backend also gets a database this process
can read but not write (PostgreSQL ``default_transaction_read_only``, a MariaDB account with
SELECT only, a SQLite file opened read-only), where ``SELECT 1`` passes and ``/readyz`` must not.
"""

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import text
from sqlalchemy.engine import make_url

from moorline.api.app import create_app
from moorline.db.dsn import DatabaseUnreachable
from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.db.repos.tenants import TenantsRepo
from moorline.settings import Settings
from tests.servers import PG_ADMIN_URL, REDIS_TEST_URL, require_server, run_sql, unique_name


@asynccontextmanager
async def client_for(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://moorline.test") as client:
        yield client


@asynccontextmanager
async def sqlite_read_only(database_url: str) -> AsyncIterator[str]:
    path = make_url(database_url).database
    yield f"sqlite+aiosqlite:///file:{path}?mode=ro&uri=true"


@asynccontextmanager
async def postgresql_read_only(database_url: str) -> AsyncIterator[str]:
    # A database of its own: the setting applies to every new session in the database, and the
    # module's database must stay writable for the other tests.
    name = unique_name("moorline_ro")
    run_sql("postgresql", f"CREATE DATABASE {name}")
    url = make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    try:
        writer = DatabaseManager(Settings(database_url=url))
        try:
            await upgrade(writer)  # tables exist, so only read-only mode can fail the probe
        finally:
            await writer.dispose()
        run_sql("postgresql", f"ALTER DATABASE {name} SET default_transaction_read_only = on")
        yield url
    finally:
        run_sql("postgresql", f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@asynccontextmanager
async def mysql_read_only(database_url: str) -> AsyncIterator[str]:
    # MariaDB has no per-database read-only switch and `SET GLOBAL read_only` would hit every
    # other test (and spares root anyway); an account that may only SELECT is this process's
    # view of a database it cannot write.
    parsed = make_url(database_url)
    user = unique_name("ro")
    run_sql("mysql", f"CREATE USER '{user}'@'%'")
    try:
        run_sql("mysql", f"GRANT SELECT ON {parsed.database}.* TO '{user}'@'%'")
        yield parsed.set(username=user, password=None).render_as_string(hide_password=False)
    finally:
        run_sql("mysql", f"DROP USER IF EXISTS '{user}'@'%'")


@dataclass(frozen=True)
class ReadOnly:
    open: Callable[[str], AbstractAsyncContextManager[str]]
    reason: str  # what the driver says when the write probe is refused


READ_ONLY = {
    "sqlite": ReadOnly(open=sqlite_read_only, reason="readonly database"),
    "postgresql": ReadOnly(open=postgresql_read_only, reason="read-only (a standby"),
    "mysql": ReadOnly(open=mysql_read_only, reason="UPDATE command denied"),
}


@pytest.fixture
async def read_only_db(
    backend: str, database_url: str, db: DatabaseManager
) -> AsyncIterator[DatabaseManager]:
    """A DatabaseManager over a database with the schema in place that refuses writes."""
    async with READ_ONLY[backend].open(database_url) as url:
        manager = DatabaseManager(Settings(database_url=url, db_retry_base=0.01))
        try:
            yield manager
        finally:
            await manager.dispose()


async def test_healthz_is_ok(settings: Settings, db: DatabaseManager) -> None:
    async with client_for(create_app(settings, db)) as client:
        response = await client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


async def test_readyz_is_ready_when_the_database_takes_writes(
    settings: Settings, db: DatabaseManager
) -> None:
    async with client_for(create_app(settings, db)) as client:
        response = await client.get("/readyz")
    assert response.status_code == 200
    assert response.json() == {"status": "ready", "checks": {"database": "ok"}}


async def test_readyz_is_503_when_the_database_only_reads(
    backend: str, settings: Settings, read_only_db: DatabaseManager
) -> None:
    if backend == "postgresql":
        # A node in read-only mode is refused at connect (the failover creator skips it, as it
        # would a standby), so /readyz reports it down with that reason.
        with pytest.raises(DatabaseUnreachable, match="read-only"):
            async with read_only_db.connect():
                pass
    else:
        # Reads work, so a SELECT 1 probe would call this database ready.
        async with read_only_db.connect() as conn:
            assert (await conn.execute(text("SELECT 1"))).scalar_one() == 1

    async with client_for(create_app(settings, read_only_db)) as client:
        ready = await client.get("/readyz")
        health = await client.get("/healthz")

    assert ready.status_code == 503
    error = ready.json()["error"]
    assert error["code"] == "not_ready"
    assert error["checks"] == {"database": "down"}
    assert error["message"].startswith("database is down: ")
    assert READ_ONLY[backend].reason in error["message"]
    assert health.status_code == 200  # the process itself is fine: no restart


async def test_readyz_is_503_when_no_database_answers() -> None:
    # Port 1 refuses at once: the probe reports the outage instead of hanging or raising.
    settings = Settings(database_url="postgresql+asyncpg://moorline@127.0.0.1:1/none")
    db = DatabaseManager(settings)
    try:
        async with client_for(create_app(settings, db)) as client:
            response = await client.get("/readyz")
    finally:
        await db.dispose()
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["message"].startswith("database is down: no database address answered")
    assert error["checks"] == {"database": "down"}


async def test_readyz_checks_redis_when_the_process_uses_it(
    settings: Settings, db: DatabaseManager
) -> None:
    require_server("redis")
    update = {"redis_url": REDIS_TEST_URL, "redis_prefix": unique_name("ready")}
    app = create_app(settings.model_copy(update=update), db)
    async with app.router.lifespan_context(app), client_for(app) as client:
        response = await client.get("/readyz")
    assert response.status_code == 200
    assert response.json() == {"status": "ready", "checks": {"database": "ok", "redis": "ok"}}


async def test_readyz_is_503_when_redis_is_down(settings: Settings, db: DatabaseManager) -> None:
    # Nothing listens on port 1: every trigger of this process would answer 503, so must /readyz.
    app = create_app(settings.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"}), db)
    async with app.router.lifespan_context(app), client_for(app) as client:
        ready = await client.get("/readyz")
    assert ready.status_code == 503
    error = ready.json()["error"]
    assert error["checks"] == {"database": "ok", "redis": "down"}
    assert error["message"].startswith("redis is down: ")


async def test_a_database_that_refuses_writes_answers_503_at_once(
    backend: str,
    settings: Settings,
    db: DatabaseManager,
    read_only_db: DatabaseManager,
    caplog: pytest.LogCaptureFixture,
) -> None:
    if backend == "postgresql":
        pytest.skip("a read-only PostgreSQL node is refused at connect (failover), as tested above")
    _, key = await TenantsRepo(db).create(unique_name("ro"), "team")
    app = create_app(settings, read_only_db)
    with caplog.at_level(logging.WARNING):
        async with client_for(app) as client:
            answer = await client.post(
                "/v1/workflows/echo/runs",
                json={"input": {"message": "hi"}},
                headers={"Authorization": f"Bearer {key}"},
            )
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["code"] == "backend_unavailable"
    assert "refuses the work" in error["message"]
    # Refused for good: answered without a retry (each would have been logged).
    assert not [r for r in caplog.records if "retry" in r.getMessage()]
