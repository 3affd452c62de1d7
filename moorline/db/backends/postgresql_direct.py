"""PostgreSQL's statements, handed to asyncpg past SQLAlchemy's execution.

A statement's round trip through SQLAlchemy carried a connection, an execution context,
parameter processing, a cursor, a result and a greenlet around it: a ``py-spy`` profile of
``app.submit`` on PostgreSQL from one producer had a quarter of the process's CPU there, three
times asyncpg's own share, and a worker draining one-step runs a fifth of its CPU. Here a
statement's form and binding are :mod:`moorline.db.backends.direct`'s, and it goes to the
asyncpg connection as SQLAlchemy's asyncpg adapter sends it: under the adapter's lock, its
transaction begun first where one is open and not yet begun (asyncpg's transactions are
client-side, begun by the first statement), prepared through the adapter's cache of prepared
statements (so PgBouncer's unnamed statements and the cache's size hold as set), then fetched,
the rowcount read from the command's status. Two ways in:

- a write that one statement decides (``DatabaseManager.write_statement``: a submission's runs,
  a checkpointed step) runs in autocommit (:meth:`DirectStatements.write`): checked out of the
  pool, run, checked back in, all in one greenlet, as the pool may await in each (the failover
  creator, the close of a connection past the pool's size);
- a statement of a transaction (the worker's claims and outcomes, a batch of submissions) runs
  on the transaction's :class:`~moorline.db.backends.direct.DirectConnection`; its ``BEGIN``,
  ``COMMIT`` and ``ROLLBACK`` stay SQLAlchemy's.

An error comes back as SQLAlchemy's execution raises it (the adapter's translation, then
``DBAPIError``); a lost connection (the dialect's ``is_disconnect``, or a node that has turned
read-only, as the engine's own ``handle_error`` hook says) invalidates the connection and every
pooled one before it, as SQLAlchemy does, and a cancelled or interrupted statement invalidates
its connection, so ``with_retry`` and the transaction's rollback meet the same errors and the
same pool on either path.

SQLAlchemy's path is still taken where the direct one would skip something: a statement whose
form is None, a ``text()`` statement whose rows are wanted or that runs in a transaction (its
rows' keys are not known before it runs), an executemany (SQLAlchemy batches an ``INSERT``'s
rows into one statement), execution options given with the call, and every statement of an
engine with cursor event listeners or ``handle_error`` hooks other than its own (tracers, the
tests that count statements). The adapter's ``_prepare``, ``_execute_mutex``, ``_transaction``,
``_start_transaction`` and ``_handle_exception``, the pool's ``_invalidate`` and the event
``dispatch`` are SQLAlchemy internals listed in :data:`moorline.fastpaths.PRIVATE_NAMES`.
"""

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from sqlalchemy import Connection, Executable
from sqlalchemy.engine import Engine, ExceptionContext
from sqlalchemy.engine.result import SimpleResultMetaData
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.util import await_only, greenlet_spawn

from moorline.db.backends.direct import NO_ROWS, DirectResult, Form, Forms, bound, typed_rows
from moorline.db.failures import is_read_only_error

_COUNT = re.compile(r"(?:SELECT|UPDATE|DELETE|INSERT \d+) (\d+)")
"""The rows a command's status reports (``INSERT 0 3``, ``UPDATE 1``), as the adapter reads it."""

Hook = Callable[[ExceptionContext], None]

_Fetched = tuple[list[Any], str | None, Sequence[Any]]
"""A statement's records, its command status and its columns (asyncpg's attributes)."""

_MAX_SHAPES = 512
"""Rows' readers kept; all are forgotten at once past it (statements are built once)."""


class DirectStatements:
    """Statements on an asyncpg engine's connections, past SQLAlchemy's execution."""

    def __init__(self, engine: Engine, *, own_hooks: tuple[Hook, ...] = ()) -> None:
        """Run statements of ``engine`` (the sync engine behind the async one).

        ``own_hooks``: the engine's ``handle_error`` listeners whose rule this class applies
        itself (a read-only node is a lost connection); any other listener sends every
        statement SQLAlchemy's way.
        """
        self._engine = engine
        self._dialect = engine.dialect
        self._forms = Forms(engine.dialect, typed_rows=True)
        self._own_hooks = own_hooks
        self._shapes: dict[str, SimpleResultMetaData] = {}
        """Rows' readers per SQL text, for the column types the server reported."""

    def _listened(self, events: Any) -> bool:
        """Whether listeners must see the statements (``events``: an engine's or connection's)."""
        return bool(
            events.before_cursor_execute
            or events.after_cursor_execute
            # An engine's handle_error listeners are its dialect's.
            or any(hook not in self._own_hooks for hook in self._dialect.dispatch.handle_error)
        )

    # --- one-statement writes, in autocommit ---

    def form(self, statement: Executable, params: Mapping[str, Any], *, rows: bool) -> Form | None:
        """``statement``'s form if it may go direct now (``rows``: its rows are wanted)."""
        if self._listened(self._engine.dispatch):
            return None
        form = self._forms.form(statement, params, False)
        if form is None or (rows and (form.textual or form.rows is None)):
            return None
        return form

    async def write(self, form: Form, params: Mapping[str, Any]) -> DirectResult:
        """Run ``form`` in autocommit on a pooled connection: its rows and rowcount.

        Raises:
            sqlalchemy.exc.DBAPIError: as SQLAlchemy's execution would have raised it.
        """
        sql, arguments = bound(form, params)
        fetched = await greenlet_spawn(self._pooled, sql, arguments)
        return self._result(form, sql, fetched)

    def _pooled(self, sql: str, arguments: list[Any]) -> _Fetched:
        """Check out, run, check in, in one greenlet: the pool may await in each.

        The checkout may open a connection (the failover creator), and the checkin closes one
        past the pool's size; outside a greenlet that close could not await, and the
        connection would be left open.
        """
        fairy = self._engine.raw_connection()
        try:
            # The adapter has no transaction open on a checked-in connection: the statement
            # runs outside one, committed as it ends.
            try:
                return await_only(_fetch(fairy.dbapi_connection, sql, arguments, begin=False))
            except BaseException as exc:
                self._reraise(exc, fairy, None, sql, arguments)
        finally:
            fairy.close()

    # --- statements of a transaction (DirectConnection) ---

    def prepared(
        self,
        conn: AsyncConnection,
        statement: Executable,
        params: Mapping[str, Any],
        *,
        in_transaction: bool,
        many: bool = False,
    ) -> tuple[Connection, Form] | None:
        """``conn``'s connection and ``statement``'s form, if it may go direct now."""
        sync = conn.sync_connection
        if (
            many
            or not in_transaction
            or sync is None
            or sync.invalidated
            or not sync.in_transaction()
            or self._listened(sync.dispatch)
        ):
            return None
        form = self._forms.form(statement, params, False)
        if form is None or form.textual:
            return None
        return sync, form

    async def execute(
        self, sync: Connection, form: Form, params: Mapping[str, Any]
    ) -> DirectResult:
        """Run ``form`` in ``sync``'s open transaction: its rows and rowcount.

        Raises:
            sqlalchemy.exc.DBAPIError: as SQLAlchemy's execution would have raised it; a lost
                connection is invalidated (the transaction then rolls back as already gone).
        """
        sql, arguments = bound(form, params)
        fairy = sync.connection
        try:
            fetched = await _fetch(fairy.dbapi_connection, sql, arguments, begin=True)
        except BaseException as exc:
            self._reraise(exc, fairy, sync, sql, arguments)
        return self._result(form, sql, fetched)

    async def execute_many(
        self, target: Connection, form: Form, sets: Sequence[Mapping[str, Any]]
    ) -> DirectResult | None:
        """Never called: :meth:`prepared` leaves every executemany to SQLAlchemy."""
        return None

    def _result(self, form: Form, sql: str, fetched: _Fetched) -> DirectResult:
        records, status, columns = fetched
        counted = _COUNT.match(status or "")
        rowcount = int(counted.group(1)) if counted else -1
        if form.rows is None:
            return DirectResult(NO_ROWS, records, rowcount)
        shape = self._shapes.get(sql)
        if shape is None:
            if len(self._shapes) >= _MAX_SHAPES:
                self._shapes.clear()
            types = [column.type.oid for column in columns]
            shape = self._shapes[sql] = typed_rows(form, self._dialect, types)
        return DirectResult(shape, records, rowcount)

    def _reraise(
        self,
        exc: BaseException,
        fairy: Any,
        sync: Connection | None,
        sql: str,
        arguments: list[Any],
    ) -> NoReturn:
        """Raise ``exc`` as SQLAlchemy's execution would, the connection invalidated if lost.

        ``fairy``: the pooled connection the statement ran on; ``sync``: the SQLAlchemy
        connection whose transaction it was part of, None in autocommit.
        """
        if not isinstance(exc, Exception):
            # Cancelled mid-statement: what the connection has in flight is unknown.
            if sync is not None:
                sync.invalidate(exc)
            else:
                fairy.invalidate(exc)
            raise exc
        error = self._error(fairy, sync, sql, arguments, exc)
        if error is exc:
            raise exc
        raise error from exc

    def _error(
        self,
        fairy: Any,
        sync: Connection | None,
        sql: str,
        arguments: list[Any],
        exc: Exception,
    ) -> Exception:
        """``exc`` as SQLAlchemy's execution raises it, the connection invalidated if lost."""
        dialect = self._dialect
        try:
            fairy.dbapi_connection._handle_exception(exc)  # raises the driver's DB-API error
        except Exception as translated:
            error = translated
        if not isinstance(error, dialect.loaded_dbapi.Error):
            return error  # not the database's: SQLAlchemy re-raises it as it is too
        lost = dialect.is_disconnect(error, fairy.dbapi_connection, None)
        lost = lost or is_read_only_error(error)
        if lost:
            # The connection and every pooled one opened before it: the server (or the
            # primary) they lead to is gone, as SQLAlchemy's execution decides.
            self._engine.pool._invalidate(fairy, error)
            if sync is not None:
                sync.invalidate(error)
        return DBAPIError.instance(
            sql,
            arguments,
            error,
            dialect.loaded_dbapi.Error,
            hide_parameters=self._engine.hide_parameters,
            connection_invalidated=lost,
            dialect=dialect,
        )


async def _fetch(adapter: Any, sql: str, arguments: list[Any], *, begin: bool) -> _Fetched:
    """The statement's rows, command status and columns, as the adapter's cursor runs it.

    ``adapter``: SQLAlchemy's asyncpg connection (its lock, transaction, prepared statements).
    ``begin``: begin the adapter's transaction first if it has none yet, as its cursor does.
    """
    async with adapter._execute_mutex:
        if begin and adapter._transaction is None:
            await adapter._start_transaction()
        prepared, columns = await adapter._prepare(sql, 0)
        records = await prepared.fetch(*arguments)
        return records, prepared.get_statusmsg(), columns
