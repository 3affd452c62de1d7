"""``DatabaseManager.with_retry``: which errors it retries, how often, and how long it waits."""

import socket
import time
from collections.abc import AsyncIterator
from itertools import pairwise
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError, OperationalError

from moorline.db.dsn import DatabaseUnreachable
from moorline.db.manager import RETRY_ATTEMPTS, DatabaseManager
from moorline.settings import Settings
from tests.helpers import wait_for
from tests.servers import PG_ADMIN_URL, require_server

RETRY_BASE_S = 0.05


def closed_port() -> int:
    """A local TCP port nobody listens on: bound once to pick it, then released."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def lost_connection() -> OperationalError:
    return OperationalError("SELECT 1", {}, ConnectionResetError("server closed the connection"))


@pytest.fixture
async def sqlite_db(tmp_path: Path) -> AsyncIterator[DatabaseManager]:
    """A manager for the retry policy itself, which does not depend on the backend."""
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'retry.db'}", db_retry_base=RETRY_BASE_S
    )
    manager = DatabaseManager(settings)
    try:
        yield manager
    finally:
        await manager.dispose()


@pytest.fixture
async def pg_db() -> AsyncIterator[DatabaseManager]:
    require_server("postgresql")
    manager = DatabaseManager(Settings(database_url=PG_ADMIN_URL, db_retry_base=RETRY_BASE_S))
    try:
        yield manager
    finally:
        await manager.dispose()


async def test_survives_a_terminated_backend(pg_db: DatabaseManager) -> None:
    attempts = 0
    pids: list[int] = []

    async def work() -> int:
        nonlocal attempts
        attempts += 1
        async with pg_db.connect() as conn:
            pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
            pids.append(pid)
            if attempts == 1:
                async with pg_db.connect() as killer:
                    # The timeout makes pg_terminate_backend wait until the backend is gone,
                    # so the next statement fails for certain rather than by race.
                    terminated = await killer.execute(
                        text("SELECT pg_terminate_backend(:pid, 5000)"), {"pid": pid}
                    )
                    assert terminated.scalar_one() is True
            value: int = (await conn.execute(text("SELECT 42"))).scalar_one()
            return value

    assert await pg_db.with_retry(work) == 42
    assert attempts == 2
    assert pids[0] != pids[1], "the retry must run on a fresh connection"


async def test_a_pooled_connection_the_server_closed_is_replaced_at_checkout(
    pg_db: DatabaseManager,
) -> None:
    """No round-trip pre-ping on PostgreSQL: the checkout itself drops a closed connection."""
    async with pg_db.connect() as conn:
        pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        raw = (await conn.get_raw_connection()).driver_connection
    assert raw is not None
    # Back in the pool; killed from another manager's connection, so not from this pool.
    killer = DatabaseManager(Settings(database_url=PG_ADMIN_URL))
    try:
        async with killer.connect() as other:
            terminated = await other.execute(
                text("SELECT pg_terminate_backend(:pid, 5000)"), {"pid": pid}
            )
            assert terminated.scalar_one() is True
    finally:
        await killer.dispose()

    async def noticed() -> bool:
        return bool(raw.is_closed())

    await wait_for(noticed, message="asyncpg seeing the server close the connection")
    # Not through with_retry: the checkout must hand out a live connection the first time.
    async with pg_db.connect() as conn:
        again = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
    assert again != pid


async def test_gives_up_after_three_retries_with_doubling_delays(
    sqlite_db: DatabaseManager,
) -> None:
    calls: list[float] = []

    async def always_lost() -> None:
        calls.append(time.monotonic())
        raise lost_connection()

    with pytest.raises(OperationalError):
        await sqlite_db.with_retry(always_lost)
    assert RETRY_ATTEMPTS == 3
    assert len(calls) == 4
    gaps = [later - earlier for earlier, later in pairwise(calls)]
    for retry, gap in enumerate(gaps):
        expected = RETRY_BASE_S * 2**retry
        # The loop clock may wake a hair early; an overloaded machine may wake late.
        assert expected * 0.9 <= gap < expected + 0.5, f"retry {retry + 1} waited {gap:.3f}s"
    assert gaps[0] < gaps[1] < gaps[2]


async def test_non_transient_errors_are_not_retried(sqlite_db: DatabaseManager) -> None:
    calls = 0

    async def duplicate() -> None:
        nonlocal calls
        calls += 1
        raise IntegrityError("INSERT", {}, ValueError("duplicate key"))

    with pytest.raises(IntegrityError):
        await sqlite_db.with_retry(duplicate)
    assert calls == 1


async def test_bugs_are_not_retried(sqlite_db: DatabaseManager) -> None:
    calls = 0

    async def buggy() -> None:
        nonlocal calls
        calls += 1
        raise KeyError("run_id")

    with pytest.raises(KeyError):
        await sqlite_db.with_retry(buggy)
    assert calls == 1


async def test_recovers_when_a_retry_succeeds(sqlite_db: DatabaseManager) -> None:
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise lost_connection()
        return "ok"

    assert await sqlite_db.with_retry(flaky) == "ok"
    assert calls == 3


async def test_no_address_answering_is_retried_then_raised() -> None:
    # Nothing listens on either port: every new connection fails in the failover creator.
    urls = [f"postgresql+asyncpg://postgres@127.0.0.1:{closed_port()}/test" for _ in range(2)]
    manager = DatabaseManager(Settings(database_urls=urls, db_retry_base=0.01))
    calls = 0

    async def query() -> None:
        nonlocal calls
        calls += 1
        async with manager.connect() as conn:
            await conn.execute(text("SELECT 1"))

    try:
        with pytest.raises(DatabaseUnreachable) as info:
            await manager.with_retry(query)
    finally:
        await manager.dispose()
    assert calls == RETRY_ATTEMPTS + 1
    assert len(info.value.failures) == 2
