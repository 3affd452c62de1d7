"""One-statement writes on SQLite, handed to the driver past SQLAlchemy's execution layer.

A checkpointed step is two one-statement writes, each its own transaction
(:meth:`~moorline.db.manager.DatabaseManager.write_statement`): its start and its outcome. On
SQLite the statement itself costs SQLite a few tens of microseconds; SQLAlchemy's way to it
(an execution context, a cursor wrapper, the transaction's begin and commit, a greenlet) cost
more than twice that in CPU, the larger part of a step's cost on the worker's loop.

With :mod:`moorline.db.sqlite_driver`'s connections (the setting ``fast_paths``), a statement is
compiled once per statement object and parameter names, its parameters bound through the
compiled form's public :meth:`~sqlalchemy.sql.compiler.SQLCompiler.construct_expanded_state`
(expanding ``IN`` lists, the types' bind processors) as SQLAlchemy's execution binds them, and
sent with its ``BEGIN IMMEDIATE`` and ``COMMIT`` as one driver call. Errors come back as the
same :mod:`sqlalchemy.exc` classes, so callers catch what they caught before.

SQLAlchemy's path is still taken for what the direct one would skip:

- a statement that needs Python-side column defaults computed for it, or returns rows;
- a connection with cursor or error event listeners (a tracer that records statements, the
  tests that count them): they see every statement, as they would without this module. That
  check reads the connection's and the dialect's event ``dispatch``, SQLAlchemy internals
  listed in :data:`moorline.fastpaths.PRIVATE_NAMES`.
"""

import sqlite3
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Executable
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ClauseElement

from moorline.db import sqlite_driver

_MAX_FORMS = 512
"""Compiled statements kept; all are forgotten at once past it (statements are built once)."""

_BEGIN = "BEGIN IMMEDIATE"

_Key = tuple[int, tuple[str, ...]]


class DirectWrites:
    """Compiled forms of one-statement writes, and their execution on the driver."""

    def __init__(self, dialect: Dialect) -> None:
        """Compile for ``dialect`` (the engine's, which fixes the parameter style)."""
        self._dialect = dialect
        self._forms: dict[_Key, tuple[Executable, _Form | None]] = {}

    def driver_of(self, conn: AsyncConnection) -> sqlite_driver.Connection | None:
        """``conn``'s driver connection, if a direct write may use it now; else None."""
        sync = conn.sync_connection
        if sync is None or sync.invalidated or sync.in_transaction():
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

    def compiled(self, statement: Executable, params: Mapping[str, Any]) -> "_Form | None":
        """``statement``'s compiled form for these parameter names; None: not a direct write."""
        names = tuple(sorted(params))
        key = (id(statement), names)
        found = self._forms.get(key)
        if found is not None and found[0] is statement:
            return found[1]
        if len(self._forms) >= _MAX_FORMS:
            self._forms.clear()
        form = _compile(statement, self._dialect, names)
        # The statement is kept with its form: its id is not reused while it is held here.
        self._forms[key] = (statement, form)
        return form

    async def write(
        self,
        driver: sqlite_driver.Connection,
        form: "_Form",
        params: Mapping[str, Any],
    ) -> int:
        """Run ``compiled`` with ``params`` in a transaction of its own: the rows it changed.

        Raises:
            sqlalchemy.exc.DBAPIError: as SQLAlchemy's execution would have raised it
                (``IntegrityError``, ``OperationalError`` …); nothing was written.
        """
        state = form.compiled.construct_expanded_state(dict(params))
        processors, values = form.processors, state.parameters
        if state.processors:  # an expanded list's members
            processors = {**processors, **state.processors}
        assert state.positiontup is not None  # SQLite's paramstyle is positional
        arguments = [
            processors[name](values[name]) if name in processors else values[name]
            for name in state.positiontup
        ]
        try:
            return await driver.write_alone(_BEGIN, state.statement, arguments)
        except sqlite3.Error as exc:
            raise DBAPIError.instance(
                state.statement, arguments, exc, sqlite3.Error, dialect=self._dialect
            ) from exc


@dataclass(frozen=True, slots=True)
class _Form:
    """A statement compiled for the dialect, with its parameters' bind processors."""

    compiled: SQLCompiler
    processors: Mapping[str, Callable[[Any], Any]]


def _compile(statement: Executable, dialect: Dialect, names: tuple[str, ...]) -> _Form | None:
    if not isinstance(statement, ClauseElement):
        return None
    # As Connection.execute compiles it: the parameter names are the INSERT/UPDATE columns.
    compiled = statement.compile(dialect=dialect, column_keys=list(names), for_executemany=False)
    if not isinstance(compiled, SQLCompiler):
        return None
    if compiled.insert_prefetch or compiled.update_prefetch or compiled.effective_returning:
        return None  # Python-side defaults to compute, or rows to return: SQLAlchemy's path
    processors = {}
    for name, bind in compiled.binds.items():
        # The dialect's form of the type (a TypeDecorator's load_dialect_impl), as execution
        # binds it: SQLite's DATETIME writes text, JSON dumps.
        process = bind.type.dialect_impl(dialect).bind_processor(dialect)
        if process is not None:
            processors[name] = process
    return _Form(compiled, processors)
