"""SQLite (aiosqlite): one file, one writer at a time, statements on the event loop.

WAL, ``synchronous=NORMAL``, 64 MB page cache, foreign keys and a 5 s busy timeout on every
connection. Write transactions begin ``IMMEDIATE``: a deferred transaction that reads and then
writes fails with ``SQLITE_BUSY`` at once, without honouring ``busy_timeout``, when another
writer got there first. ``:memory:`` lives on one static connection because every new
connection would see an empty database. A one-statement write sends ``BEGIN IMMEDIATE``, the
statement and ``COMMIT`` to the connection's thread in one crossing
(:meth:`moorline.db.sqlite_driver.Connection.commit_with_next_statement`).

The process's writes go through one connection it keeps for them, since its writer queue lets
only one write at a time anyway: a write then skips the pool's checkout, reset and check-in.
"""

import asyncio
import functools
import logging
import sqlite3
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractContextManager, asynccontextmanager
from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import (
    Executable,
    Float,
    Insert,
    Row,
    Select,
    Table,
    bindparam,
    event,
    func,
    select,
    type_coerce,
)
from sqlalchemy.dialects import sqlite
from sqlalchemy.dialects.sqlite.aiosqlite import SQLiteDialect_aiosqlite
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine
from sqlalchemy.pool import StaticPool
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.util import greenlet_spawn

from moorline import fastpaths
from moorline.db import sqlite_driver
from moorline.db.backends import sqlite_checkpoint, sqlite_direct
from moorline.db.backends.base import Backend, Capabilities, DialectName, Pools, upsert_below
from moorline.db.backends.direct import DirectConnection
from moorline.db.dsn import ConnectTarget
from moorline.db.types import UTCDateTime
from moorline.settings import Settings

logger = logging.getLogger(__name__)

BUSY_TIMEOUT_MS = 5000
PRAGMAS = (
    ("journal_mode", "WAL"),
    ("synchronous", "NORMAL"),
    ("cache_size", "-64000"),
    ("foreign_keys", "ON"),
    ("busy_timeout", str(BUSY_TIMEOUT_MS)),
    # No checkpoint inside a commit: the backend's checkpointer does them (sqlite_checkpoint).
    ("wal_autocheckpoint", "0"),
    ("journal_size_limit", str(sqlite_checkpoint.WAL_KEPT_BYTES)),
)

_AUTO_VACUUM_INCREMENTAL = 2
"""``PRAGMA auto_vacuum``'s answer for INCREMENTAL."""

# SQLite keeps UTCDateTime as text in SQLAlchemy's format; '%f' gives SS.SSS, so three literal
# zeros make it the same six-digit microsecond text and comparisons stay lexical-correct.
_NOW_FORMAT = "%Y-%m-%d %H:%M:%f000"
_BEGIN_OPTION = "moorline_begin"


class SQLiteBackend(Backend):
    """The embedded default: no server, ``BEGIN IMMEDIATE`` serialises writers."""

    name: ClassVar[DialectName] = "sqlite"
    capabilities: ClassVar[Capabilities] = Capabilities(
        server=False,
        embedded=True,
        row_locks=False,
        skip_locked=False,
        update_returning=True,
        insert_returning=True,
        upsert_returning=True,
        one_statement_submit=False,
        dml_in_cte=False,
        listen_notify=False,
        session_state=True,
        terminate_backend=False,
        migrations=False,
    )

    _writer: asyncio.Lock
    """This process's writers, queued in order (made with the pools).

    SQLite has one writer at a time. Queueing them here replaces a pile-up in SQLite's busy
    handler, which sleeps up to 100 ms between tries: without it, two tasks that want the
    write lock at once cost the second one tens of milliseconds. ``busy_timeout`` still
    covers writers in other processes."""
    _writing: AsyncConnection | None = None
    """The connection the writes take in turn (under ``_writer``), opened by the first."""
    _checkpointer: sqlite_checkpoint.WalCheckpointer | None = None
    _file: str | None = None
    _direct: sqlite_direct.DirectWrites | None = None
    """Statements of the write connection past SQLAlchemy's execution (a file, with
    ``fast_paths``)."""

    @property
    def shared_file(self) -> str | None:
        return self._file

    _warned_no_vacuum = False
    _versions: "_DataVersion | None" = None

    def now(self, *, plus_s: float = 0.0) -> ColumnElement[datetime]:
        return _now(float(plus_s))

    def now_less(self, parameter: str) -> ColumnElement[datetime]:
        return _now_less(parameter)

    def select_now(self) -> Select[Any]:
        return _select_now()

    def insert_ignoring_duplicates(self, table: Table) -> Insert:
        return sqlite.insert(table).on_conflict_do_nothing()

    def add_to_counters(
        self, table: Table, *, keys: Sequence[str], columns: Sequence[str]
    ) -> Insert:
        insert = sqlite.insert(table)
        return insert.on_conflict_do_update(
            index_elements=list(keys),
            set_={column: table.c[column] + insert.excluded[column] for column in columns},
        )

    def increment_below(
        self, table: Table, *, column: str, limit: int, keys: dict[str, Any]
    ) -> Insert | None:
        return upsert_below(sqlite.insert(table), table, column, limit, keys)

    def create_pools(self, settings: Settings, url: str, targets: Sequence[ConnectTarget]) -> Pools:
        parsed = make_url(url)
        if parsed.drivername != "sqlite+aiosqlite":
            parsed = parsed.set(drivername="sqlite+aiosqlite")
        in_memory = parsed.database in (None, "", ":memory:")
        self._writer = asyncio.Lock()
        kwargs: dict[str, Any]
        if in_memory:
            kwargs = {"poolclass": StaticPool, "connect_args": {"check_same_thread": False}}
        else:
            connect_args = SQLiteDialect_aiosqlite().create_connect_args(parsed)
            creator = sqlite_driver.connector(*connect_args, fast=settings.fast_paths)
            kwargs = {"async_creator": creator}
            assert parsed.database is not None  # not in memory
            self._checkpointer = sqlite_checkpoint.WalCheckpointer(parsed.database)
            self._file = parsed.database
        engine = create_async_engine(parsed, **kwargs)
        if not in_memory and settings.fast_paths:
            fastpaths.require("sqlalchemy")
            self._direct = sqlite_direct.DirectWrites(engine.dialect)
        event.listen(engine.sync_engine, "connect", _configure)
        event.listen(engine.sync_engine, "begin", _begin)
        return Pools(main=engine)

    @asynccontextmanager
    async def transaction(self, pools: Pools) -> AsyncIterator[AsyncConnection]:
        """Begins ``IMMEDIATE``, taking the write lock up front so ``busy_timeout`` applies.

        A deferred read-then-write transaction would fail with SQLITE_BUSY instead.
        """
        async with self._writing_connection(pools) as conn:
            direct = self._direct
            if direct is not None and isinstance(conn, DirectConnection):
                async with direct.transaction(conn):
                    yield conn
            else:
                async with conn.begin():
                    yield conn

    def background(self) -> AbstractContextManager[None]:
        return sqlite_driver.off_loop()

    async def write_statement(
        self, pools: Pools, statement: Executable, params: dict[str, Any]
    ) -> int:
        async with self._writing_connection(pools) as conn:
            direct = self._direct
            if direct is not None:
                prepared = direct.prepared(conn, statement, params, in_transaction=False)
                if prepared is not None:
                    return await direct.write_alone(*prepared, params)
            return await greenlet_spawn(_write_statement, conn.sync_connection, statement, params)

    async def write_statement_rows(
        self, pools: Pools, statement: Executable, params: dict[str, Any]
    ) -> list[Row[Any]]:
        """Not on SQLite: its one-crossing path reports the rowcount alone."""
        raise NotImplementedError("write_statement_rows: not on SQLite")

    async def reclaim_space(self, pools: Pools, max_pages: int) -> int:
        """``PRAGMA incremental_vacuum``: up to ``max_pages`` free pages cut off the file.

        On a connection of its own, on a thread, inside this process's writer queue: it waits
        its turn like any write and the loop goes on meanwhile. (sqlite3's ``execute`` steps a
        statement without result columns once, which frees one page; ``executescript`` steps
        it to the end.) The file shrinks at the next checkpoint that copies the whole log. A
        file made without incremental auto-vacuum keeps its free pages for later rows: that is
        logged once, with the one-off command that converts it. Nothing in memory.
        """
        if self._checkpointer is None:
            return 0
        async with self._writer:
            freed = await asyncio.to_thread(
                _incremental_vacuum, self._checkpointer.database, max_pages
            )
        self._after_write()
        if freed is None:
            if not self._warned_no_vacuum:
                self._warned_no_vacuum = True
                logger.warning(
                    "this SQLite file does not give deleted runs' space back to the file "
                    "system (auto_vacuum is not INCREMENTAL); with Moorline stopped, run once: "
                    "sqlite3 FILE 'PRAGMA auto_vacuum=INCREMENTAL; VACUUM'"
                )
            return 0
        return freed

    async def data_version(self) -> int | None:
        """``PRAGMA data_version`` of a connection kept for it; None in memory.

        It changes when any other connection, of this process or another, commits to the
        file; a read on a connection of the pool would not do, as the number is only
        comparable on the connection that gave it.
        """
        if self._file is None:
            return None
        if self._versions is None:
            self._versions = _DataVersion(self._file)
        return await asyncio.to_thread(self._versions.read)

    def wal_bytes(self) -> int | None:
        """Size of the WAL file; None in memory."""
        return None if self._checkpointer is None else self._checkpointer.wal_bytes()

    @asynccontextmanager
    async def _writing_connection(self, pools: Pools) -> AsyncIterator[AsyncConnection]:
        """The write connection, once this process's earlier writes are done with it.

        A write that fails (or is cancelled) gives it back to the pool, whose reset rolls back
        whatever the failure left open, even a statement still running on the connection's
        thread; the next write takes a connection from the pool again.

        After a write it lets the loop run the rest of its ready work once, as a write to a
        server does while it waits for the reply: run inline, the write never suspended,
        and a task writing one transaction after another (a workflow of many cheap steps)
        would hold the loop (heartbeats, other runs, the API) for as long as it kept writing.
        """
        async with self._writer:
            conn = self._writing
            if conn is None:
                engine = pools.main.execution_options(**{_BEGIN_OPTION: "IMMEDIATE"})
                if self._direct is None:
                    conn = await engine.connect()
                else:
                    conn = DirectConnection(engine, self._direct)
                    await conn.start()
                self._writing = conn
            try:
                yield conn
            except BaseException:
                self._writing = None
                await asyncio.shield(conn.close())
                raise
        self._after_write()
        await asyncio.sleep(0)

    async def close(self) -> None:
        if self._writing is not None:
            writing, self._writing = self._writing, None
            await writing.close()
        if self._checkpointer is not None:
            await self._checkpointer.close()
        if self._versions is not None:
            self._versions.close()

    def _after_write(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.after_write()


def _configure(dbapi_connection: Any, _record: Any) -> None:
    # Hand transaction control to the "begin" hook below instead of the sqlite3 module's
    # implicit (deferred) BEGIN.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA page_count")
    if cursor.fetchone()[0] == 0:
        # A new file, before WAL mode writes its header: it keeps the pages deletions free in
        # a list that ``reclaim_space`` gives back to the file system a few at a time. Set on
        # new files only: on one with tables it cannot change (only a full VACUUM converts
        # it, docs/design.md), and asking would wait for another process's write lock.
        cursor.execute("PRAGMA auto_vacuum=INCREMENTAL")
    for name, value in PRAGMAS:
        cursor.execute(f"PRAGMA {name}={value}")
    cursor.close()
    driver = dbapi_connection.driver_connection
    if isinstance(driver, sqlite_driver.Connection):
        # Statements run on the loop's thread from here on; a statement that finds the write
        # lock taken waits for it on the connection's thread instead.
        driver.run_inline(busy_timeout_ms=BUSY_TIMEOUT_MS)


def _begin(conn: Connection) -> None:
    mode = conn.get_execution_options().get(_BEGIN_OPTION, "DEFERRED")
    driver = conn.connection.driver_connection
    if isinstance(driver, sqlite_driver.Connection):
        # What the statement below comes to on this driver, without a statement's way
        # through SQLAlchemy (a noticeable share of a one-statement write's CPU). Inside a
        # transaction begun on the driver (DirectWrites.transaction) it is begun already.
        if not driver.holds_transaction():
            driver.hold_begin(f"BEGIN {mode}")
    else:
        conn.exec_driver_sql(f"BEGIN {mode}")


class _DataVersion:
    """One connection that reads ``PRAGMA data_version``, from whichever thread asks."""

    def __init__(self, database: str) -> None:
        self._database = database
        self._lock = threading.Lock()
        self._connection: sqlite3.Connection | None = None

    def read(self) -> int:
        with self._lock:
            if self._connection is None:
                self._connection = sqlite3.connect(
                    self._database,
                    timeout=BUSY_TIMEOUT_MS / 1000,
                    isolation_level=None,
                    check_same_thread=False,
                )
            return int(self._connection.execute("PRAGMA data_version").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None


def _incremental_vacuum(database: str, max_pages: int) -> int | None:
    """Free pages given back by ``incremental_vacuum``; None when the file has no such mode."""
    connection = sqlite3.connect(
        database, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
    )
    try:
        if connection.execute("PRAGMA auto_vacuum").fetchone()[0] != _AUTO_VACUUM_INCREMENTAL:
            return None
        before = connection.execute("PRAGMA freelist_count").fetchone()[0]
        connection.executescript(
            f"BEGIN IMMEDIATE; PRAGMA incremental_vacuum({int(max_pages)}); COMMIT;"
        )
        after = connection.execute("PRAGMA freelist_count").fetchone()[0]
    finally:
        connection.close()
    return int(before) - int(after)


def _write_statement(conn: Connection, statement: Executable, params: dict[str, Any]) -> int:
    # One greenlet for the statement and its commit (see backends.server).
    driver = conn.connection.driver_connection
    with conn.begin():
        if isinstance(driver, sqlite_driver.Connection):
            # BEGIN (held back), the statement and COMMIT in one crossing; the commit below
            # then finds no transaction open and does not cross.
            driver.commit_with_next_statement()
        # (``:memory:`` has SQLAlchemy's own aiosqlite connection: three crossings.)
        return conn.execute(statement, params).rowcount


@functools.lru_cache(maxsize=256)
def _now(plus_s: float) -> ColumnElement[datetime]:
    modifier = f"{plus_s:+.6f} seconds"
    return type_coerce(func.strftime(_NOW_FORMAT, "now", modifier), UTCDateTime())


@functools.cache
def _now_less(parameter: str) -> ColumnElement[datetime]:
    seconds = bindparam(parameter, type_=Float())
    modifier = func.printf("%.6f seconds", -seconds)
    return type_coerce(func.strftime(_NOW_FORMAT, "now", modifier), UTCDateTime())


@functools.cache
def _select_now() -> Select[Any]:
    return select(_now(0.0))
