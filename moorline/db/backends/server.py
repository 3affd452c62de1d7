"""What PostgreSQL and MySQL/MariaDB share: a failover pool, and one-statement autocommit writes.

A pool's new connections come from the primary-first failover creator of
:mod:`moorline.db.dsn`. A checkout costs no round trip (see :func:`_drop_closed`), nor does
returning a connection with no transaction open.

A write that one statement decides goes out in autocommit: one round trip instead of
``BEGIN``, the statement and ``COMMIT``. Each subclass says where those connections come
from (:meth:`ServerBackend.autocommit_target`).
"""

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Executable, Row, event
from sqlalchemy.engine import Engine, ExceptionContext
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.util import greenlet_spawn

from moorline.db.backends.base import Backend, Pools
from moorline.db.dsn import ConnectTarget, make_failover_creator
from moorline.db.failures import is_read_only_error
from moorline.settings import Settings


class ServerBackend(Backend):
    """A database server reached through a pool over failover targets."""

    url_scheme: str
    """SQLAlchemy's ``dialect+driver://`` prefix of the pool's URL."""

    @property
    def write_isolation_level(self) -> str | None:
        """READ COMMITTED: a statement after a lock wait sees what the lock holder committed.

        Under MySQL's default REPEATABLE READ a claim's count would read the snapshot taken by
        the transaction's first SELECT, from before the wait, and a cap could be exceeded.
        PostgreSQL defaults to READ COMMITTED already; it is set so a server-wide default
        cannot change it.
        """
        return "READ COMMITTED"

    def create_engine(
        self, settings: Settings, targets: Sequence[ConnectTarget], *, autocommit: bool
    ) -> AsyncEngine:
        """A pool over the failover targets; with ``autocommit`` its connections stay there."""
        isolation = self.write_isolation_level
        engine = create_async_engine(
            self.url_scheme,
            async_creator=make_failover_creator(list(targets), fast_paths=settings.fast_paths),
            pool_size=settings.db_pool_size,
            max_overflow=settings.db_max_overflow,
            pool_timeout=settings.db_pool_timeout,
            pool_recycle=int(settings.db_pool_recycle),
            # Connections are checked at checkout below, without a round trip; the public
            # drivers' (fast_paths off) by SQLAlchemy's ping, as they have no is_closed().
            pool_pre_ping=settings.db_pool_pre_ping and not settings.fast_paths,
            isolation_level="AUTOCOMMIT" if autocommit else isolation,
        )
        if settings.db_pool_pre_ping and settings.fast_paths:
            event.listen(engine.sync_engine, "checkout", _drop_closed)
        if autocommit and isolation is not None:
            event.listen(engine.sync_engine, "connect", _session_isolation(isolation))
        event.listen(engine.sync_engine, "handle_error", discard_read_only)
        return engine

    def autocommit_target(self, pools: Pools) -> tuple[Engine, bool]:
        """The engine of one-statement writes, and whether to switch a checkout to autocommit."""
        return pools.main.sync_engine, True

    async def write_statement(
        self, pools: Pools, statement: Executable, params: dict[str, Any]
    ) -> int:
        engine, switch = self.autocommit_target(pools)
        return await greenlet_spawn(_autocommit_write_statement, engine, switch, statement, params)

    async def write_statement_rows(
        self, pools: Pools, statement: Executable, params: dict[str, Any]
    ) -> list[Row[Any]]:
        engine, switch = self.autocommit_target(pools)
        return await greenlet_spawn(
            _autocommit_write_statement_rows, engine, switch, statement, params
        )


def _drop_closed(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
    # SQLAlchemy's pre-ping is a round trip on every checkout (three on asyncpg: BEGIN, ";",
    # ROLLBACK; a COM_PING on aiomysql), a large share of a short transaction's cost. What it
    # catches, a connection the server closed (a restart, a failover, a terminated or killed
    # backend), both drivers already know without asking: the server's FIN, FATAL or error
    # packet marks the connection closed as soon as the event loop reads it, before the next
    # checkout (asyncpg's is_closed(); aiomysql's reader state, as moorline.db.mysql_driver
    # exposes it). Raising DisconnectionError here makes the pool discard it and check out
    # another (a new one from the failover creator). A connection lost between this check and
    # its statement fails that statement as a disconnect, which invalidates the pool, and
    # with_retry retries it (a pinged connection can die just after its ping too); a node
    # demoted under a live connection is caught by discard_read_only, which the ping never
    # caught (``;`` succeeds on a standby).
    if dbapi_connection.driver_connection.is_closed():
        raise DisconnectionError("the server closed this pooled connection")


def _session_isolation(isolation: str) -> Any:
    def _set_isolation(dbapi_connection: Any, _record: Any) -> None:
        # Autocommit replaces the engine's isolation level, and each statement is a
        # transaction of the session's level: make that the write level too, so a statement
        # behaves as it would in a write transaction.
        cursor = dbapi_connection.cursor()
        cursor.execute(f"SET SESSION TRANSACTION ISOLATION LEVEL {isolation}")
        cursor.close()

    return _set_isolation


def discard_read_only(context: ExceptionContext) -> None:
    """The pools' ``handle_error`` hook: a node that refuses writes is a lost connection."""
    # A pooled connection whose node was demoted under it refuses writes: treat that as a lost
    # connection, so the pool drops it (and every connection of its generation) and the next
    # checkout goes through the failover creator, which skips read-only nodes. with_retry then
    # retries the work on the new primary.
    if is_read_only_error(context.original_exception):
        context.is_disconnect = True


# The bodies of write_statement, each run as one greenlet: checkout, statement, commit and
# checkin. Through AsyncConnection they were three (its start, run_sync and close are a
# greenlet_spawn each), and the two extra greenlets cost a large share of a one-statement
# write's CPU. greenlet_spawn is how SQLAlchemy's asyncio extension itself runs sync code;
# nothing public runs a function over an engine in one greenlet.


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
