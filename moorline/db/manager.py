"""DatabaseManager: the pools, transactions and retry of one database, whichever it is.

The manager's :class:`~moorline.db.backends.base.Backend` (``db.backend``) makes the pools and
decides how a write transaction begins and how a one-statement write is sent; the manager
hands them out and retries transient failures. ``session()`` only opens and closes.
Repository methods own their (short) transactions through :meth:`DatabaseManager.transaction`
(writes) and :meth:`DatabaseManager.connect` (reads).

A write that is one statement, decided by that statement alone (the fenced step start and
finish), goes through :meth:`DatabaseManager.write_statement` instead: the statement is its own
transaction, sent the cheapest way each backend has (autocommit on the servers, one crossing
to the connection's thread on SQLite).
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from sqlalchemy import Executable, Row
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
)
from sqlalchemy.pool import QueuePool

from moorline.db.backends import Backend, backend_for_driver
from moorline.db.dsn import (
    ConnectTarget,
    DatabaseUnreachable,
    driver_of,
    hide_password,
    parse_target,
)
from moorline.db.failures import is_transient
from moorline.db.health import check_writable
from moorline.db.migrate import ensure_schema
from moorline.errors import ConfigError
from moorline.settings import Settings

logger = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_ATTEMPTS = 3


class DatabaseManager:
    """Owns the engine; hands out connections, transactions and sessions."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        urls = settings.effective_database_urls
        drivers = {driver_of(url) for url in urls}
        if len(drivers) > 1:
            shown = ", ".join(hide_password(url) for url in urls)
            raise ConfigError(f"MOORLINE_DATABASE_URLS mixes database drivers: {shown}")
        (driver,) = drivers
        self.backend: Backend = backend_for_driver(driver, settings.database_pooler)
        server = self.backend.capabilities.server
        if not server and len(urls) > 1:
            raise ConfigError("MOORLINE_DATABASE_URLS: failover needs PostgreSQL or MySQL URLs")
        self.urls = urls
        self.targets: list[ConnectTarget] = [parse_target(url) for url in urls] if server else []
        """The backend's name, for code not yet asking ``backend`` (the run and queue
        repositories)."""
        self.listen_targets: list[ConnectTarget] = self._listen_targets(settings)
        """Where a LISTEN connection goes (``MOORLINE_LISTEN_URL``, else the database URLs
        where a session keeps state); empty when LISTEN has nowhere to go."""
        self._pools = self.backend.create_pools(settings, urls[0], self.targets)
        self.engine: AsyncEngine = self._pools.main
        self._sessions = async_sessionmaker(self.engine, expire_on_commit=False)

    def _listen_targets(self, settings: Settings) -> list[ConnectTarget]:
        if settings.listen_url is None:
            # Behind PgBouncer a LISTEN would stay on a server session the client leaves.
            return self.targets if self.backend.capabilities.session_state else []
        if not self.backend.capabilities.listen_notify:
            raise ConfigError(
                "MOORLINE_LISTEN_URL is for PostgreSQL's LISTEN/NOTIFY, "
                f"and the database is {self.backend.name}"
            )
        urls = [url.strip() for url in settings.listen_url.split(",") if url.strip()]
        if not urls:
            raise ConfigError("MOORLINE_LISTEN_URL is set but names no URL")
        for url in urls:
            if driver_of(url) != "postgres":
                shown = hide_password(url)
                raise ConfigError(f"MOORLINE_LISTEN_URL {shown!r} is not a PostgreSQL URL")
        return [parse_target(url) for url in urls]

    @property
    def display_url(self) -> str:
        """The primary URL with its password hidden."""
        return hide_password(self.urls[0])

    async def initialize(self) -> None:
        """Prepare the database: its schema, then a write probe.

        The schema is created on SQLite and its version checked elsewhere; the probe makes a
        database that refuses writes fail the start rather than every run.

        Raises:
            SchemaOutOfDate: the schema is behind the code.
            BackendUnavailable: the database cannot be reached, or refuses writes (a read-only
                file or node, no permission, a full disk); one line saying why.
        """
        await ensure_schema(self)
        await check_writable(self)

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[AsyncConnection]:
        """A connection for reads; ``begin()`` on it opens a deferred (read) transaction."""
        async with self.engine.connect() as conn:
            yield conn

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncConnection]:
        """One write transaction, committed on exit, rolled back on error.

        Begun as the backend begins writes (SQLite: ``IMMEDIATE``, in this process's writer
        queue, so ``busy_timeout`` applies).
        """
        async with self.backend.transaction(self._pools) as conn:
            yield conn

    @asynccontextmanager
    async def write_transaction(self) -> AsyncIterator[AsyncConnection]:
        """One write transaction of the dispatch and fenced writes: :meth:`transaction`.

        These writes need READ COMMITTED on the servers, so a statement after a lock wait sees
        what the previous lock holder committed (MySQL's default REPEATABLE READ could read an
        older snapshot, and a tenant cap or fence checked against it could be wrong). Every
        pooled connection is set to it once, when it connects (see :mod:`.backends.server`), rather
        than per transaction: on MySQL setting and resetting it cost two round trips each
        time. On SQLite ``BEGIN IMMEDIATE`` serialises writers instead.
        """
        async with self.transaction() as conn:
            yield conn

    async def commit_with_next_statement(self, conn: AsyncConnection) -> None:
        """Let the next statement on ``conn`` carry its transaction's commit, where it can.

        For a write transaction's last statement, executed once (not an ``executemany``
        SQLAlchemy may split). Nothing may run in the transaction after that statement. Only
        MariaDB saves a round trip this way; elsewhere it changes nothing.
        """
        await self.backend.commit_with_next_statement(conn)

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
        return await self.backend.write_statement(self._pools, statement, params)

    async def write_statement_rows(
        self, statement: Executable, parameters: Mapping[str, Any] | None = None
    ) -> list[Row[Any]]:
        """As :meth:`write_statement`, for a statement with ``RETURNING``: its rows.

        PostgreSQL and MariaDB only (SQLite's one-crossing path reports the rowcount alone).
        """
        params = {} if parameters is None else dict(parameters)
        return await self.backend.write_statement_rows(self._pools, statement, params)

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
        return self._pools.all

    def pool_usage(self) -> tuple[int, int]:
        """(connections checked out now, connections the pool keeps) in this process."""
        pool = self.engine.sync_engine.pool
        # QueuePool reports both; SQLite's StaticPool (in-memory) and NullPool report neither.
        checked_out = pool.checkedout() if isinstance(pool, QueuePool) else 0
        size = pool.size() if isinstance(pool, QueuePool) else 1
        return checked_out, size

    async def reclaim_space(self, max_pages: int) -> int:
        """Pages freed by deletions given back to the file system (SQLite; 0 elsewhere)."""
        return await self.backend.reclaim_space(self._pools, max_pages)

    async def data_version(self) -> int | None:
        """Changes whenever another connection commits a write (SQLite); None elsewhere."""
        return await self.backend.data_version()

    def sqlite_wal_bytes(self) -> int | None:
        """Size of the SQLite write-ahead log file; None for other databases and in-memory."""
        return self.backend.wal_bytes()

    async def dispose(self) -> None:
        """Close every pooled connection (after the backend's background work has ended)."""
        await self.backend.close()
        for engine in self._pools.all:
            await engine.dispose()
