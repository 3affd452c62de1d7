"""The database fast paths and their public fallbacks give the same results.

``fast_paths=False`` (``MOORLINE_FAST_PATHS``) makes the SQLite and MariaDB drivers plain
``aiosqlite`` and ``aiomysql`` connections. The same transactions, write statements, errors
and reads run on both, and must leave the same rows.
"""

from collections.abc import AsyncIterator
from typing import Any, TypeVar

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from moorline.db import mysql_driver, sqlite_driver
from moorline.db.manager import DatabaseManager
from moorline.settings import Settings

T = TypeVar("T")
HOSTILE = "it's \\'; DROP TABLE probe; -- \" ` \u00bf' */ ;"
FAST_CLASSES: dict[str, type[Any]] = {
    "sqlite": sqlite_driver.Connection,
    "mysql": mysql_driver.Connection,
}


@pytest.fixture(scope="module", params=["sqlite", "mysql"])
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(params=[True, False], ids=["fast", "public"])
def fast(request: pytest.FixtureRequest) -> bool:
    chosen: bool = request.param
    return chosen


@pytest.fixture
async def probe_db(database_url: str, fast: bool) -> AsyncIterator[DatabaseManager]:
    # The public aiomysql connection has no is_closed(): with fast_paths=False the pool's
    # liveness check is SQLAlchemy's pre-ping.
    settings = Settings(database_url=database_url, db_retry_base=0.01, fast_paths=fast)
    manager = DatabaseManager(settings)
    try:
        async with manager.transaction() as conn:
            await conn.execute(
                text("CREATE TABLE IF NOT EXISTS probe (k INTEGER PRIMARY KEY, v VARCHAR(200))")
            )
        async with manager.transaction() as conn:
            await conn.execute(text("DELETE FROM probe"))
        yield manager
    finally:
        await manager.dispose()


async def rows(db: DatabaseManager) -> list[tuple[int, str]]:
    async with db.connect() as conn:
        found = await conn.execute(text("SELECT k, v FROM probe ORDER BY k"))
        return [(int(k), str(v)) for k, v in found]


async def run_scenario(db: DatabaseManager) -> list[Any]:
    """Transactions, write statements and their errors; what each returned and left."""
    insert = text("INSERT INTO probe (k, v) VALUES (:k, :v)")
    seen: list[Any] = []
    async with db.write_transaction() as conn:
        await conn.execute(insert, [{"k": k, "v": f"row {k}"} for k in range(1, 12)])
        await db.commit_with_next_statement(conn)
        changed = await conn.execute(text("UPDATE probe SET v = :v WHERE k < 3"), {"v": HOSTILE})
        seen.append(changed.rowcount)
    seen.append(await rows(db))
    with pytest.raises(IntegrityError):
        async with db.write_transaction() as conn:
            await conn.execute(insert, {"k": 20, "v": "rolled back"})
            await db.commit_with_next_statement(conn)
            await conn.execute(insert, {"k": 1, "v": "duplicate"})
    with pytest.raises(RuntimeError):
        async with db.transaction() as conn:
            await conn.execute(insert, {"k": 21, "v": "rolled back"})
            raise RuntimeError("the caller fails")
    seen.append(await db.write_statement(text("DELETE FROM probe WHERE k > :k"), {"k": 9}))
    with pytest.raises(IntegrityError):
        await db.write_statement(insert, {"k": 2, "v": "duplicate"})
    seen.append(await rows(db))
    return seen


async def test_the_fast_and_the_public_drivers_leave_the_same_rows(
    backend: str, probe_db: DatabaseManager, fast: bool
) -> None:
    async with probe_db.connect() as conn:
        driver = (await conn.get_raw_connection()).driver_connection
    assert isinstance(driver, FAST_CLASSES[backend]) is fast
    seen = await run_scenario(probe_db)
    expected_rows = [(1, HOSTILE), (2, HOSTILE)] + [(k, f"row {k}") for k in range(3, 10)]
    assert seen == [2, [*expected_rows, (10, "row 10"), (11, "row 11")], 2, expected_rows]
