"""DatabaseManager: one async engine per process over SQLite, PostgreSQL or MySQL/MariaDB.

- SQLite (aiosqlite): WAL, ``synchronous=NORMAL``, 64 MB page cache, foreign keys and a 5 s busy
  timeout on every connection. Write transactions begin ``IMMEDIATE``: a deferred transaction
  that reads and then writes fails with ``SQLITE_BUSY`` at once, without honouring
  ``busy_timeout``, when another writer got there first. ``:memory:`` lives on one static
  connection because every new connection would see an empty database.
- PostgreSQL (asyncpg) and MySQL/MariaDB (aiomysql, as :mod:`moorline.db.mysql_driver`
  adapts it): a pool whose new connections come from the primary-first failover creator of
  :mod:`moorline.db.dsn`. A checkout costs no round trip on either (see ``_drop_closed``), nor
  does returning a connection with no transaction open.

``session()`` only opens and closes. Repository methods own their (short) transactions through
:meth:`DatabaseManager.transaction` (writes) and :meth:`DatabaseManager.connect` (reads).

A write that is one statement, decided by that statement alone (the fenced step start and
finish), goes through :meth:`DatabaseManager.write_statement` instead: the statement is its own
transaction, sent the cheapest way each backend has. On PostgreSQL and MariaDB that is
autocommit: one round trip instead of ``BEGIN``, the statement and ``COMMIT``. PostgreSQL's
pooled connections switch to autocommit and back without a round trip (asyncpg's transaction
mode is client-side), so they serve it from the one pool; aiomysql's switch costs three round
trips each way, so MariaDB gets a second pool whose connections stay in autocommit. On SQLite
``BEGIN IMMEDIATE``, the statement and ``COMMIT`` cross to the connection's thread once
(:meth:`moorline.db.sqlite_driver.Connection.commit_with_next_statement`).
"""

import asyncio
import logging
import os
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from sqlalchemy import Executable, Row, event
from sqlalchemy.dialects.sqlite.aiosqlite import SQLiteDialect_aiosqlite
from sqlalchemy.engine import Connection, Engine, ExceptionContext, make_url
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.pool import QueuePool, StaticPool
from sqlalchemy.util import greenlet_spawn

from moorline.db import mysql_driver, sqlite_driver
from moorline.db.backends import Backend, backend_for
from moorline.db.dialects import (
    DialectName,
    is_read_only_error,
    is_transient,
    write_isolation_level,
)
from moorline.db.dsn import (
    ConnectTarget,
    DatabaseUnreachable,
    driver_of,
    hide_password,
    make_failover_creator,
    parse_target,
)
from moorline.errors import ConfigError
from moorline.settings import Settings

logger = logging.getLogger(__name__)

T = TypeVar("T")

SQLITE_BUSY_TIMEOUT_MS = 5000
SQLITE_CHECKPOINT_WAL_BYTES = 4 * 1024 * 1024
"""Growth of the WAL past which the checkpointer copies the log back into the database file.

About SQLite's own default (1,000 pages of 4 KiB)."""
SQLITE_TRUNCATE_WAL_BYTES = 64 * 1024 * 1024
"""WAL size past which the checkpointer also waits (up to a second) for readers to move on.

A PASSIVE checkpoint never waits, so overlapping readers that never all finish at once (SSE
streams, dashboards) can keep the log from ever starting over, and it grows without bound
(RELIABILITY.md G3). Past this size the checkpoint is TRUNCATE: it waits for the readers of
older snapshots, then empties the file."""
SQLITE_WAL_KEPT_BYTES = 1024 * 1024
"""``journal_size_limit``: what the WAL file is cut back to when the log starts over after a
checkpoint (the first commit of the new log cuts it to the larger of this and what it wrote).

SQLite otherwise reuses the file from its start and never shrinks it, and its size, which the
checkpointer goes by, would no longer say how much log there is. Below
:data:`SQLITE_CHECKPOINT_WAL_BYTES`, so that a file cut back is never taken for a log due for a
checkpoint; not zero, so that the next megabyte of log overwrites rather than grows the file."""
SQLITE_PRAGMAS = (
    ("journal_mode", "WAL"),
    ("synchronous", "NORMAL"),
    ("cache_size", "-64000"),
    ("foreign_keys", "ON"),
    ("busy_timeout", str(SQLITE_BUSY_TIMEOUT_MS)),
    # No checkpoint inside a commit: the manager's checkpointer does them (see _checkpointed).
    ("wal_autocheckpoint", "0"),
    ("journal_size_limit", str(SQLITE_WAL_KEPT_BYTES)),
)

RETRY_ATTEMPTS = 3
_BEGIN_OPTION = "moorline_begin"


class DatabaseManager:
    """Owns the engine; hands out connections, transactions and sessions."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        urls = settings.effective_database_urls
        drivers = {driver_of(url) for url in urls}
        if len(drivers) > 1:
            shown = ", ".join(hide_password(url) for url in urls)
            raise ConfigError(f"MOORLINE_DATABASE_URLS mixes database drivers: {shown}")
        if "sqlite" in drivers and len(urls) > 1:
            raise ConfigError("MOORLINE_DATABASE_URLS: failover needs PostgreSQL or MySQL URLs")
        self.urls = urls
        self.targets: list[ConnectTarget] = (
            [] if "sqlite" in drivers else [parse_target(url) for url in urls]
        )
        self.dialect: DialectName = (
            "sqlite" if "sqlite" in drivers else "postgresql" if "postgres" in drivers else "mysql"
        )
        self.backend: Backend = backend_for(self.dialect)
        self.engine = self._create_engine()
        # MariaDB/MySQL: connections that stay in autocommit, for write_statement.
        self._autocommit_engine = (
            self._create_server_engine(autocommit=True) if self.dialect == "mysql" else None
        )
        self._sessions = async_sessionmaker(self.engine, expire_on_commit=False)
        # SQLite has one writer at a time. Queueing this process's writers here, in order,
        # replaces a pile-up in SQLite's busy handler, which sleeps up to 100 ms between
        # tries: without it, two tasks that want the write lock at once cost the second one
        # tens of milliseconds. busy_timeout still covers writers in other processes.
        self._sqlite_writer = asyncio.Lock()
        self._wal_path = self._sqlite_wal_path()
        self._checkpointer: asyncio.Task[bool] | None = None
        self._wal_checkpointed_bytes = 0
        """The WAL's size when the last checkpoint that copied all the log it found began."""

    @property
    def display_url(self) -> str:
        """The primary URL with its password hidden."""
        return hide_password(self.urls[0])

    def _create_engine(self) -> AsyncEngine:
        url = self.urls[0]
        if driver_of(url) == "sqlite":
            return self._create_sqlite_engine(url)
        return self._create_server_engine(autocommit=False)

    def _create_server_engine(self, *, autocommit: bool) -> AsyncEngine:
        """A pool over the failover targets; with ``autocommit`` its connections stay there."""
        s = self._settings
        dialect_url = (
            "postgresql+asyncpg://" if self.targets[0].driver == "postgres" else "mysql+aiomysql://"
        )
        isolation = write_isolation_level(self.dialect)
        engine = create_async_engine(
            dialect_url,
            async_creator=make_failover_creator(self.targets),
            pool_size=s.db_pool_size,
            max_overflow=s.db_max_overflow,
            pool_timeout=s.db_pool_timeout,
            pool_recycle=int(s.db_pool_recycle),
            # Connections are checked at checkout below, without a round trip.
            pool_pre_ping=False,
            isolation_level="AUTOCOMMIT" if autocommit else isolation,
        )

        if s.db_pool_pre_ping:

            @event.listens_for(engine.sync_engine, "checkout")
            def _drop_closed(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
                # SQLAlchemy's pre-ping is a round trip on every checkout: three on asyncpg
                # (BEGIN, ";", ROLLBACK), a quarter of a one-run submit's CPU, and a COM_PING
                # on aiomysql, one of a claim's seven. What it catches, a connection the
                # server closed (a restart, a failover, a terminated or killed backend), both
                # drivers already know without asking: the server's FIN, FATAL or error
                # packet marks the connection closed as soon as the event loop reads it,
                # before the next checkout (asyncpg's is_closed(); aiomysql's reader state, as
                # moorline.db.mysql_driver exposes it). Raising DisconnectionError here makes
                # the pool discard it and check out another (a new one from the failover
                # creator). The rest is as with the ping: a connection lost between this check
                # and its statement fails that statement as a disconnect, which invalidates
                # the pool, and with_retry retries it (a pinged connection can die just after
                # its ping too); a node demoted under a live connection is caught by
                # _discard_read_only below, which the ping never caught (``;`` succeeds on a
                # standby).
                if dbapi_connection.driver_connection.is_closed():
                    raise DisconnectionError("the server closed this pooled connection")

        if autocommit and isolation is not None:

            @event.listens_for(engine.sync_engine, "connect")
            def _read_committed(dbapi_connection: Any, _record: Any) -> None:
                # Autocommit replaces the engine's isolation level, and each statement is a
                # transaction of the session's level: make that READ COMMITTED too, so a
                # statement behaves as it would in write_transaction().
                cursor = dbapi_connection.cursor()
                cursor.execute(f"SET SESSION TRANSACTION ISOLATION LEVEL {isolation}")
                cursor.close()

        @event.listens_for(engine.sync_engine, "handle_error")
        def _discard_read_only(context: ExceptionContext) -> None:
            # A pooled connection whose node was demoted under it refuses writes: treat that
            # as a lost connection, so the pool drops it (and every connection of its
            # generation) and the next checkout goes through the failover creator, which
            # skips read-only nodes. with_retry then retries the work on the new primary.
            if is_read_only_error(context.original_exception):
                context.is_disconnect = True

        return engine

    def _create_sqlite_engine(self, url: str) -> AsyncEngine:
        parsed = make_url(url)
        if parsed.drivername != "sqlite+aiosqlite":
            parsed = parsed.set(drivername="sqlite+aiosqlite")
        in_memory = parsed.database in (None, "", ":memory:")
        kwargs: dict[str, Any]
        if in_memory:
            kwargs = {"poolclass": StaticPool, "connect_args": {"check_same_thread": False}}
        else:
            connect_args = SQLiteDialect_aiosqlite().create_connect_args(parsed)
            kwargs = {"async_creator": sqlite_driver.connector(*connect_args)}
        engine = create_async_engine(parsed, **kwargs)

        @event.listens_for(engine.sync_engine, "connect")
        def _configure(dbapi_connection: Any, _record: Any) -> None:
            # Hand transaction control to the "begin" hook below instead of the sqlite3
            # module's implicit (deferred) BEGIN.
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            for name, value in SQLITE_PRAGMAS:
                cursor.execute(f"PRAGMA {name}={value}")
            cursor.close()
            driver = dbapi_connection.driver_connection
            if isinstance(driver, sqlite_driver.Connection):
                # Statements run on the loop's thread from here on; a statement that finds
                # the write lock taken waits for it on the connection's thread instead.
                driver.run_inline(busy_timeout_ms=SQLITE_BUSY_TIMEOUT_MS)

        @event.listens_for(engine.sync_engine, "begin")
        def _begin(conn: Connection) -> None:
            mode = conn.get_execution_options().get(_BEGIN_OPTION, "DEFERRED")
            driver = conn.connection.driver_connection
            if isinstance(driver, sqlite_driver.Connection):
                # What the statement below comes to on this driver, without a statement's
                # way through SQLAlchemy (an eighth of a one-statement write's CPU).
                driver.hold_begin(f"BEGIN {mode}")
            else:
                conn.exec_driver_sql(f"BEGIN {mode}")

        return engine

    async def initialize(self) -> None:
        """Prepare the database: create the schema on SQLite, check its version elsewhere."""
        from moorline.db.migrate import ensure_schema

        await ensure_schema(self)

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[AsyncConnection]:
        """A connection for reads; ``begin()`` on it opens a deferred (read) transaction."""
        async with self.engine.connect() as conn:
            yield conn

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncConnection]:
        """One write transaction, committed on exit, rolled back on error.

        On SQLite it begins ``IMMEDIATE``, taking the write lock up front so ``busy_timeout``
        applies; a deferred read-then-write transaction would fail with SQLITE_BUSY instead.
        """
        if self.dialect != "sqlite":
            async with self.engine.connect() as conn, conn.begin():
                yield conn
            return
        async with self._sqlite_writer, self.engine.connect() as conn:
            await conn.execution_options(**{_BEGIN_OPTION: "IMMEDIATE"})
            async with conn.begin():
                yield conn
        self._checkpoint_if_due()

    @asynccontextmanager
    async def write_transaction(self) -> AsyncIterator[AsyncConnection]:
        """One write transaction of the dispatch and fenced writes: :meth:`transaction`.

        These writes need READ COMMITTED on the servers, so a statement after a lock wait sees
        what the previous lock holder committed (MySQL's default REPEATABLE READ could read an
        older snapshot, and a tenant cap or fence checked against it could be wrong). Every
        pooled connection is set to it once, when it connects (see ``_create_engine``), rather
        than per transaction: on MySQL setting and resetting it cost two round trips each
        time. On SQLite ``BEGIN IMMEDIATE`` serialises writers instead.
        """
        async with self.transaction() as conn:
            yield conn

    async def commit_with_next_statement(self, conn: AsyncConnection) -> None:
        """Let the next statement on ``conn`` carry its transaction's commit, where it can.

        For a write transaction's last statement, executed once (not an ``executemany``
        SQLAlchemy may split): MariaDB sends ``COMMIT`` in the same query
        (:meth:`moorline.db.mysql_driver.Connection.commit_with_next_statement`), a round trip
        less; the transaction's own commit then sends nothing. Nothing may run in the
        transaction after that statement. Elsewhere it changes nothing: PostgreSQL's commit
        has a round trip of its own, and SQLite's statements run inline.
        """
        if self.dialect != "mysql":
            return
        driver = (await conn.get_raw_connection()).driver_connection
        if isinstance(driver, mysql_driver.Connection):
            driver.commit_with_next_statement()

    async def write_statement(
        self, statement: Executable, parameters: Mapping[str, Any] | None = None
    ) -> int:
        """Run one write ``statement`` as a transaction of its own; return its rowcount.

        For a write that one statement decides entirely (its conditions, its locks): the
        statement commits as it ends, sent the cheapest way the backend has (see the module
        docstring), so it costs one round trip or thread crossing instead of two or three.
        It is exactly as atomic and as isolated as the same statement alone in
        :meth:`write_transaction`: one statement is one transaction either way, READ COMMITTED
        on the servers and under the write lock on SQLite.

        A caller that must look further when nothing matched does so in a transaction of its
        own afterwards: this one has committed by then.
        """
        params = {} if parameters is None else dict(parameters)
        if self.dialect == "sqlite":
            async with self._sqlite_writer:
                changed = await greenlet_spawn(
                    _sqlite_write_statement, self.engine.sync_engine, statement, params
                )
            self._checkpoint_if_due()
            # Run inline, the write never suspended: let the loop run the rest of its ready
            # work once, as a write to a server does while it waits for the reply. Without it
            # a workflow of many cheap steps would hold the loop (heartbeats, other runs, the
            # API) for as long as it kept writing.
            await asyncio.sleep(0)
            return changed
        engine, switch = self._autocommit_target()
        return await greenlet_spawn(_autocommit_write_statement, engine, switch, statement, params)

    async def write_statement_rows(
        self, statement: Executable, parameters: Mapping[str, Any] | None = None
    ) -> list[Row[Any]]:
        """As :meth:`write_statement`, for a statement with ``RETURNING``: its rows.

        PostgreSQL and MariaDB only (SQLite's one-crossing path reports the rowcount alone).
        """
        params = {} if parameters is None else dict(parameters)
        if self.dialect == "sqlite":
            raise NotImplementedError("write_statement_rows: not on SQLite")
        engine, switch = self._autocommit_target()
        return await greenlet_spawn(
            _autocommit_write_statement_rows, engine, switch, statement, params
        )

    def _autocommit_target(self) -> tuple[Engine, bool]:
        """The engine of one-statement writes on the servers, and whether to switch to autocommit.

        MariaDB: its autocommit pool, already there. PostgreSQL: the one pool, switched per
        checkout (client-side only: asyncpg's transaction mode is the client's).
        """
        if self._autocommit_engine is not None:
            return self._autocommit_engine.sync_engine, False
        return self.engine.sync_engine, True

    @asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        """An ORM session that is only opened and closed here; callers own transactions."""
        session = self._sessions()
        try:
            yield session
        finally:
            await session.close()

    async def with_retry(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn`` and retry it on transient disconnects: 3 retries, 1 s → 2 s → 4 s.

        Transient means a lost or refused connection, including no failover address answering
        (:class:`~moorline.db.dsn.DatabaseUnreachable`).

        Only for reads and idempotent writes: ``fn`` is called again from the start and must
        open its own connection or transaction each time (so each attempt gets a fresh one).
        Work that chains several transactions must not be retried as a whole.
        """
        delay = self._settings.db_retry_base
        for retry in range(RETRY_ATTEMPTS + 1):
            try:
                return await fn()
            except Exception as exc:
                # No address answering is the outage a retry is for (a restart, a failover in
                # progress); SQLAlchemy passes the creator's error through unwrapped, so
                # is_transient's OperationalError check alone would not see it.
                retryable = is_transient(exc) or isinstance(exc, DatabaseUnreachable)
                if retry == RETRY_ATTEMPTS or not retryable:
                    raise
                logger.warning(
                    "transient database error, retry %d/%d in %.1fs: %s",
                    retry + 1,
                    RETRY_ATTEMPTS,
                    delay,
                    type(exc).__name__,
                )
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    @property
    def engines(self) -> tuple[AsyncEngine, ...]:
        """Every engine this manager sends statements through (MariaDB: two, else one)."""
        if self._autocommit_engine is None:
            return (self.engine,)
        return (self.engine, self._autocommit_engine)

    def pool_usage(self) -> tuple[int, int]:
        """(connections checked out now, connections the pool keeps) in this process."""
        pool = self.engine.sync_engine.pool
        # QueuePool reports both; SQLite's StaticPool (in-memory) and NullPool report neither.
        checked_out = pool.checkedout() if isinstance(pool, QueuePool) else 0
        size = pool.size() if isinstance(pool, QueuePool) else 1
        return checked_out, size

    def sqlite_wal_bytes(self) -> int | None:
        """Size of the SQLite write-ahead log file; None for other databases and in-memory."""
        if self._wal_path is None:
            return None
        try:
            return os.path.getsize(self._wal_path)
        except FileNotFoundError:
            return 0  # checkpointed away, or not written yet

    def _sqlite_wal_path(self) -> str | None:
        if self.dialect != "sqlite":
            return None
        database = self.engine.url.database
        if database in (None, "", ":memory:"):
            return None
        return f"{database}-wal"

    def _checkpoint_if_due(self) -> None:
        """After a write: start a checkpoint when the WAL has grown by its size since the last.

        SQLite's automatic checkpoint runs inside the commit that crosses the threshold, which
        then takes as long as copying the log and syncing the database file (40-65 ms on this
        project's machines), while it holds this process's write queue (``_sqlite_writer``)
        and, with statements run inline, the event loop. Here the same PASSIVE checkpoint runs
        on a thread of its own, over a connection of its own: nobody waits for it, and it
        never blocks a reader or a writer (PASSIVE copies what no reader still needs and
        stops). The stat is a couple of microseconds; the write it follows, a hundred or more.

        Due when the file has grown by :data:`SQLITE_CHECKPOINT_WAL_BYTES` since the last
        checkpoint that copied all the log it found began, not whenever it is that large:
        under a steady stream of writes the log never starts over (a checkpoint never ends with
        nothing written since it began), so the file stays past the size, and the checkpointer
        ran back to back, each time for the few commits since the one before (822 checkpoints
        for 9,600 triggers, 0.1 ms of CPU per trigger on the core the event loop shares).
        A checkpoint that fell short (a reader of an older snapshot) is tried again after the
        next write, as before; the file reaching :data:`SQLITE_TRUNCATE_WAL_BYTES` still
        empties it.
        """
        if self._wal_path is None:
            return
        checkpointer = self._checkpointer
        if checkpointer is not None:
            if not checkpointer.done():
                return
            self._checkpointer = None
            if checkpointer.cancelled() or checkpointer.exception() or not checkpointer.result():
                # Fell short (a reader on an older snapshot): try again after the next write.
                self._wal_checkpointed_bytes = 0
        try:
            size = os.path.getsize(self._wal_path)
        except FileNotFoundError:
            return
        if size < self._wal_checkpointed_bytes:
            # The log started over and its file was cut back (SQLITE_WAL_KEPT_BYTES).
            self._wal_checkpointed_bytes = 0
        if size - self._wal_checkpointed_bytes >= SQLITE_CHECKPOINT_WAL_BYTES:
            database = self._wal_path.removesuffix("-wal")
            truncate = size >= SQLITE_TRUNCATE_WAL_BYTES
            self._wal_checkpointed_bytes = size
            self._checkpointer = asyncio.create_task(
                asyncio.to_thread(_checkpoint, database, truncate=truncate),
                name="moorline-sqlite-checkpoint",
            )

    async def dispose(self) -> None:
        """Close every pooled connection (after a checkpoint in progress has ended)."""
        if self._checkpointer is not None:
            await asyncio.gather(self._checkpointer, return_exceptions=True)
        await self.engine.dispose()
        if self._autocommit_engine is not None:
            await self._autocommit_engine.dispose()


def _checkpoint(database: str, *, truncate: bool) -> bool:
    """Copy the WAL back into ``database``: PASSIVE, or TRUNCATE (see the constants).

    Returns:
        Whether it copied all the log there was when it began (False: a reader of an older
        snapshot held some back, or the checkpoint could not run).
    """
    mode, timeout_s = ("TRUNCATE", 1.0) if truncate else ("PASSIVE", 0.0)
    try:
        connection = sqlite3.connect(database, timeout=timeout_s, isolation_level=None)
        try:
            busy, logged, copied = connection.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
        finally:
            connection.close()
    except sqlite3.Error as exc:
        # Another process checkpointing at this moment, say; the next write tries again.
        logger.debug("SQLite checkpoint skipped: %s", exc)
        return False
    return bool(busy == 0 and logged == copied)


# The bodies of write_statement, each run as one greenlet: checkout, statement, commit and
# checkin. Through AsyncConnection they were three (its start, run_sync and close are a
# greenlet_spawn each), and those two extra greenlets with their AsyncConnection cost about
# 100 us of CPU per write on SQLite, 40% of the write (tests/contract + bench/step_cpu.py).
# greenlet_spawn is how SQLAlchemy's asyncio extension itself runs sync code; nothing public
# runs a function over an engine in one greenlet.


def _sqlite_write_statement(engine: Engine, statement: Executable, params: dict[str, Any]) -> int:
    with engine.connect() as conn:
        conn.execution_options(**{_BEGIN_OPTION: "IMMEDIATE"})
        driver = conn.connection.driver_connection
        with conn.begin():
            if isinstance(driver, sqlite_driver.Connection):
                # BEGIN (held back), the statement and COMMIT in one crossing; the commit below
                # then finds no transaction open and does not cross.
                driver.commit_with_next_statement()
            # (``:memory:`` has SQLAlchemy's own aiosqlite connection: three crossings.)
            return conn.execute(statement, params).rowcount


def _autocommit_write_statement(
    engine: Engine, switch: bool, statement: Executable, params: dict[str, Any]
) -> int:
    with engine.connect() as conn:
        if switch:
            # The pool switches the connection back (client-side on asyncpg) as it returns.
            conn.execution_options(isolation_level="AUTOCOMMIT")
        # The statement commits as it ends.
        return conn.execute(statement, params).rowcount


def _autocommit_write_statement_rows(
    engine: Engine, switch: bool, statement: Executable, params: dict[str, Any]
) -> list[Row[Any]]:
    # As _autocommit_write_statement, returning the statement's rows.
    with engine.connect() as conn:
        if switch:
            conn.execution_options(isolation_level="AUTOCOMMIT")
        return list(conn.execute(statement, params))
