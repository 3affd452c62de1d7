"""PostgreSQL's one-statement writes, handed to asyncpg past SQLAlchemy's execution.

A write that one statement decides (``DatabaseManager.write_statement``: a submission's runs,
a checkpointed step) runs in autocommit, one round trip. Through SQLAlchemy that round trip
carried a connection, an execution context, parameter processing, a cursor, a result and a
greenlet around it: a `py-spy` profile of ``app.submit`` on PostgreSQL from one producer had
a quarter of the process's CPU there, three times asyncpg's own share. Here the statement's
form and binding are :mod:`moorline.db.backends.direct`'s, and it goes to the pooled asyncpg
connection as SQLAlchemy's asyncpg adapter sends it: prepared through the adapter's cache of
prepared statements (so PgBouncer's unnamed statements and the cache's size hold as set),
then fetched, the rowcount read from the command's status.

The connection is checked out of and back into the engine's pool as SQLAlchemy's execution
does (its ``checkout`` check of a closed connection included), and it is never switched to
autocommit: asyncpg's transactions are client-side, and the adapter has none open on a
checked-in connection, so the statement runs outside one, committed as it ends. An error comes
back as SQLAlchemy's execution raises it (the adapter's translation, then ``DBAPIError``); a
lost connection (the dialect's ``is_disconnect``, or a node that has turned read-only, as the
engine's own ``handle_error`` hook says) invalidates the connection and every pooled one
before it, as SQLAlchemy does, and a cancelled or interrupted statement invalidates its
connection, so ``with_retry`` meets the same errors and the same pool on either path.

SQLAlchemy's path is still taken where the direct one would skip something: a statement whose
form is None, a ``text()`` statement whose rows are wanted, and every statement of an engine
with cursor event listeners or ``handle_error`` hooks other than the engine's own (tracers, the
tests that count statements). The adapter's ``_prepare``, ``_execute_mutex`` and
``_handle_exception``, the pool's ``_invalidate`` and the event ``dispatch`` are SQLAlchemy
internals listed in :data:`moorline.fastpaths.PRIVATE_NAMES`.
"""

import re
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import Executable
from sqlalchemy.engine import Engine, ExceptionContext
from sqlalchemy.exc import DBAPIError
from sqlalchemy.util import await_only, greenlet_spawn

from moorline.db.backends.direct import NO_ROWS, DirectResult, Form, Forms, bound
from moorline.db.failures import is_read_only_error

_COUNT = re.compile(r"(?:SELECT|UPDATE|DELETE|INSERT \d+) (\d+)")
"""The rows a command's status reports (``INSERT 0 3``, ``UPDATE 1``), as the adapter reads it."""

Hook = Callable[[ExceptionContext], None]


class AutocommitWrites:
    """One-statement writes on an asyncpg engine's pooled connections, past SQLAlchemy."""

    def __init__(self, engine: Engine, *, own_hooks: tuple[Hook, ...] = ()) -> None:
        """Write through ``engine``'s pool (the sync engine behind the async one).

        ``own_hooks``: the engine's ``handle_error`` listeners whose rule this class applies
        itself (a read-only node is a lost connection); any other listener sends every
        statement SQLAlchemy's way.
        """
        self._engine = engine
        self._dialect = engine.dialect
        self._forms = Forms(engine.dialect)
        self._own_hooks = own_hooks

    def form(self, statement: Executable, params: Mapping[str, Any], *, rows: bool) -> Form | None:
        """``statement``'s form if it may go direct now (``rows``: its rows are wanted)."""
        events = self._engine.dispatch
        if (
            events.before_cursor_execute
            or events.after_cursor_execute
            # An engine's handle_error listeners are its dialect's.
            or any(hook not in self._own_hooks for hook in self._dialect.dispatch.handle_error)
        ):
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
        records, status = await greenlet_spawn(self._pooled, sql, arguments)
        counted = _COUNT.match(status or "")
        rowcount = int(counted.group(1)) if counted else -1
        return DirectResult(NO_ROWS if form.rows is None else form.rows, records, rowcount)

    def _pooled(self, sql: str, arguments: list[Any]) -> tuple[list[Any], str | None]:
        """Check out, run, check in, in one greenlet: the pool may await in each.

        The checkout may open a connection (the failover creator), and the checkin closes one
        past the pool's size; outside a greenlet that close could not await, and the
        connection would be left open.
        """
        fairy = self._engine.raw_connection()
        try:
            # SQLAlchemy's asyncpg adapter: its lock, its prepared statements, its errors.
            adapter: Any = fairy.dbapi_connection
            try:
                return await_only(_fetch(adapter, sql, arguments))
            except Exception as exc:
                raise self._error(fairy, sql, arguments, exc) from exc
            except BaseException as exc:
                # Cancelled mid-statement: what the connection has in flight is unknown.
                fairy.invalidate(exc)
                raise
        finally:
            fairy.close()

    def _error(self, fairy: Any, sql: str, arguments: list[Any], exc: Exception) -> Exception:
        """``exc`` as SQLAlchemy's execution raises it, the connection invalidated if lost."""
        dialect = self._dialect
        try:
            fairy.dbapi_connection._handle_exception(exc)  # raises the driver's DB-API error
        except Exception as translated:
            error = translated
        if not isinstance(error, dialect.loaded_dbapi.Error):
            return error  # not the database's: SQLAlchemy re-raises it as it is too
        lost = dialect.is_disconnect(error, fairy.dbapi_connection, None) or is_read_only_error(
            error
        )
        if lost:
            # The connection and every pooled one opened before it: the server (or the
            # primary) they lead to is gone, as SQLAlchemy's execution decides.
            self._engine.pool._invalidate(fairy, error)
        return DBAPIError.instance(
            sql,
            arguments,
            error,
            dialect.loaded_dbapi.Error,
            hide_parameters=self._engine.hide_parameters,
            connection_invalidated=lost,
            dialect=dialect,
        )


async def _fetch(adapter: Any, sql: str, arguments: list[Any]) -> tuple[list[Any], str | None]:
    """The statement's rows and command status, as the adapter's cursor runs it."""
    async with adapter._execute_mutex:
        prepared, _ = await adapter._prepare(sql, 0)
        records = await prepared.fetch(*arguments)
        return records, prepared.get_statusmsg()
