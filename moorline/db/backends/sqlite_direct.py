"""Statements of SQLite's write connection, handed to the driver past SQLAlchemy's execution.

On SQLite a statement costs SQLite a few tens of microseconds; SQLAlchemy's way to it (an
execution context, a cursor wrapper, a result built around the cursor, a greenlet, and for a
one-statement write the transaction's begin and commit) cost about twice that in CPU, the
larger part of a checkpointed step's cost and about a third of a worker's claim and finish
transactions on its event loop.

With :mod:`moorline.db.sqlite_driver`'s connections (the setting ``fast_paths``), the write
connection (:meth:`SQLiteBackend._writing_connection
<moorline.db.backends.sqlite.SQLiteBackend>`) is a :class:`DirectConnection`. A statement is
compiled once per statement object and parameter names; each execution binds its parameters
through the compiled form's public
:meth:`~sqlalchemy.sql.compiler.SQLCompiler.construct_expanded_state` (expanding ``IN`` lists)
and the types' bind processors, as SQLAlchemy's execution binds them, and sends the SQL to the
driver, whose ``BEGIN`` held back and ``COMMIT`` asked for go with it as they would from
SQLAlchemy. Rows come back as SQLAlchemy rows through the columns' result processors
(:class:`DirectResult`, which has ``rowcount`` too); errors as the same :mod:`sqlalchemy.exc`
classes. A one-statement write (:meth:`DirectWrites.write_alone`) sends its ``BEGIN IMMEDIATE``
and ``COMMIT`` in the same driver call. An executemany (a bulk submission's runs and events)
binds each parameter set the same way and goes to the driver's ``executemany``: SQLAlchemy's
own parameter processing cost more per row than SQLite's insert of it.

SQLAlchemy's path is still taken for what the direct one would skip or could get wrong:

- a statement outside a transaction SQLAlchemy began (its autobegin), a ``text()`` statement
  in a transaction (it may return rows of unknown keys), execution options (given with the
  call or set on the statement);
- an executemany whose parameter sets do not all name the same keys, or that returns rows;
- a statement with a Python-side column default that is a function (constants are bound as
  SQLAlchemy binds them);
- every statement of a connection with cursor or error event listeners (a tracer that records
  statements, the tests that count them): they see every statement, as without this module.
  That check reads the connection's and the dialect's event ``dispatch``; the rows are built
  from the compiler's ``_result_columns`` on ``SimpleResultMetaData``: SQLAlchemy internals
  listed in :data:`moorline.fastpaths.PRIVATE_NAMES`.
"""

import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from sqlalchemy import Executable, TextClause
from sqlalchemy.engine import CursorResult, Dialect, IteratorResult
from sqlalchemy.engine.result import SimpleResultMetaData
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import BindParameter, ClauseElement
from sqlalchemy.types import TupleType

from moorline.db import sqlite_driver

_MAX_FORMS = 512
"""Compiled statements kept; all are forgotten at once past it (statements are built once)."""

_MAX_TEXTS = 64
"""Expanded SQL texts kept per statement (one per combination of ``IN`` list lengths)."""

_BEGIN = "BEGIN IMMEDIATE"

_MISSING: Any = object()
"""No value: none given for a slot, or no default for its column."""

_Key = tuple[int, tuple[str, ...], bool]


@dataclass(frozen=True, slots=True)
class _Slot:
    """One positional parameter of a compiled statement (or an expanded list of them)."""

    key: str
    """The key callers give its value under (the bind parameter's ``key``)."""
    name: str
    """Its name in the compiled statement (callers may give the value under it too)."""
    bind: BindParameter[Any]
    process: Callable[[Any], Any] | None
    expanding: bool
    """An ``IN`` list: as many parameters as the list has members."""
    default: Any
    """A column's scalar default, bound when no value is given; _MISSING: none."""


@dataclass(frozen=True, slots=True)
class _Form:
    """A statement compiled for the dialect, its bind processors, and its rows' shape."""

    compiled: SQLCompiler
    processors: Mapping[str, Callable[[Any], Any]]
    rows: SimpleResultMetaData | None
    """The keys and result processors of the rows it returns; None: it returns none."""
    textual: bool = False
    """A ``text()`` statement: whether it returns rows is not known before it runs."""
    slots: tuple[_Slot, ...] | None = None
    """Its positional parameters in order, for binding without SQLAlchemy's parameter
    processing; None: a statement only ``construct_expanded_state`` binds right (escaped
    names, values rendered into the SQL, tuple lists)."""
    texts: dict[tuple[int, ...], str] = field(default_factory=dict)
    """The SQL with each ``IN`` list expanded, per the lists' lengths (the slots' order)."""


class DirectResult(IteratorResult[Any]):
    """A statement's rows, all fetched, and the rows it changed (``rowcount``)."""

    def __init__(self, shape: SimpleResultMetaData, rows: Sequence[Any], rowcount: int) -> None:
        super().__init__(shape, iter(rows))
        self.rowcount = rowcount


_NO_ROWS = SimpleResultMetaData([])


class DirectWrites:
    """Compiled forms of statements, and their execution on the driver."""

    def __init__(self, dialect: Dialect) -> None:
        """Compile for ``dialect`` (the engine's, which fixes the parameter style)."""
        self._dialect = dialect
        self._forms: dict[_Key, tuple[Executable, _Form | None]] = {}

    def prepared(
        self,
        conn: AsyncConnection,
        statement: Executable,
        params: Mapping[str, Any],
        *,
        in_transaction: bool,
        many: bool = False,
    ) -> tuple[sqlite_driver.Connection, _Form] | None:
        """``conn``'s driver and ``statement``'s form, if it may go direct now; else None.

        ``in_transaction``: whether SQLAlchemy must have begun a transaction on ``conn`` (a
        statement of a transaction, for :meth:`execute`) or must not have (a one-statement
        write, for :meth:`write_alone`). ``many``: for :meth:`execute_many`, ``params`` being
        the first parameter set.
        """
        driver = self._driver_of(conn, in_transaction=in_transaction)
        if driver is None:
            return None
        form = self._form(statement, params, many)
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
        if sync is None or sync.invalidated or sync.in_transaction() != in_transaction:
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

    def _form(self, statement: Executable, params: Mapping[str, Any], many: bool) -> _Form | None:
        """``statement``'s compiled form for these parameter names; None: SQLAlchemy's path."""
        names = tuple(sorted(params))
        key = (id(statement), names, many)
        found = self._forms.get(key)
        if found is not None and found[0] is statement:
            return found[1]
        if len(self._forms) >= _MAX_FORMS:
            self._forms.clear()
        form = _compile(statement, self._dialect, names, many)
        # The statement is kept with its form: its id is not reused while it is held here.
        self._forms[key] = (statement, form)
        return form

    async def execute(
        self, driver: sqlite_driver.Connection, form: _Form, params: Mapping[str, Any]
    ) -> DirectResult:
        """Run ``form`` in the open transaction: its rows (if any) and rowcount.

        Raises:
            sqlalchemy.exc.DBAPIError: as SQLAlchemy's execution would have raised it.
        """
        sql, arguments = self._bound(form, params)
        try:
            async with driver.cursor() as cursor:
                await cursor.execute(sql, arguments)
                rows = await cursor.fetchall()
                rowcount = cursor.rowcount
        except sqlite3.Error as exc:
            raise self._error(sql, arguments, exc) from exc
        return DirectResult(_NO_ROWS if form.rows is None else form.rows, rows, rowcount)

    async def execute_many(
        self,
        driver: sqlite_driver.Connection,
        form: _Form,
        sets: Sequence[Mapping[str, Any]],
    ) -> DirectResult | None:
        """Run ``form`` once per parameter set, in the open transaction: its rowcount.

        None when a set does not bind as the first one does (other keys, a value missing):
        nothing was sent, and SQLAlchemy's path is to run it (and raise its error).

        Raises:
            sqlalchemy.exc.DBAPIError: as SQLAlchemy's execution would have raised it.
        """
        assert form.slots is not None  # prepared(many=True) checked it
        rows = _rows_by_slots(form.slots, sets)
        if rows is None:
            return None
        sql = _text(form, (), sets[0])
        try:
            async with driver.cursor() as cursor:
                await cursor.executemany(sql, rows)
                rowcount = cursor.rowcount
        except sqlite3.Error as exc:
            raise self._error(sql, rows, exc) from exc
        return DirectResult(_NO_ROWS, [], rowcount)

    async def write_alone(
        self, driver: sqlite_driver.Connection, form: _Form, params: Mapping[str, Any]
    ) -> int:
        """Run ``form`` in a transaction of its own: the rows it changed.

        Raises:
            sqlalchemy.exc.DBAPIError: as SQLAlchemy's execution would have raised it
                (``IntegrityError``, ``OperationalError`` …); nothing was written.
        """
        sql, arguments = self._bound(form, params)
        try:
            return await driver.write_alone(_BEGIN, sql, arguments)
        except sqlite3.Error as exc:
            raise self._error(sql, arguments, exc) from exc

    @staticmethod
    def _bound(form: _Form, params: Mapping[str, Any]) -> tuple[str, list[Any]]:
        if form.slots is not None:
            bound = _bound_by_slots(form, form.slots, params)
            if bound is not None:
                return bound
        return _bound_by_sqlalchemy(form, params)

    def _error(self, sql: str, arguments: Sequence[Any], exc: sqlite3.Error) -> Exception:
        return DBAPIError.instance(sql, arguments, exc, sqlite3.Error, dialect=self._dialect)


def _bound_by_slots(
    form: _Form, slots: tuple[_Slot, ...], params: Mapping[str, Any]
) -> tuple[str, list[Any]] | None:
    """The SQL and its arguments, as construct_expanded_state gives them; None: ask it.

    Rendering the ``IN`` lists into the SQL was the largest part of binding a worker's claim
    and finish statements; the text depends only on the lists' lengths, so it is kept per
    lengths, and the arguments are laid out here in the slots' order.
    """
    arguments: list[Any] = []
    lengths: list[int] = []
    for slot in slots:
        value = params[slot.key] if slot.key in params else _value(slot, params)
        if value is _MISSING:
            return None  # SQLAlchemy's error for a missing value
        process = slot.process
        if slot.expanding:
            members = list(value)
            lengths.append(len(members))
            arguments += members if process is None else [process(item) for item in members]
        else:
            arguments.append(value if process is None else process(value))
    return _text(form, tuple(lengths), params), arguments


def _rows_by_slots(
    slots: tuple[_Slot, ...], sets: Sequence[Mapping[str, Any]]
) -> list[list[Any]] | None:
    """Each parameter set's arguments, in the slots' order; None: not all bind alike.

    SQLAlchemy's executemany compiles for the first set's keys and requires the same of the
    rest. A value that is the same object as the previous set's is processed once (a batch's
    rows share their time and their events' empty data).
    """
    names = sets[0].keys()
    seen: list[Any] = [_MISSING] * len(slots)
    made: list[Any] = [None] * len(slots)
    rows: list[list[Any]] = []
    for params in sets:
        if params.keys() != names:
            return None
        row: list[Any] = []
        for index, slot in enumerate(slots):
            value = params[slot.key] if slot.key in params else _value(slot, params)
            process = slot.process
            if value is _MISSING:
                return None
            if process is None:
                row.append(value)
            elif value is seen[index]:
                row.append(made[index])
            else:
                seen[index], made[index] = value, process(value)
                row.append(made[index])
        rows.append(row)
    return rows


def _value(slot: _Slot, params: Mapping[str, Any]) -> Any:
    """The value of a slot the parameters do not give under its key; _MISSING: none."""
    if slot.name in params:
        return params[slot.name]
    if slot.default is not _MISSING:
        return slot.default
    if slot.bind.required:
        return _MISSING
    return slot.bind.effective_value


def _text(form: _Form, lengths: tuple[int, ...], params: Mapping[str, Any]) -> str:
    """``form``'s SQL with its ``IN`` lists (of these lengths) expanded, as ``params`` give them."""
    texts = form.texts
    sql = texts.get(lengths)
    if sql is None:
        if len(texts) >= _MAX_TEXTS:
            texts.clear()
        sql = texts[lengths] = form.compiled.construct_expanded_state(dict(params)).statement
    return sql


def _bound_by_sqlalchemy(form: _Form, params: Mapping[str, Any]) -> tuple[str, list[Any]]:
    state = form.compiled.construct_expanded_state(dict(params))
    processors, values = form.processors, state.parameters
    if state.processors:  # an expanded list's members
        processors = {**processors, **state.processors}
    assert state.positiontup is not None  # SQLite's paramstyle is positional
    arguments = [
        processors[name](values[name]) if name in processors else values[name]
        for name in state.positiontup
    ]
    return state.statement, arguments


class DirectConnection(AsyncConnection):
    """SQLite's write connection: its statements go to the driver where they can."""

    def __init__(self, engine: AsyncEngine, direct: DirectWrites) -> None:
        """A connection of ``engine`` (not yet connected: ``await start()``)."""
        super().__init__(engine)
        self._direct = direct

    async def execute(
        self,
        statement: Executable,
        parameters: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        *,
        execution_options: Mapping[str, Any] | None = None,
    ) -> CursorResult[Any]:
        """As :meth:`AsyncConnection.execute`; past SQLAlchemy where the module docstring says."""
        if execution_options is None:
            result = await self._direct_execute(statement, parameters)
            if result is not None:
                # A CursorResult to its callers: the rows, rowcount and the Result methods
                # they use, without the cursor behind them.
                return cast(CursorResult[Any], result)
        return await super().execute(statement, parameters, execution_options=execution_options)

    async def _direct_execute(
        self,
        statement: Executable,
        parameters: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None,
    ) -> DirectResult | None:
        if not isinstance(parameters, Sequence):
            params = {} if parameters is None else parameters
            prepared = self._direct.prepared(self, statement, params, in_transaction=True)
            return None if prepared is None else await self._direct.execute(*prepared, params)
        if not parameters:
            return None  # SQLAlchemy runs an empty list as one execution with no parameters
        prepared = self._direct.prepared(
            self, statement, parameters[0], in_transaction=True, many=True
        )
        return None if prepared is None else await self._direct.execute_many(*prepared, parameters)


def _compile(
    statement: Executable, dialect: Dialect, names: tuple[str, ...], many: bool
) -> _Form | None:
    if not isinstance(statement, ClauseElement) or statement.get_execution_options():
        return None  # not SQL, or options only SQLAlchemy's execution reads
    # As Connection.execute compiles it: the parameter names are the INSERT/UPDATE columns.
    compiled = statement.compile(dialect=dialect, column_keys=list(names), for_executemany=many)
    if not isinstance(compiled, SQLCompiler):
        return None
    defaults = _scalar_defaults(compiled)
    if defaults is None:
        return None  # a default to call per row: SQLAlchemy's path
    processors = {}
    for name, bind in compiled.binds.items():
        # The dialect's form of the type (a TypeDecorator's load_dialect_impl), as execution
        # binds it: SQLite's DATETIME writes text, JSON dumps.
        process = bind.type.dialect_impl(dialect).bind_processor(dialect)
        if process is not None:
            processors[name] = process
    slots = _slots(compiled, processors, defaults)
    if slots is None and defaults:
        return None  # only the slots bind the defaults
    if isinstance(statement, TextClause):
        return _Form(compiled, processors, None, textual=True, slots=slots)
    # The columns of the rows it returns (a SELECT's, a RETURNING's), as SQLAlchemy's own
    # results read them: the compiler's record, not the statement's ``exported_columns``, which
    # memoizes on the statement and would outlive a later ``.returning()`` copied from it.
    returned = compiled._result_columns
    if not returned:
        return _Form(compiled, processors, None, slots=slots)
    keys = [column.keyname for column in returned]
    if len(set(keys)) != len(keys):
        return None  # two columns of one name: SQLAlchemy's rules for which one a key means
    readers = [
        column.type.dialect_impl(dialect).result_processor(dialect, None) for column in returned
    ]
    shape = SimpleResultMetaData(
        keys, extra=[column.objects for column in returned], _processors=readers
    )
    return _Form(compiled, processors, shape, slots=slots)


def _scalar_defaults(compiled: SQLCompiler) -> dict[str, Any] | None:
    """The Python-side column defaults ``compiled`` leaves to its execution, by column key.

    None: one is not a constant (a function to call per row).

    SQLAlchemy's execution puts a scalar default's value among the parameters of each row (a
    bulk submission's runs leave a dozen counters to theirs); binding it here is the same.
    """
    defaults: dict[str, Any] = {}
    for columns, kind in (
        (compiled.insert_prefetch, "default"),
        (compiled.update_prefetch, "onupdate"),
    ):
        for column in columns:
            default = getattr(column, kind)
            if default is None or not default.is_scalar:
                return None
            defaults[column.key] = default.arg
    return defaults


def _slots(
    compiled: SQLCompiler,
    processors: Mapping[str, Callable[[Any], Any]],
    defaults: Mapping[str, Any],
) -> tuple[_Slot, ...] | None:
    """``compiled``'s positional parameters for :func:`_bound_by_slots`, if it can bind them."""
    if compiled.positiontup is None or compiled.escaped_bind_names:
        return None
    if compiled.literal_execute_params:
        return None  # values rendered into the SQL: its text depends on them
    slots = []
    for name in compiled.positiontup:
        bind = compiled.binds[name]
        expanding = bind in compiled.post_compile_params
        if expanding and (not bind.expanding or isinstance(bind.type, TupleType)):
            return None  # rendered otherwise, or a list of tuples: flattened by SQLAlchemy
        default = defaults.get(bind.key, _MISSING)
        slots.append(_Slot(bind.key, name, bind, processors.get(name), expanding, default))
    return tuple(slots)
