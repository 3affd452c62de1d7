"""Statements compiled once and bound past SQLAlchemy's execution, for the direct paths.

A direct path (SQLite's write connection, :mod:`moorline.db.backends.sqlite_direct`;
PostgreSQL's write transactions and one-statement writes,
:mod:`moorline.db.backends.postgresql_direct`) sends a statement to the driver itself:
SQLAlchemy's execution of a short statement (an execution context, parameter processing, a
cursor wrapper, a result around it, a greenlet) costs more CPU than the database spends on it.
What they share is here: a statement is compiled once per statement object and parameter names
(:class:`Forms`; statements built anew for each call go SQLAlchemy's way, whose cache serves
them better), and each execution binds its parameters as SQLAlchemy's execution would,
through the compiled form's slots, or its public
:meth:`~sqlalchemy.sql.compiler.SQLCompiler.construct_expanded_state` where the slots cannot
(:func:`bound`), with the types' bind processors; rows come back as SQLAlchemy rows through the
columns' result processors (:class:`DirectResult`). A transaction's connection is a
:class:`DirectConnection`, whose ``execute`` asks the backend's :class:`Statements` first.

A form is None, and the statement goes SQLAlchemy's way, where binding it here could differ: not
a compiled SQL statement, execution options set on it, a Python-side column default that is a
function (constants are bound as SQLAlchemy binds them), rows of two columns of one name. The
rows are built from the compiler's ``_result_columns`` on ``SimpleResultMetaData``, and a
statement's structure is known by its ``_generate_cache_key``: SQLAlchemy internals listed in
:data:`moorline.fastpaths.PRIVATE_NAMES`.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Protocol, cast

from sqlalchemy import Executable, TextClause
from sqlalchemy.engine import CursorResult, Dialect, IteratorResult
from sqlalchemy.engine.result import SimpleResultMetaData
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import BindParameter, ClauseElement
from sqlalchemy.types import TupleType

_MAX_FORMS = 512
"""Compiled statements kept; all are forgotten at once past it (statements are built once)."""

_COMPILES_PER_SHAPE = 4
"""Statement objects of one structure compiled here; those built later go SQLAlchemy's way."""

_MAX_TEXTS = 64
"""Expanded SQL texts kept per statement (one per combination of ``IN`` list lengths)."""

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
    elements: tuple[Callable[[Any], Any] | None, ...] | None
    """An ``IN`` list of tuples (``(a, b) IN ((…), (…))``): each element's bind processor,
    its members flattened element by element; None: a list of single values."""
    default: Any
    """A column's scalar default, bound when no value is given; _MISSING: none."""


@dataclass(frozen=True, slots=True)
class Form:
    """A statement compiled for the dialect, its bind processors, and its rows' shape."""

    compiled: SQLCompiler
    processors: Mapping[str, Callable[[Any], Any]]
    rows: SimpleResultMetaData | None
    """The keys and result processors of the rows it returns; None: it returns none. With
    ``Forms(typed_rows=True)`` the keys only: see :func:`typed_rows`."""
    textual: bool = False
    """A ``text()`` statement: whether it returns rows is not known before it runs."""
    slots: tuple[_Slot, ...] | None = None
    """Its positional parameters in order, for binding without SQLAlchemy's parameter
    processing; None: a statement only ``construct_expanded_state`` binds right (escaped
    names, values rendered into the SQL)."""
    texts: dict[tuple[int, ...], str] = field(default_factory=dict)
    """The SQL with each ``IN`` list expanded, per the lists' lengths (the slots' order)."""
    returned: tuple[Any, ...] = ()
    """The compiler's record of the columns it returns (their types read the rows)."""
    numbered: bool = False
    """Its parameters are numbered (``$1``, asyncpg), not placed in order (``?``)."""


class DirectResult(IteratorResult[Any]):
    """A statement's rows, all fetched, and the rows it changed (``rowcount``)."""

    def __init__(self, shape: SimpleResultMetaData, rows: Sequence[Any], rowcount: int) -> None:
        super().__init__(shape, iter(rows))
        self.rowcount = rowcount


NO_ROWS = SimpleResultMetaData([])
"""The shape of a statement that returns no rows."""


class Forms:
    """The compiled forms of statements for one dialect, kept per statement and names."""

    def __init__(self, dialect: Dialect, *, typed_rows: bool = False) -> None:
        """Compile for ``dialect`` (the engine's, which fixes the parameter style).

        ``typed_rows``: the dialect's result processors depend on the type the driver reports
        for each column (asyncpg's numbers); the forms' rows then have keys only, and each
        execution reads them with :func:`typed_rows`.
        """
        self.dialect = dialect
        self._typed_rows = typed_rows
        self._forms: dict[_Key, tuple[Executable, Form | None]] = {}
        self._compiles: dict[tuple[Any, tuple[str, ...], bool], int] = {}

    def form(self, statement: Executable, params: Mapping[str, Any], many: bool) -> Form | None:
        """``statement``'s form for these parameter names; None: it goes SQLAlchemy's way.

        ``many``: for an executemany, ``params`` being its first parameter set.

        A form binds the values written into its statement object, so it is kept per object.
        A statement built anew for each call (its values in its clauses) would be compiled at
        every call, which costs far more than SQLAlchemy's execution, whose cache of compiled
        statements is keyed by structure: once a few objects of one structure were compiled
        here, later ones are left to SQLAlchemy.
        """
        names = tuple(sorted(params))
        key = (id(statement), names, many)
        found = self._forms.get(key)
        if found is not None and found[0] is statement:
            return found[1]
        if isinstance(statement, ClauseElement):
            shape = statement._generate_cache_key()
            if shape is not None:
                compiled = (shape.key, names, many)
                if self._compiles.get(compiled, 0) >= _COMPILES_PER_SHAPE:
                    return None
                if len(self._compiles) >= _MAX_FORMS:
                    self._compiles.clear()
                self._compiles[compiled] = self._compiles.get(compiled, 0) + 1
        if len(self._forms) >= _MAX_FORMS:
            self._forms.clear()
        form = _compile(statement, self.dialect, names, many, self._typed_rows)
        # The statement is kept with its form: its id is not reused while it is held here.
        self._forms[key] = (statement, form)
        return form


class Statements(Protocol):
    """A backend's direct execution of statements in a transaction SQLAlchemy began."""

    def prepared(
        self,
        conn: AsyncConnection,
        statement: Executable,
        params: Mapping[str, Any],
        *,
        in_transaction: bool,
        many: bool = False,
    ) -> tuple[Any, Form] | None:
        """What :meth:`execute` needs to run ``statement`` on ``conn`` now, and its form.

        None: SQLAlchemy's path. ``many``: for :meth:`execute_many`, ``params`` its first set.
        """
        ...

    async def execute(self, target: Any, form: Form, params: Mapping[str, Any]) -> DirectResult:
        """Run ``form`` in the open transaction; errors as SQLAlchemy's execution raises them."""
        ...

    async def execute_many(
        self, target: Any, form: Form, sets: Sequence[Mapping[str, Any]]
    ) -> DirectResult | None:
        """Run ``form`` once per set; None: nothing sent, SQLAlchemy's path runs it."""
        ...


class DirectConnection(AsyncConnection):
    """A connection whose statements in a transaction go past SQLAlchemy where they can."""

    def __init__(self, engine: AsyncEngine, direct: Statements) -> None:
        """A connection of ``engine`` (not yet connected: ``await start()``)."""
        super().__init__(engine)
        self._direct = direct
        self.in_driver_transaction = False
        """A transaction its backend began on the driver is open, SQLAlchemy's left unbegun
        (SQLite's write transactions, :meth:`~.sqlite_direct.DirectWrites.transaction`)."""

    async def execute(
        self,
        statement: Executable,
        parameters: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        *,
        execution_options: Mapping[str, Any] | None = None,
    ) -> CursorResult[Any]:
        """As :meth:`AsyncConnection.execute`; past SQLAlchemy where its backend's module says."""
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


def bound(form: Form, params: Mapping[str, Any]) -> tuple[str, list[Any]]:
    """``form``'s SQL and its positional arguments for ``params``, as SQLAlchemy binds them."""
    if form.slots is not None:
        by_slots = _bound_by_slots(form, form.slots, params)
        if by_slots is not None:
            return by_slots
    return _bound_by_sqlalchemy(form, params)


def _bound_by_slots(
    form: Form, slots: tuple[_Slot, ...], params: Mapping[str, Any]
) -> tuple[str, list[Any]] | None:
    """The SQL and its arguments, as construct_expanded_state gives them; None: ask it.

    Rendering the ``IN`` lists into the SQL was the largest part of binding a worker's claim
    and finish statements; the text depends only on the lists' lengths, so it is kept per
    lengths, and the arguments are laid out here in the slots' order: an ``IN`` list's
    members in its place (``?``), or, where parameters are numbered (``$1``), after every
    other parameter, list after list, as SQLAlchemy numbers them.
    """
    arguments: list[Any] = []
    members_last: list[Any] = arguments if not form.numbered else []
    lengths: list[int] = []
    for slot in slots:
        value = params[slot.key] if slot.key in params else _value(slot, params)
        if value is _MISSING:
            return None  # SQLAlchemy's error for a missing value
        process = slot.process
        if slot.elements is not None:
            members = list(value)
            lengths.append(len(members))
            members_last += [
                item if element is None else element(item)
                for member in members
                for item, element in zip(member, slot.elements, strict=True)
            ]
        elif slot.expanding:
            members = list(value)
            lengths.append(len(members))
            members_last += members if process is None else [process(item) for item in members]
        else:
            arguments.append(value if process is None else process(value))
    if members_last is not arguments:
        arguments += members_last
    return text_of(form, tuple(lengths), params), arguments


def rows_by_slots(
    slots: tuple[_Slot, ...], sets: Sequence[Mapping[str, Any]]
) -> list[list[Any]] | None:
    """Each parameter set's arguments, in the slots' order; None: not all bind alike.

    SQLAlchemy's executemany compiles for the first set's keys and requires the same of the
    rest. Where the sets give every slot's value under its key (an INSERT's rows), a row is
    read with one ``itemgetter``; then only the slots with a bind processor are visited, and a
    value that is the same object as the previous set's is processed once (a batch's rows
    share their time and their events' empty data).
    """
    names = sets[0].keys()
    take = None
    if len(slots) > 1 and all(slot.key in names for slot in slots):
        take = itemgetter(*(slot.key for slot in slots))
    processed = [(index, slot.process) for index, slot in enumerate(slots) if slot.process]
    seen: list[Any] = [_MISSING] * len(slots)
    made: list[Any] = [None] * len(slots)
    rows: list[list[Any]] = []
    for params in sets:
        if params.keys() != names:
            return None
        if take is not None:
            row = list(take(params))
        else:
            row = [
                params[slot.key] if slot.key in params else _value(slot, params) for slot in slots
            ]
            if any(value is _MISSING for value in row):
                return None
        for index, process in processed:
            value = row[index]
            if value is not seen[index]:
                seen[index], made[index] = value, process(value)
            row[index] = made[index]
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


def text_of(form: Form, lengths: tuple[int, ...], params: Mapping[str, Any]) -> str:
    """``form``'s SQL with its ``IN`` lists (of these lengths) expanded, as ``params`` give them."""
    texts = form.texts
    sql = texts.get(lengths)
    if sql is None:
        if len(texts) >= _MAX_TEXTS:
            texts.clear()
        sql = texts[lengths] = form.compiled.construct_expanded_state(dict(params)).statement
    return sql


def _bound_by_sqlalchemy(form: Form, params: Mapping[str, Any]) -> tuple[str, list[Any]]:
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


def _compile(
    statement: Executable, dialect: Dialect, names: tuple[str, ...], many: bool, typed: bool
) -> Form | None:
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
    numbered = dialect.paramstyle in ("numeric", "numeric_dollar")
    if slots is None and defaults:
        return None  # only the slots bind the defaults
    if isinstance(statement, TextClause):
        return Form(compiled, processors, None, textual=True, slots=slots, numbered=numbered)
    # The columns of the rows it returns (a SELECT's, a RETURNING's), as SQLAlchemy's own
    # results read them: the compiler's record, not the statement's ``exported_columns``, which
    # memoizes on the statement and would outlive a later ``.returning()`` copied from it.
    returned = compiled._result_columns
    if not returned:
        return Form(compiled, processors, None, slots=slots, numbered=numbered)
    keys = [column.keyname for column in returned]
    if len(set(keys)) != len(keys):
        return None  # two columns of one name: SQLAlchemy's rules for which one a key means
    shape = _shape(returned, dialect, None if typed else [None] * len(returned))
    return Form(
        compiled, processors, shape, slots=slots, returned=tuple(returned), numbered=numbered
    )


def typed_rows(form: Form, dialect: Dialect, types: Sequence[Any]) -> SimpleResultMetaData:
    """``form``'s rows, as SQLAlchemy's result reads them.

    Each column is read by its type's result processor for the type the driver reported for
    it (``types``, in order: asyncpg's type OIDs).
    """
    return _shape(form.returned, dialect, types)


def _shape(returned: Any, dialect: Dialect, types: Sequence[Any] | None) -> SimpleResultMetaData:
    """The keys of ``returned`` columns, and their readers (none when ``types`` is None)."""
    keys = [column.keyname for column in returned]
    readers = (
        None
        if types is None
        else [
            column.type.dialect_impl(dialect).result_processor(dialect, type_)
            for column, type_ in zip(returned, types, strict=True)
        ]
    )
    return SimpleResultMetaData(
        keys, extra=[column.objects for column in returned], _processors=readers
    )


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
    dialect = compiled.dialect
    slots = []
    for name in compiled.positiontup:
        bind = compiled.binds[name]
        expanding = bind in compiled.post_compile_params
        if expanding and not bind.expanding:
            return None  # rendered otherwise
        elements = None
        if expanding and isinstance(bind.type, TupleType):
            # A list of tuples (a batch's fences): flattened member by member, each element
            # bound by its own type, as SQLAlchemy's expansion binds them.
            elements = tuple(
                element.dialect_impl(dialect).bind_processor(dialect) for element in bind.type.types
            )
        default = defaults.get(bind.key, _MISSING)
        process = processors.get(name)
        slots.append(_Slot(bind.key, name, bind, process, expanding, elements, default))
    return tuple(slots)
