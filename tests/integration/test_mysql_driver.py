"""The MariaDB driver connection: no ping, no needless ROLLBACK, and nothing left open.

The server's own per-session counters say which commands a connection sent: ``Com_rollback``
counts ROLLBACKs, ``Com_admin_commands`` pings (and other non-SQL commands).
"""

from collections.abc import AsyncIterator, Iterator

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError

from moorline.db import mysql_driver
from moorline.db.manager import DatabaseManager
from moorline.settings import Settings
from tests.helpers import wait_for
from tests.servers import MYSQL_ADMIN_URL, require_server, run_sql, unique_name

OPEN_TRANSACTIONS = (
    "SELECT count(*) FROM information_schema.INNODB_TRX WHERE trx_mysql_thread_id = :t"
)
COUNTERS = (
    "SELECT VARIABLE_NAME, VARIABLE_VALUE FROM information_schema.SESSION_STATUS "
    "WHERE VARIABLE_NAME IN ('COM_ROLLBACK', 'COM_ADMIN_COMMANDS', 'COM_COMMIT')"
)


@pytest.fixture(scope="module")
def mysql_url() -> Iterator[str]:
    require_server("mysql")
    name = unique_name()
    run_sql("mysql", f"CREATE DATABASE {name}")
    try:
        yield make_url(MYSQL_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        run_sql("mysql", f"DROP DATABASE IF EXISTS {name}")


@pytest.fixture
async def one_connection(mysql_url: str) -> AsyncIterator[DatabaseManager]:
    """A manager whose pools hold one connection each, so every call meets the same one."""
    manager = DatabaseManager(Settings(database_url=mysql_url, db_pool_size=1, db_max_overflow=0))
    try:
        async with manager.transaction() as conn:
            await conn.execute(text("CREATE TABLE IF NOT EXISTS probe (k INTEGER PRIMARY KEY)"))
            await conn.execute(text("DELETE FROM probe"))
        yield manager
    finally:
        await manager.dispose()


async def counters(db: DatabaseManager) -> dict[str, int]:
    async with db.connect() as conn:
        rows = await conn.execute(text(COUNTERS))
        return {name.lower(): int(value) for name, value in rows}


async def open_transactions(db: DatabaseManager, thread_id: int) -> int:
    """InnoDB transactions open on the session ``thread_id`` (asked from another session)."""
    other = DatabaseManager(Settings(database_url=MYSQL_ADMIN_URL))
    try:
        async with other.connect() as conn:
            found = await conn.execute(text(OPEN_TRANSACTIONS), {"t": thread_id})
            return int(found.scalar_one())
    finally:
        await other.dispose()


async def test_committed_transactions_cost_no_ping_and_no_rollback(
    one_connection: DatabaseManager,
) -> None:
    db = one_connection
    before = await counters(db)
    for k in range(3):
        async with db.write_transaction() as conn:
            await conn.execute(text("INSERT INTO probe (k) VALUES (:k)"), {"k": k})
    after = await counters(db)
    assert after["com_commit"] - before["com_commit"] == 3
    # The one ROLLBACK is the first counters() read's: a read ends its transaction.
    assert after["com_rollback"] - before["com_rollback"] == 1
    assert after["com_admin_commands"] == before["com_admin_commands"], "a ping was sent"


async def test_a_write_statement_is_one_round_trip(one_connection: DatabaseManager) -> None:
    db = one_connection
    # Each statement records its own session's counters: the autocommit pool's one connection.
    record = text(
        "INSERT INTO probe (k) SELECT :k + VARIABLE_VALUE * 1000 FROM "
        "information_schema.SESSION_STATUS WHERE VARIABLE_NAME = :counter"
    )
    for counter in ("COM_ROLLBACK", "COM_ADMIN_COMMANDS"):
        async with db.transaction() as conn:
            await conn.execute(text("DELETE FROM probe"))
        for k in range(1, 4):
            assert await db.write_statement(record, {"k": k, "counter": counter}) == 1
        async with db.connect() as conn:
            seen = list((await conn.execute(text("SELECT k FROM probe ORDER BY k"))).scalars())
        assert len({k // 1000 for k in seen}) == 1, f"{counter} grew between statements: {seen}"


async def test_reads_and_failed_writes_still_end_their_transactions(
    one_connection: DatabaseManager,
) -> None:
    db = one_connection
    async with db.transaction() as conn:
        await conn.execute(text("INSERT INTO probe (k) VALUES (1)"))
    # A read opens a transaction that MariaDB's status flags do not report (it holds the
    # table's metadata lock until it ends); a failed INSERT may leave one with locks.
    async with db.connect() as conn:
        thread_id = (await conn.execute(text("SELECT CONNECTION_ID()"))).scalar_one()
        await conn.execute(text("SELECT count(*) FROM probe"))
    assert await open_transactions(db, thread_id) == 0
    with pytest.raises(IntegrityError):
        async with db.write_transaction() as conn:
            await conn.execute(text("INSERT INTO probe (k) VALUES (1)"))
    assert await open_transactions(db, thread_id) == 0
    with pytest.raises(IntegrityError):
        await db.write_statement(text("INSERT INTO probe (k) VALUES (1)"))
    async with db.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM probe"))).scalar_one() == 1


async def test_a_pooled_connection_the_server_killed_is_replaced_at_checkout(
    one_connection: DatabaseManager,
) -> None:
    """No ping at checkout: the checkout itself drops a connection the server closed."""
    db = one_connection
    async with db.connect() as conn:
        thread_id = (await conn.execute(text("SELECT CONNECTION_ID()"))).scalar_one()
        raw = (await conn.get_raw_connection()).driver_connection
    assert isinstance(raw, mysql_driver.Connection)
    # Back in the pool; killed from another manager's connection, so not from this pool.
    killer = DatabaseManager(Settings(database_url=MYSQL_ADMIN_URL))
    try:
        async with killer.connect() as other:
            await other.execute(text(f"KILL CONNECTION {int(thread_id)}"))
    finally:
        await killer.dispose()

    async def noticed() -> bool:
        return raw.is_closed()

    await wait_for(noticed, message="aiomysql seeing the server close the connection")
    # Not through with_retry: the checkout must hand out a live connection the first time.
    async with db.connect() as conn:
        again = (await conn.execute(text("SELECT CONNECTION_ID()"))).scalar_one()
    assert again != thread_id


async def test_a_last_statement_carries_its_transactions_commit(
    one_connection: DatabaseManager,
) -> None:
    db = one_connection
    before = await counters(db)
    async with db.write_transaction() as conn:
        thread_id = (await conn.execute(text("SELECT CONNECTION_ID()"))).scalar_one()
        await conn.execute(text("INSERT INTO probe (k) VALUES (1), (2)"))
        await db.commit_with_next_statement(conn)
        # The statement's own result is what the caller reads.
        changed = await conn.execute(text("UPDATE probe SET k = k + 10 WHERE k > 0"))
        assert changed.rowcount == 2
    after = await counters(db)
    assert after["com_commit"] - before["com_commit"] == 1
    # The first counters() read's ROLLBACK only: the transaction's close sent none.
    assert after["com_rollback"] - before["com_rollback"] == 1
    assert await open_transactions(db, thread_id) == 0
    async with db.write_transaction() as conn:
        await db.commit_with_next_statement(conn)
        returned = await conn.execute(text("INSERT INTO probe (k) VALUES (3) RETURNING k"))
        assert list(returned.scalars()) == [3]
    async with db.connect() as conn:
        found = list((await conn.execute(text("SELECT k FROM probe ORDER BY k"))).scalars())
    assert found == [3, 11, 12]


async def test_a_failed_last_statement_commits_nothing(one_connection: DatabaseManager) -> None:
    db = one_connection
    async with db.transaction() as conn:
        await conn.execute(text("INSERT INTO probe (k) VALUES (1)"))
    with pytest.raises(IntegrityError):
        async with db.write_transaction() as conn:
            await conn.execute(text("INSERT INTO probe (k) VALUES (2)"))
            await db.commit_with_next_statement(conn)
            await conn.execute(text("INSERT INTO probe (k) VALUES (1)"))
    # Asked for, then never used: the next transaction's first statement does not commit.
    with pytest.raises(RuntimeError):
        async with db.write_transaction() as conn:
            await db.commit_with_next_statement(conn)
            raise RuntimeError("before the last statement")
    with pytest.raises(IntegrityError):
        async with db.write_transaction() as conn:
            await conn.execute(text("INSERT INTO probe (k) VALUES (3)"))
            await conn.execute(text("INSERT INTO probe (k) VALUES (1)"))
    async with db.connect() as conn:
        found = list((await conn.execute(text("SELECT k FROM probe ORDER BY k"))).scalars())
    assert found == [1]
