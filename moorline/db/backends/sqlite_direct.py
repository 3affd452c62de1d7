"""Statements of SQLite's write connection, handed to the driver past SQLAlchemy's execution.

On SQLite a statement costs SQLite a few tens of microseconds; SQLAlchemy's way to it (an
execution context, a cursor wrapper, a result built around the cursor, a greenlet, and for a
one-statement write the transaction's begin and commit) cost about twice that in CPU, the
larger part of a checkpointed step's cost and about a third of a worker's claim and finish
transactions on its event loop.

With :mod:`moorline.db.sqlite_driver`'s connections (the setting ``fast_paths``), the write
connection (:meth:`SQLiteBackend._writing_connection
<moorline.db.backends.sqlite.SQLiteBackend>`) is a
:class:`~moorline.db.backends.direct.DirectConnection` over :class:`DirectWrites`. A
statement's compiled form and its binding are :mod:`moorline.db.backends.direct`'s; here its
SQL goes to the driver, whose ``BEGIN`` held back and ``COMMIT`` asked for go with it as they
would from SQLAlchemy, and errors come back as the same :mod:`sqlalchemy.exc` classes. A
one-statement write (:meth:`DirectWrites.write_alone`) sends its ``BEGIN IMMEDIATE`` and
``COMMIT`` in the same driver call. An executemany (a bulk submission's runs and events) binds
each parameter set the same way and goes to the driver's ``executemany``: SQLAlchemy's own
parameter processing cost more per row than SQLite's insert of it.

SQLAlchemy's path is still taken for what the direct one would skip or could get wrong:

- a statement whose form is None (see :mod:`moorline.db.backends.direct`);
- a statement outside a transaction SQLAlchemy began (its autobegin), a ``text()`` statement
  in a transaction (it may return rows of unknown keys), execution options given with the call;
- an executemany whose parameter sets do not all name the same keys, or that returns rows;
- every statement of a connection with cursor or error event listeners (a tracer that records
  statements, the tests that count them): they see every statement, as without this module.
  That check reads the connection's and the dialect's event ``dispatch``, SQLAlchemy
  internals listed in :data:`moorline.fastpaths.PRIVATE_NAMES`.
"""

import sqlite3
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import Executable
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db import sqlite_driver
from moorline.db.backends.direct import (
    NO_ROWS,
    DirectConnection,
    DirectResult,
    Form,
    Forms,
    bound,
    rows_by_slots,
    text_of,
)

_BEGIN = "BEGIN IMMEDIATE"


class DirectWrites:
    """Compiled forms of statements, and their execution on the driver."""

    def __init__(self, dialect: Dialect) -> None:
        """Compile for ``dialect`` (the engine's, which fixes the parameter style)."""
        self._dialect = dialect
        self._forms = Forms(dialect)

    def prepared(
        self,
        conn: AsyncConnection,
        statement: Executable,
        params: Mapping[str, Any],
        *,
        in_transaction: bool,
        many: bool = False,
    ) -> tuple[sqlite_driver.Connection, Form] | None:
        """``conn``'s driver and ``statement``'s form, if it may go direct now; else None.

        ``in_transaction``: whether SQLAlchemy must have begun a transaction on ``conn`` (a
        statement of a transaction, for :meth:`execute`) or must not have (a one-statement
        write, for :meth:`write_alone`). ``many``: for :meth:`execute_many`, ``params`` being
        the first parameter set.
        """
        driver = self._driver_of(conn, in_transaction=in_transaction)
        if driver is None:
            return None
        form = self._forms.form(statement, params, many)
        if form is None or (in_transaction and form.textual):
            return None
        if many and (
            form.rows is not None
            or form.slots is None
            or any(slot.expanding for slot in form.slots)
        ):
            return None  # rows back, binding only SQLAlchemy does, or lists to expand per set
        return driver, form

    def _driver_of(
        self, conn: AsyncConnection, *, in_transaction: bool
    ) -> sqlite_driver.Connection | None:
        sync = conn.sync_connection
        if sync is None or sync.invalidated:
            return None
        began = sync.in_transaction() or getattr(conn, "in_driver_transaction", False)
        if began != in_transaction:
            return None
        cursor_events = sync.dispatch
        if (
            cursor_events.before_cursor_execute
            or cursor_events.after_cursor_execute
            or sync.dialect.dispatch.handle_error
        ):
            return None
        driver = sync.connection.driver_connection
        return driver if isinstance(driver, sqlite_driver.Connection) else None

    @asynccontextmanager
    async def transaction(self, conn: DirectConnection) -> AsyncIterator[None]:
        """``BEGIN IMMEDIATE`` … ``COMMIT`` on ``conn``'s driver, past SQLAlchemy's own.

        SQLAlchemy's begin and commit each run in a greenlet of their own, with its events
        around them, and cost more than an empty transaction costs SQLite (docs/performance.md,
        "2026-11-30, 08:43-09:50 UTC"). Here the ``BEGIN`` is held on the driver (it goes with
        the first statement) and the driver commits; SQLAlchemy's transaction stays unbegun
        unless a statement takes its path (see the module docstring): it then begins one as
        usual, its ``begin`` hook finding the driver's ``BEGIN`` already held
        (:func:`~.sqlite._begin`), and its commit after the driver's finds nothing left to
        commit. A connection with event listeners, or one SQLAlchemy must reconnect, takes
        SQLAlchemy's way whole.

        On an error the caller closes the connection (``_writing_connection``): the pool's
        reset rolls back whatever is open, a statement still on the thread included.
        """
        driver = self._driver_of(conn, in_transaction=False)
        if driver is None or driver.holds_transaction():
            async with conn.begin():
                yield
            return
        driver.hold_begin(_BEGIN)
        conn.in_driver_transaction = True
        try:
            yield
        finally:
            conn.in_driver_transaction = False
        try:
            await driver.commit()
        except sqlite3.Error as exc:
            raise self._error("COMMIT", (), exc) from exc  # as SQLAlchemy's commit raises it
        if conn.in_transaction():
            await conn.commit()  # SQLAlchemy's, begun by a statement of its way

    async def execute(
        self, driver: sqlite_driver.Connection, form: Form, params: Mapping[str, Any]
    ) -> DirectResult:
        """Run ``form`` in the open transaction: its rows (if any) and rowcount.

        Raises:
            sqlalchemy.exc.DBAPIError: as SQLAlchemy's execution would have raised it.
        """
        sql, arguments = bound(form, params)
        try:
            async with driver.cursor() as cursor:
                await cursor.execute(sql, arguments)
                rows = await cursor.fetchall()
                rowcount = cursor.rowcount
        except sqlite3.Error as exc:
            raise self._error(sql, arguments, exc) from exc
        return DirectResult(NO_ROWS if form.rows is None else form.rows, rows, rowcount)

    async def execute_many(
        self,
        driver: sqlite_driver.Connection,
        form: Form,
        sets: Sequence[Mapping[str, Any]],
    ) -> DirectResult | None:
        """Run ``form`` once per parameter set, in the open transaction: its rowcount.

        None when a set does not bind as the first one does (other keys, a value missing):
        nothing was sent, and SQLAlchemy's path is to run it (and raise its error).

        Raises:
            sqlalchemy.exc.DBAPIError: as SQLAlchemy's execution would have raised it.
        """
        assert form.slots is not None  # prepared(many=True) checked it
        rows = rows_by_slots(form.slots, sets)
        if rows is None:
            return None
        sql = text_of(form, (), sets[0])
        try:
            async with driver.cursor() as cursor:
                await cursor.executemany(sql, rows)
                rowcount = cursor.rowcount
        except sqlite3.Error as exc:
            raise self._error(sql, rows, exc) from exc
        return DirectResult(NO_ROWS, [], rowcount)

    async def write_alone(
        self, driver: sqlite_driver.Connection, form: Form, params: Mapping[str, Any]
    ) -> int:
        """Run ``form`` in a transaction of its own: the rows it changed.

        Raises:
            sqlalchemy.exc.DBAPIError: as SQLAlchemy's execution would have raised it
                (``IntegrityError``, ``OperationalError`` …); nothing was written.
        """
        sql, arguments = bound(form, params)
        try:
            return await driver.write_alone(_BEGIN, sql, arguments)
        except sqlite3.Error as exc:
            raise self._error(sql, arguments, exc) from exc

    def _error(self, sql: str, arguments: Sequence[Any], exc: sqlite3.Error) -> Exception:
        return DBAPIError.instance(sql, arguments, exc, sqlite3.Error, dialect=self._dialect)
