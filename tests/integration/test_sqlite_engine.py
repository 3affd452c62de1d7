"""The SQLite engine: its PRAGMAs on every connection, ``:memory:``, and IMMEDIATE writes."""

import asyncio
import os
import sqlite3
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.pool import QueuePool, StaticPool

from moorline.db import sqlite_driver
from moorline.db.backends import sqlite as sqlite_backend
from moorline.db.backends import sqlite_checkpoint
from moorline.db.manager import DatabaseManager
from moorline.settings import Settings
from tests.helpers import wait_for

EXPECTED_PRAGMAS = {
    "journal_mode": "wal",
    "synchronous": 1,  # NORMAL
    "cache_size": -64000,
    "foreign_keys": 1,
    # 0 on the connection, which runs on the event loop: a call that meets the write lock
    # waits for it (up to 5 s) on the connection's thread instead (the tests below).
    "busy_timeout": 0,
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
        async with manager.connect() as conn:  # the reads' connection, beside the writes' one
            await conn.execute(text("SELECT 1"))
        yield manager
    finally:
        await manager.dispose()


def size_of(path: Path) -> int:
    """A file's size (a stat: microseconds, so fine on the event loop)."""
    return os.path.getsize(path)


async def create_blob_table(db: DatabaseManager) -> None:
    async with db.transaction() as conn:
        await conn.execute(text("CREATE TABLE blob (id INTEGER PRIMARY KEY, v BLOB)"))


async def write_blob(db: DatabaseManager, size: int) -> None:
    """One transaction adding about ``size`` bytes to the log."""
    async with db.transaction() as conn:
        await conn.execute(text("INSERT INTO blob (v) VALUES (zeroblob(:n))"), {"n": size})


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


async def started_after(db_path: Path, older: list[str], *reads: str) -> list[list[Any]]:
    """Make a database file, change it as an older version left it (``older``), then start
    on it again (which brings its schema up to date): each of ``reads``' rows."""
    url = f"sqlite+aiosqlite:///{db_path}"
    old = DatabaseManager(Settings(database_url=url))
    try:
        await old.initialize()
        async with old.transaction() as conn:
            for statement in older:
                await conn.execute(text(statement))
    finally:
        await old.dispose()
    current = DatabaseManager(Settings(database_url=url))
    try:
        await current.initialize()
        async with current.connect() as conn:
            return [[tuple(row) for row in await conn.execute(text(read))] for read in reads]
    finally:
        await current.dispose()


RUN_INDEXES = "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'runs'"


async def test_a_file_from_an_older_version_gets_the_current_indexes(db_path: Path) -> None:
    # As version 0001 left it: the retired claim index, not its replacement.
    (indexes,) = await started_after(
        db_path,
        [
            "DROP INDEX ix_runs_lane_tenant",
            "CREATE INDEX ix_runs_claim ON runs (status, lane, priority, not_before)",
        ],
        RUN_INDEXES,
    )
    names = {name for name, _ in indexes}
    assert "ix_runs_lane_tenant" in names
    assert "ix_runs_claim" not in names


async def test_an_index_whose_columns_changed_is_rebuilt(db_path: Path) -> None:
    """Revision 0006 added ``workflow`` to the claim index; an older file gets it too."""
    (rows,) = await started_after(
        db_path,
        [
            "DROP INDEX ix_runs_lane_tenant",
            "CREATE INDEX ix_runs_lane_tenant ON runs "
            "(status, lane, tenant_id, priority DESC, not_before, id)",
        ],
        "PRAGMA index_info(ix_runs_lane_tenant)",
    )
    columns = [row[2] for row in rows]
    assert columns == ["status", "lane", "tenant_id", "priority", "not_before", "id", "workflow"]


async def test_indexes_made_whole_before_0016_become_partial(db_path: Path) -> None:
    """A file from before 0016 holds every run in ix_runs_parent; at start it holds only
    children (and the three other partial indexes are made again the same way)."""
    (indexes,) = await started_after(
        db_path,
        [
            "DROP INDEX ix_runs_parent",
            "CREATE INDEX ix_runs_parent ON runs (parent_run_id, status)",
        ],
        RUN_INDEXES,
    )
    made = dict(indexes)
    assert made["ix_runs_parent"].endswith("WHERE parent_run_id IS NOT NULL"), made
    assert made["ix_runs_conversation"].endswith("WHERE conversation_id IS NOT NULL")
    assert made["ix_runs_lease"].endswith("WHERE lease_expires_at IS NOT NULL")
    assert made["ix_runs_finished"].endswith("WHERE finished_at IS NOT NULL")
    assert "WHERE" not in made["ix_runs_lane_tenant"]


async def test_a_file_from_an_older_version_gets_the_columns_added_since(db_path: Path) -> None:
    steps, indexes, workers = await started_after(
        db_path,
        [  # as the versions before steps.seq left it
            "DROP INDEX ix_steps_run_seq",
            "ALTER TABLE steps DROP COLUMN seq",
            "ALTER TABLE workers DROP COLUMN version",  # before 0011
        ],
        "PRAGMA table_info(steps)",
        "PRAGMA index_list(steps)",
        "PRAGMA table_info(workers)",
    )
    assert "seq" in {row[1] for row in steps}
    assert "version" in {row[1] for row in workers}
    assert "ix_steps_run_seq" in {row[1] for row in indexes}


@pytest.fixture
def crossings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the calls sent to the aiosqlite connections' threads from now on.

    No statement counts as slow (the machine being busy for a moment must not send one to
    the thread), except where a test says otherwise.
    """
    monkeypatch.setattr(sqlite_driver, "_SLOW_STATEMENTS", set())
    monkeypatch.setattr(sqlite_driver, "_SUSPECTS", {})
    monkeypatch.setattr(sqlite_driver, "_INLINE_SLOW_S", 3600.0)
    sent: list[str] = []
    crossing = sqlite_driver.Connection._execute_on_thread

    async def counted(self: sqlite_driver.Connection, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # Every crossing of an inline connection carries its call in _waiting_for_lock.
        assert fn == self._waiting_for_lock
        sent.append(args[0].func.__name__)
        return await crossing(self, fn, *args, **kwargs)

    monkeypatch.setattr(sqlite_driver.Connection, "_execute_on_thread", counted)
    return sent


async def test_statements_run_on_the_event_loop_without_crossing(
    sqlite_db: DatabaseManager, crossings: list[str]
) -> None:
    async with sqlite_db.transaction() as conn:
        await conn.execute(text("UPDATE counter SET n = n + 1 WHERE id = 1"))
    async with sqlite_db.connect() as conn:
        assert (await conn.execute(text("SELECT n FROM counter"))).scalar_one() == 1
    assert await sqlite_db.write_statement(text("UPDATE counter SET n = 5 WHERE id = 1")) == 1
    assert crossings == []


async def test_background_work_runs_its_statements_on_the_thread(
    sqlite_db: DatabaseManager, crossings: list[str]
) -> None:
    # The retention cleaner's small statements, inline, would hold the loop one after another.
    with sqlite_db.backend.background():
        async with sqlite_db.transaction() as conn:
            await conn.execute(text("UPDATE counter SET n = n + 1 WHERE id = 1"))
    assert crossings == ["_run", "commit"]
    crossings.clear()
    # Only inside: the same transaction after it runs inline again.
    async with sqlite_db.transaction() as conn:
        await conn.execute(text("UPDATE counter SET n = n + 1 WHERE id = 1"))
    assert crossings == []


async def test_a_statement_found_slow_goes_to_the_thread_from_then_on(
    sqlite_db: DatabaseManager, crossings: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_driver, "_INLINE_SLOW_S", 0.001)
    # Counting to 300,000 takes SQLite tens of milliseconds.
    slow = text(
        "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 300000) "
        "SELECT count(*) FROM c"
    )
    for _ in range(4):
        async with sqlite_db.connect() as conn:
            assert (await conn.execute(slow)).scalar_one() == 300000
    # Inline three times (slow by the wall clock, then twice by CPU), then on the thread.
    assert crossings == ["_run", "rollback"]


async def test_a_fast_statement_is_timed_by_the_wall_clock_alone(
    sqlite_db: DatabaseManager, crossings: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The thread's CPU clock is a system call: read only for a statement slow by the wall.
    reads = 0
    cpu_clock = time.thread_time

    def counted() -> float:
        nonlocal reads
        reads += 1
        return cpu_clock()

    monkeypatch.setattr(time, "thread_time", counted)  # the module sqlite_driver reads it from
    for _ in range(5):
        async with sqlite_db.transaction() as conn:
            await conn.execute(text("UPDATE counter SET n = n + 1 WHERE id = 1"))
    assert reads == 0
    assert crossings == []


async def test_a_statement_slow_once_stays_on_the_event_loop(
    sqlite_db: DatabaseManager, crossings: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a virtual machine's host taking the CPU away for a moment looks like: one run of a
    # cheap statement counts milliseconds of the thread's CPU time, the runs around it none.
    monkeypatch.setattr(sqlite_driver, "_INLINE_SLOW_S", 0.001)
    calls = 0

    def burn_on_the_second_call() -> int:
        nonlocal calls
        calls += 1
        started = time.thread_time()
        while calls == 2 and time.thread_time() - started < 0.005:
            pass
        return calls

    async with sqlite_db.connect() as conn:
        raw = await conn.get_raw_connection()
        driver = raw.driver_connection
        assert isinstance(driver, sqlite_driver.Connection)
        assert driver._connection is not None
        driver._connection.create_function("burn", 0, burn_on_the_second_call)
        for expected in range(1, 6):
            assert (await conn.execute(text("SELECT burn()"))).scalar_one() == expected
    assert crossings == []


async def test_write_statements_inline_let_the_loop_run_between_them(
    sqlite_db: DatabaseManager, crossings: list[str]
) -> None:
    # A workflow of many cheap steps is a loop of such writes; heartbeats must still run.
    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while True:
            await asyncio.sleep(0)
            turns += 1

    counter = asyncio.create_task(count_turns())
    await asyncio.sleep(0)
    try:
        before = turns
        for _ in range(20):
            assert await sqlite_db.write_statement(text("UPDATE counter SET n = n + 1")) == 1
        assert turns - before >= 20
    finally:
        counter.cancel()
    assert crossings == []


async def test_a_statement_slow_only_in_wall_time_stays_on_the_event_loop(
    sqlite_db: DatabaseManager, crossings: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a descheduled process (a loaded machine) or a thread holding the GIL does to a cheap
    # statement: wall time passes, the loop's thread spends no CPU.
    monkeypatch.setattr(sqlite_driver, "_INLINE_SLOW_S", 0.001)
    async with sqlite_db.connect() as conn:
        raw = await conn.get_raw_connection()
        driver = raw.driver_connection
        assert isinstance(driver, sqlite_driver.Connection)
        assert driver._connection is not None
        driver._connection.create_function("pause", 0, lambda: time.sleep(0.02))
        for _ in range(2):
            assert (await conn.execute(text("SELECT pause() IS NULL"))).scalar_one() == 1
    assert crossings == []


class Ticker:
    """Counts event-loop turns: proof that the loop ran while something else waited."""

    def __init__(self) -> None:
        self.ticks = 0
        self._task = asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0.001)
            self.ticks += 1

    async def until(self, ticks: int) -> None:
        deadline = time.monotonic() + 10
        start = self.ticks
        while self.ticks < start + ticks:
            assert time.monotonic() < deadline, "the event loop stopped turning"
            await asyncio.sleep(0.001)

    def stop(self) -> None:
        self._task.cancel()


async def test_a_write_that_meets_the_lock_waits_for_it_off_the_event_loop(
    sqlite_db: DatabaseManager, db_path: Path, crossings: list[str]
) -> None:
    other = raw_connection(db_path)
    ticker = Ticker()
    try:
        other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        write = asyncio.create_task(
            sqlite_db.write_statement(text("UPDATE counter SET n = n + 1 WHERE id = 1"))
        )
        # The loop keeps turning while the write waits: had the busy handler run on it, the
        # lock (released by this same loop, below) could never come free.
        await ticker.until(50)
        assert not write.done()
        other.execute("COMMIT")
        assert await asyncio.wait_for(write, 10) == 1
    finally:
        ticker.stop()
        other.close()
    assert crossings == ["_run"]
    # The connection is back to running inline, with its busy timeout at 0 again.
    crossings.clear()
    async with sqlite_db.connect() as conn:
        assert (await conn.execute(text("SELECT n FROM counter"))).scalar_one() == 1
        assert (await conn.execute(text("PRAGMA busy_timeout"))).scalar_one() == 0
    assert crossings == []


async def test_a_call_given_up_while_it_waits_for_the_lock_keeps_the_next_off_the_loop(
    sqlite_db: DatabaseManager, db_path: Path, crossings: list[str]
) -> None:
    # A cancelled attempt gives up a write waiting for the lock on the connection's thread; the
    # write goes on there. What then happens to the connection (given back to the pool, whose
    # reset rolls back) must queue behind that write on the thread: run inline beside it, it
    # crashed sqlite3.
    other = raw_connection(db_path)
    ticker = Ticker()
    try:
        other.execute("BEGIN IMMEDIATE")
        write = asyncio.create_task(
            sqlite_db.write_statement(text("UPDATE counter SET n = n + 1 WHERE id = 1"))
        )
        await ticker.until(50)
        assert not write.done()
        write.cancel()
        with pytest.raises(asyncio.CancelledError):
            await write

        async def followed_up() -> bool:
            await asyncio.sleep(0)
            return len(crossings) > 1

        await wait_for(followed_up, message="the pool's reset of the given-up connection")
        other.execute("COMMIT")
    finally:
        ticker.stop()
        other.close()
    assert crossings[:2] == ["_run", "rollback"]


async def test_closing_a_connection_whose_cursor_lives_on_releases_the_write_lock(
    sqlite_db: DatabaseManager, db_path: Path
) -> None:
    # A cursor whose statement still runs, kept alive elsewhere (a traceback an attempt keeps
    # with its error holds the frames that hold it): sqlite3 cannot free the closed
    # connection, which kept its transaction, and the write lock, open.
    driver = sqlite_driver.Connection(
        lambda: sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
    )
    await driver

    def open_write(connection: sqlite3.Connection) -> sqlite3.Cursor:
        connection.execute("BEGIN IMMEDIATE")
        connection.execute("UPDATE counter SET n = n + 1 WHERE id = 1")
        cursor = connection.execute("SELECT n FROM counter UNION ALL SELECT 2")
        cursor.fetchone()  # a statement still running when the connection is closed
        return cursor

    kept = await driver._execute(open_write, driver._conn)
    await driver.close()
    probe = raw_connection(db_path)
    try:
        probe.execute("BEGIN IMMEDIATE")  # the write lock is free
        assert probe.execute("SELECT n FROM counter").fetchone() == (0,)
        probe.execute("ROLLBACK")
    finally:
        probe.close()
    del kept


async def test_a_rollback_after_a_given_up_statement_queues_behind_it(db_path: Path) -> None:
    # The given-up statement brings its transaction's BEGIN along: until it has run on the
    # thread, the loop cannot see that transaction, and a rollback that looked from there
    # found none, skipped itself, and left the lock held for good.
    setup = raw_connection(db_path)
    setup.execute("CREATE TABLE counter (id INTEGER PRIMARY KEY, n INTEGER)")
    setup.execute("INSERT INTO counter (id, n) VALUES (1, 0)")
    setup.close()
    driver = sqlite_driver.Connection(
        lambda: sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
    )
    await driver
    driver.run_inline(busy_timeout_ms=5000)
    other = raw_connection(db_path)
    ticker = Ticker()
    try:
        other.execute("BEGIN IMMEDIATE")
        cursor = await driver.cursor()
        await cursor.execute("BEGIN IMMEDIATE")  # held back, sent with the statement
        update = asyncio.create_task(cursor.execute("UPDATE counter SET n = 1 WHERE id = 1"))
        await ticker.until(50)
        assert not update.done()
        update.cancel()
        with pytest.raises(asyncio.CancelledError):
            await update
        rollback = asyncio.create_task(driver.rollback())
        other.execute("COMMIT")
        await asyncio.wait_for(rollback, 10)

        async def thread_idle() -> bool:
            return driver._sent_to_thread == driver._done_on_thread

        await wait_for(thread_idle, message="the given-up statement to have run")
        probe = raw_connection(db_path)
        try:
            probe.execute("BEGIN IMMEDIATE")  # the write lock is free
            assert probe.execute("SELECT n FROM counter").fetchone() == (0,)
            probe.execute("ROLLBACK")
        finally:
            probe.close()
    finally:
        ticker.stop()
        other.close()
        await driver.close()


async def test_a_statement_refused_inside_a_transaction_resumes_in_it(
    sqlite_db: DatabaseManager, db_path: Path, crossings: list[str]
) -> None:
    other = raw_connection(db_path)
    ticker = Ticker()
    try:
        other.execute("BEGIN IMMEDIATE")
        async with sqlite_db.connect() as conn, conn.begin():
            # A deferred transaction: its BEGIN goes with this statement and succeeds, the
            # statement is refused for the lock, and only the statement is sent again.
            update = asyncio.create_task(
                conn.execute(text("UPDATE counter SET n = n + 7 WHERE id = 1"))
            )
            await ticker.until(50)
            assert not update.done()
            other.execute("COMMIT")
            assert (await asyncio.wait_for(update, 10)).rowcount == 1
            assert (await conn.execute(text("SELECT n FROM counter"))).scalar_one() == 7
    finally:
        ticker.stop()
        other.close()
    assert crossings == ["_run"]
    async with sqlite_db.connect() as conn:
        assert (await conn.execute(text("SELECT n FROM counter"))).scalar_one() == 7


async def test_a_lock_held_past_the_busy_timeout_is_refused(
    sqlite_db: DatabaseManager, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A manager whose connections wait 50 ms for the lock instead of 5 s.
    monkeypatch.setattr(sqlite_backend, "BUSY_TIMEOUT_MS", 50)
    impatient = DatabaseManager(Settings(database_url=f"sqlite+aiosqlite:///{db_path}"))
    other = raw_connection(db_path)
    try:
        other.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        with pytest.raises(OperationalError, match="database is locked"):
            await impatient.write_statement(text("UPDATE counter SET n = 1 WHERE id = 1"))
        assert time.monotonic() - started < 2.0
        other.execute("ROLLBACK")
        # Nothing was left half-done: the write goes through once the lock is free.
        assert await impatient.write_statement(text("UPDATE counter SET n = 2 WHERE id = 1")) == 1
    finally:
        other.close()
        await impatient.dispose()
    async with sqlite_db.connect() as conn:
        assert (await conn.execute(text("SELECT n FROM counter"))).scalar_one() == 2


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


async def test_a_write_statement_commits_with_its_statement(
    sqlite_db: DatabaseManager, db_path: Path, crossings: list[str]
) -> None:
    changed = await sqlite_db.write_statement(
        text("UPDATE counter SET n = n + :by WHERE id = 1"), {"by": 5}
    )
    assert changed == 1
    # BEGIN IMMEDIATE, the statement and COMMIT went together; SQLAlchemy's commit and the
    # pool's reset found nothing open.
    assert crossings == []
    other = raw_connection(db_path)
    try:
        assert other.execute("SELECT n FROM counter").fetchone() == (5,)
        other.execute("BEGIN IMMEDIATE")  # the write lock is free: nothing left open
        other.execute("ROLLBACK")
    finally:
        other.close()
    assert await sqlite_db.write_statement(text("UPDATE counter SET n = 0 WHERE id = 99")) == 0


async def test_a_failed_write_statement_rolls_back(
    sqlite_db: DatabaseManager, db_path: Path, crossings: list[str]
) -> None:
    with pytest.raises(IntegrityError):
        await sqlite_db.write_statement(text("INSERT INTO counter (id, n) VALUES (1, 5)"))
    assert crossings == []
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


async def test_writes_take_turns_on_one_connection_and_a_failed_one_gives_it_back(
    sqlite_db: DatabaseManager,
) -> None:
    pool = sqlite_db.engine.sync_engine.pool
    assert isinstance(pool, QueuePool)

    async def written_on() -> object:
        async with sqlite_db.transaction() as conn:
            await conn.execute(text("UPDATE counter SET n = n + 1 WHERE id = 1"))
            return (await conn.get_raw_connection()).driver_connection

    first = await written_on()
    assert await sqlite_db.write_statement(text("UPDATE counter SET n = n + 1")) == 1
    assert await written_on() is first
    assert pool.checkedout() == 1  # kept for the writes, between them too
    with pytest.raises(ZeroDivisionError):
        async with sqlite_db.transaction() as conn:
            await conn.execute(text("UPDATE counter SET n = 100 WHERE id = 1"))
            _ = 1 / 0
    assert pool.checkedout() == 0  # given back, and reset: its transaction rolled back
    await written_on()
    async with sqlite_db.connect() as conn:
        assert (await conn.execute(text("SELECT n FROM counter"))).scalar_one() == 4


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


async def test_the_write_ahead_log_is_checkpointed_off_the_write_path(
    sqlite_db: DatabaseManager, db_path: Path
) -> None:
    # Commits never checkpoint (wal_autocheckpoint=0): the manager's checkpointer copies the
    # log into the database file once it passes its size, while the connections stay open.
    async with sqlite_db.connect() as conn:
        assert (await conn.execute(text("PRAGMA wal_autocheckpoint"))).scalar_one() == 0
    await create_blob_table(sqlite_db)
    chunk = sqlite_checkpoint.CHECKPOINT_WAL_BYTES // 4
    for _ in range(6):
        await write_blob(sqlite_db, chunk)
    deadline = time.monotonic() + 10
    while size_of(db_path) < sqlite_checkpoint.CHECKPOINT_WAL_BYTES:
        assert time.monotonic() < deadline, "the database file never received the log's pages"
        await asyncio.sleep(0.01)
    # Once all the log is copied, the next write starts it over and cuts its file back
    # (journal_size_limit): the file's size says again how much log waits for a checkpoint.
    # (A connection of our own copies the rest, and stays open: closing the last connection
    # would remove the log.)
    keeper = sqlite3.connect(db_path, isolation_level=None)
    try:
        keeper.execute("SELECT count(*) FROM blob").fetchone()  # opens the log
        await sqlite_db.dispose()  # waits for the checkpoint in progress to end
        keeper.execute("PRAGMA wal_checkpoint(PASSIVE)")
        assert size_of(Path(f"{db_path}-wal")) > sqlite_checkpoint.CHECKPOINT_WAL_BYTES
        await write_blob(sqlite_db, 1)
        assert size_of(Path(f"{db_path}-wal")) <= sqlite_checkpoint.WAL_KEPT_BYTES
    finally:
        keeper.close()


async def test_a_log_that_cannot_start_over_is_not_checkpointed_after_every_write(
    sqlite_db: DatabaseManager, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under a steady stream of writes the log never starts over, so its file stays past the
    # checkpoint size. A reader on the newest snapshot does the same here: the checkpoint can
    # copy all the log, but the log cannot start over under the reader. The next checkpoint is
    # due once the log has grown by the size again, not after each of the writes meanwhile.
    started: list[bool] = []
    checkpoint = sqlite_checkpoint.checkpoint

    def counted(database: str, *, truncate: bool) -> bool:
        started.append(truncate)
        return checkpoint(database, truncate=truncate)

    monkeypatch.setattr(sqlite_checkpoint, "checkpoint", counted)
    await create_blob_table(sqlite_db)
    chunk = sqlite_checkpoint.CHECKPOINT_WAL_BYTES // 2
    for _ in range(2):
        await write_blob(sqlite_db, chunk)
    # The second write started a checkpoint, whose thread runs at the loop's next turn: the
    # reader's snapshot is the one that checkpoint finds.
    reader = sqlite3.connect(db_path, isolation_level=None)
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM blob").fetchone()
        await sqlite_db.dispose()  # waits for the checkpoint to end
        assert started == [False]
        assert size_of(Path(f"{db_path}-wal")) > sqlite_checkpoint.CHECKPOINT_WAL_BYTES
        for _ in range(20):
            await write_blob(sqlite_db, 1)
        assert started == [False]
        await write_blob(sqlite_db, 2 * chunk)
        await sqlite_db.dispose()
        assert started == [False, False]
    finally:
        reader.close()


async def test_a_log_that_readers_keep_from_restarting_is_truncated_past_its_bound(
    sqlite_db: DatabaseManager, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/reliability.md G3: readers that always overlap keep a PASSIVE checkpoint from ever
    # letting the log start over. Past its bound the checkpointer waits for them (TRUNCATE).
    monkeypatch.setattr(sqlite_checkpoint, "TRUNCATE_WAL_BYTES", 6 * 1024 * 1024)
    wal = Path(f"{db_path}-wal")
    await create_blob_table(sqlite_db)
    reader = sqlite3.connect(db_path, isolation_level=None)
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM counter").fetchone()  # holds an old snapshot
        chunk = sqlite_checkpoint.CHECKPOINT_WAL_BYTES // 2
        for _ in range(4):
            await write_blob(sqlite_db, chunk)
        assert size_of(wal) > sqlite_checkpoint.TRUNCATE_WAL_BYTES
        reader.execute("COMMIT")  # the reader moves on
        deadline = time.monotonic() + 10
        while size_of(wal) > sqlite_checkpoint.CHECKPOINT_WAL_BYTES:
            assert time.monotonic() < deadline, f"the log stayed at {size_of(wal)} bytes"
            # Writes go on, and each one looks at the log's size.
            await write_blob(sqlite_db, 1)
            await asyncio.sleep(0.01)
    finally:
        reader.close()


CONTENDER = """
import asyncio, sys
from sqlalchemy import text
from moorline.db.manager import DatabaseManager
from moorline.settings import Settings

async def main(url, rounds):
    db = DatabaseManager(Settings(database_url=url))
    try:
        for _ in range(rounds):
            async with db.transaction() as conn:  # read, then write: lost updates would show
                n = (await conn.execute(text("SELECT n FROM counter WHERE id = 1"))).scalar_one()
                await conn.execute(text("UPDATE counter SET n = :n WHERE id = 1"), {"n": n + 1})
            await db.write_statement(text("UPDATE counter SET n = n + 1 WHERE id = 2"))
    finally:
        await db.dispose()

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


async def test_processes_contending_for_the_write_lock_see_no_busy_error(
    sqlite_db: DatabaseManager, db_path: Path
) -> None:
    # docs/reliability.md G1, at CI size: writers of several processes meet each other's write lock
    # all the time; every such statement waits on its connection's thread and none fails.
    async with sqlite_db.transaction() as conn:
        await conn.execute(text("INSERT INTO counter (id, n) VALUES (2, 0)"))
    processes, rounds = 4, 60
    url = f"sqlite+aiosqlite:///{db_path}"
    children = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", CONTENDER, url, str(rounds), stderr=asyncio.subprocess.PIPE
        )
        for _ in range(processes)
    ]
    for child in children:
        _, stderr = await asyncio.wait_for(child.communicate(), 120)
        assert child.returncode == 0, stderr.decode()[-2000:]
    async with sqlite_db.connect() as conn:
        rows = await conn.execute(text("SELECT id, n FROM counter ORDER BY id"))
        assert rows.all() == [(1, processes * rounds), (2, processes * rounds)]


async def test_a_lanes_batch_runs_inline_and_a_bulk_one_on_the_thread(
    sqlite_db: DatabaseManager, crossings: list[str]
) -> None:
    # A worker's batch of outcomes or events is a lane's slots' worth: a crossing would only
    # delay the claim waiting on it. A bulk submission's rows cost milliseconds: the loop
    # goes on meanwhile.
    async with sqlite_db.transaction() as conn:
        await conn.execute(text("CREATE TABLE IF NOT EXISTS item (id INTEGER PRIMARY KEY)"))
    insert = text("INSERT INTO item (id) VALUES (:id)")
    lane = [{"id": n} for n in range(64)]
    wide = ", ".join(f":p{n}" for n in range(512))
    async with sqlite_db.transaction() as conn:
        await conn.execute(insert, lane)
        params = {f"p{n}": n for n in range(512)}
        assert (
            await conn.execute(text(f"SELECT count(*) FROM item WHERE id IN ({wide})"), params)
        ).scalar_one() == 64
    assert crossings == []
    bulk = [{"id": n} for n in range(1000, 1065)]
    async with sqlite_db.transaction() as conn:
        await conn.execute(insert, bulk)
    # The statement and its transaction's commit.
    assert crossings == ["_run", "commit"]
