"""The SQLite engine: its PRAGMAs on every connection, ``:memory:``, and IMMEDIATE writes."""

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.pool import StaticPool

from moorline.db import sqlite_driver
from moorline.db.manager import DatabaseManager
from moorline.settings import Settings

EXPECTED_PRAGMAS = {
    "journal_mode": "wal",
    "synchronous": 1,  # NORMAL
    "cache_size": -64000,
    "foreign_keys": 1,
    "busy_timeout": 5000,
}


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "moorline.db"


@pytest.fixture
async def sqlite_db(db_path: Path) -> AsyncIterator[DatabaseManager]:
    manager = DatabaseManager(Settings(database_url=f"sqlite+aiosqlite:///{db_path}"))
    try:
        async with manager.transaction() as conn:
            await conn.execute(text("CREATE TABLE counter (id INTEGER PRIMARY KEY, n INTEGER)"))
            await conn.execute(text("INSERT INTO counter (id, n) VALUES (1, 0)"))
        yield manager
    finally:
        await manager.dispose()


def raw_connection(db_path: Path) -> sqlite3.Connection:
    """A second, independent writer that gives up at once instead of waiting for the lock."""
    conn = sqlite3.connect(db_path, timeout=0, isolation_level=None)
    conn.execute("PRAGMA busy_timeout=0")
    return conn


async def read_pragmas(conn: AsyncConnection) -> dict[str, object]:
    values: dict[str, object] = {}
    for name in EXPECTED_PRAGMAS:
        values[name] = (await conn.execute(text(f"PRAGMA {name}"))).scalar_one()
    return values


async def test_every_pooled_connection_has_the_pragmas(sqlite_db: DatabaseManager) -> None:
    async with sqlite_db.connect() as first, sqlite_db.connect() as second:
        first_raw = await first.get_raw_connection()
        second_raw = await second.get_raw_connection()
        # Two connections checked out at once are two distinct sqlite3 connections.
        assert first_raw.driver_connection is not second_raw.driver_connection
        assert await read_pragmas(first) == EXPECTED_PRAGMAS
        assert await read_pragmas(second) == EXPECTED_PRAGMAS


async def test_memory_database_lives_on_one_static_connection() -> None:
    manager = DatabaseManager(Settings(database_url="sqlite+aiosqlite:///:memory:"))
    try:
        assert isinstance(manager.engine.pool, StaticPool)
        async with manager.transaction() as conn:
            await conn.execute(text("CREATE TABLE probe (v INTEGER)"))
            await conn.execute(text("INSERT INTO probe (v) VALUES (7)"))
        async with manager.connect() as conn:
            assert (await conn.execute(text("SELECT v FROM probe"))).scalar_one() == 7
            assert (await conn.execute(text("PRAGMA foreign_keys"))).scalar_one() == 1
    finally:
        await manager.dispose()


async def test_transaction_takes_the_write_lock_before_any_write(
    sqlite_db: DatabaseManager, db_path: Path
) -> None:
    other = raw_connection(db_path)
    try:
        async with sqlite_db.transaction() as conn:
            # Only a read so far: a DEFERRED transaction would hold no write lock yet.
            assert (await conn.execute(text("SELECT n FROM counter"))).scalar_one() == 0
            with pytest.raises(sqlite3.OperationalError, match="database is locked"):
                other.execute("BEGIN IMMEDIATE")
        # Once the transaction is over, the lock is free again.
        other.execute("BEGIN IMMEDIATE")
        other.execute("ROLLBACK")
    finally:
        other.close()


async def test_transaction_rolls_back_on_error(sqlite_db: DatabaseManager) -> None:
    with pytest.raises(RuntimeError):
        async with sqlite_db.transaction() as conn:
            await conn.execute(text("UPDATE counter SET n = 99 WHERE id = 1"))
            raise RuntimeError("abort")
    async with sqlite_db.connect() as conn:
        assert (await conn.execute(text("SELECT n FROM counter"))).scalar_one() == 0


async def test_deferred_read_then_write_fails_at_once_when_another_writer_committed(
    sqlite_db: DatabaseManager, db_path: Path
) -> None:
    """Why writes never use a deferred transaction (the "G2" guard in the manager's docstring).

    A deferred transaction that has read holds a WAL snapshot. Once another connection commits,
    upgrading that snapshot to a writer is impossible, so SQLite answers SQLITE_BUSY(_SNAPSHOT)
    straight away: busy_timeout (5 s here) is not honoured, because waiting cannot help.
    """
    other = raw_connection(db_path)
    try:
        async with sqlite_db.connect() as conn:
            async with conn.begin():  # connect().begin() is the deferred (read) transaction
                assert (await conn.execute(text("SELECT n FROM counter"))).scalar_one() == 0
                other.execute("UPDATE counter SET n = n + 1 WHERE id = 1")  # autocommits
                started = time.monotonic()
                with pytest.raises(OperationalError, match="database is locked"):
                    await conn.execute(text("UPDATE counter SET n = n + 10 WHERE id = 1"))
                elapsed_s = time.monotonic() - started
        assert elapsed_s < 1.0, f"waited {elapsed_s:.2f}s: busy_timeout was honoured after all"
        # The same read-then-write inside transaction() serialises and keeps both increments.
        async with sqlite_db.transaction() as conn:
            n = (await conn.execute(text("SELECT n FROM counter"))).scalar_one()
            await conn.execute(text("UPDATE counter SET n = :n WHERE id = 1"), {"n": n + 10})
        async with sqlite_db.connect() as conn:
            assert (await conn.execute(text("SELECT n FROM counter"))).scalar_one() == 11
    finally:
        other.close()


async def test_concurrent_writers_of_one_process_queue_in_order(
    sqlite_db: DatabaseManager,
) -> None:
    # SQLite's busy handler retries blocked writers after sleeps of up to 100 ms, in no
    # particular order; the writers of one process queue on the manager's lock instead and
    # get the write lock in the order they asked for it.
    entered: list[int] = []

    async def bump(index: int) -> None:
        async with sqlite_db.transaction() as conn:
            entered.append(index)
            await conn.execute(text("UPDATE counter SET n = n + 1 WHERE id = 1"))

    await asyncio.gather(*(bump(index) for index in range(50)))
    assert entered == list(range(50))
    async with sqlite_db.connect() as conn:
        assert (await conn.execute(text("SELECT n FROM counter"))).scalar_one() == 50


async def test_a_file_from_an_older_version_gets_the_current_indexes(db_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{db_path}"
    old = DatabaseManager(Settings(database_url=url))
    try:
        await old.initialize()
        # As version 0001 left it: the retired claim index, not its replacement.
        async with old.transaction() as conn:
            await conn.execute(text("DROP INDEX ix_runs_lane_tenant"))
            await conn.execute(
                text("CREATE INDEX ix_runs_claim ON runs (status, lane, priority, not_before)")
            )
    finally:
        await old.dispose()
    current = DatabaseManager(Settings(database_url=url))
    try:
        await current.initialize()
        async with current.connect() as conn:
            rows = await conn.execute(
                text("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'runs'")
            )
            names = set(rows.scalars())
    finally:
        await current.dispose()
    assert "ix_runs_lane_tenant" in names
    assert "ix_runs_claim" not in names


@pytest.fixture
def crossings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the calls sent to the aiosqlite connections' threads from now on."""
    sent: list[str] = []
    crossing = sqlite_driver.Connection._execute

    async def counted(self: sqlite_driver.Connection, fn: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(getattr(fn, "__name__", repr(fn)))
        return await crossing(self, fn, *args, **kwargs)  # type: ignore[no-untyped-call]

    monkeypatch.setattr(sqlite_driver.Connection, "_execute", counted)
    return sent


async def test_a_one_statement_write_crosses_to_the_driver_thread_twice(
    sqlite_db: DatabaseManager, crossings: list[str]
) -> None:
    async with sqlite_db.transaction() as conn:
        await conn.execute(text("UPDATE counter SET n = n + 1 WHERE id = 1"))
    # The statement with its BEGIN IMMEDIATE, then the commit; the pool's reset-on-return
    # rollback finds no transaction and stays on the event loop.
    assert crossings == ["_run", "commit"]
    crossings.clear()
    async with sqlite_db.connect() as conn:
        assert (await conn.execute(text("SELECT n FROM counter"))).scalar_one() == 1
    # A read: the statement with its BEGIN (DEFERRED, so the reads share one snapshot), then
    # the rollback that ends the snapshot.
    assert crossings == ["_run", "rollback"]


async def test_a_transaction_without_statements_never_takes_the_lock(
    sqlite_db: DatabaseManager, db_path: Path, crossings: list[str]
) -> None:
    other = raw_connection(db_path)
    try:
        async with sqlite_db.transaction():
            other.execute("BEGIN IMMEDIATE")  # free: the held-back BEGIN was never sent
            other.execute("ROLLBACK")
    finally:
        other.close()
    assert crossings == []


async def test_an_error_in_the_first_statement_rolls_the_transaction_back(
    sqlite_db: DatabaseManager,
) -> None:
    with pytest.raises(IntegrityError):
        async with sqlite_db.transaction() as conn:
            # Sent in one crossing with BEGIN IMMEDIATE, and refused.
            await conn.execute(text("INSERT INTO counter (id, n) VALUES (1, 5)"))
    with pytest.raises(IntegrityError):
        async with sqlite_db.transaction() as conn:
            await conn.execute(text("UPDATE counter SET n = 7 WHERE id = 1"))
            await conn.execute(text("INSERT INTO counter (id, n) VALUES (1, 5)"))
    async with sqlite_db.transaction() as conn:
        rows = await conn.execute(
            text("INSERT INTO counter (id, n) VALUES (:id, :n)"),
            [{"id": 2, "n": 2}, {"id": 3, "n": 3}],
        )
        assert rows.rowcount == 2
        returned = await conn.execute(text("UPDATE counter SET n = n * 10 RETURNING id, n"))
        assert sorted(returned.all()) == [(1, 0), (2, 20), (3, 30)]
    async with sqlite_db.connect() as conn:
        result = await conn.stream(text("SELECT id FROM counter ORDER BY id"))
        assert [row.id async for row in result] == [1, 2, 3]


async def test_a_write_statement_commits_with_its_statement_in_one_crossing(
    sqlite_db: DatabaseManager, db_path: Path, crossings: list[str]
) -> None:
    changed = await sqlite_db.write_statement(
        text("UPDATE counter SET n = n + :by WHERE id = 1"), {"by": 5}
    )
    assert changed == 1
    # BEGIN IMMEDIATE, the statement and COMMIT went together; SQLAlchemy's commit and the
    # pool's reset found nothing open.
    assert crossings == ["_run"]
    other = raw_connection(db_path)
    try:
        assert other.execute("SELECT n FROM counter").fetchone() == (5,)
        other.execute("BEGIN IMMEDIATE")  # the write lock is free: nothing left open
        other.execute("ROLLBACK")
    finally:
        other.close()
    assert await sqlite_db.write_statement(text("UPDATE counter SET n = 0 WHERE id = 99")) == 0


async def test_a_failed_write_statement_rolls_back_in_its_crossing(
    sqlite_db: DatabaseManager, db_path: Path, crossings: list[str]
) -> None:
    with pytest.raises(IntegrityError):
        await sqlite_db.write_statement(text("INSERT INTO counter (id, n) VALUES (1, 5)"))
    assert crossings == ["_run"]
    other = raw_connection(db_path)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute("ROLLBACK")
    finally:
        other.close()
    # The connection goes on: the next writers find no transaction left open on it.
    assert await sqlite_db.write_statement(text("INSERT INTO counter (id, n) VALUES (2, 2)")) == 1
    async with sqlite_db.transaction() as conn:
        await conn.execute(text("UPDATE counter SET n = n + 1"))
    async with sqlite_db.connect() as conn:
        rows = await conn.execute(text("SELECT id, n FROM counter ORDER BY id"))
        assert rows.all() == [(1, 1), (2, 3)]


async def test_a_write_statement_on_an_in_memory_database() -> None:
    manager = DatabaseManager(Settings(database_url="sqlite+aiosqlite:///:memory:"))
    try:
        async with manager.transaction() as conn:
            await conn.execute(text("CREATE TABLE t (v INTEGER)"))
        assert await manager.write_statement(text("INSERT INTO t (v) VALUES (1)")) == 1
        async with manager.connect() as conn:
            assert (await conn.execute(text("SELECT count(*) FROM t"))).scalar_one() == 1
    finally:
        await manager.dispose()
