"""The few places where SQLite, PostgreSQL and MySQL/MariaDB differ, behind named hooks.

Nothing outside this module looks at the dialect name to build SQL.
"""

import functools
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Literal, TypeVar

from sqlalchemy import (
    BigInteger,
    Insert,
    Interval,
    Select,
    Table,
    bindparam,
    column,
    func,
    literal,
    literal_column,
    select,
    type_coerce,
)
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError, DisconnectionError, OperationalError
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import TableValuedAlias
from sqlalchemy.types import TypeEngine

from moorline.db.types import UTCDateTime

DialectName = Literal["sqlite", "postgresql", "mysql"]

# SQLite keeps UTCDateTime as text in SQLAlchemy's format; '%f' gives SS.SSS, so three literal
# zeros make it the same six-digit microsecond text and comparisons stay lexical-correct.
_SQLITE_NOW_FORMAT = "%Y-%m-%d %H:%M:%f000"


def dialect_name_of(dialect: Dialect) -> DialectName:
    """Normalise SQLAlchemy's dialect name (``mariadb`` counts as ``mysql``)."""
    name = dialect.name
    if name == "sqlite":
        return "sqlite"
    if name == "postgresql":
        return "postgresql"
    if name in ("mysql", "mariadb"):
        return "mysql"
    raise ValueError(f"unsupported database dialect {name!r}")


def db_now(name: DialectName, *, plus_s: float = 0.0) -> ColumnElement[datetime]:
    """The database's current UTC time (plus an offset), as an SQL expression.

    Leases and the reaper compare against the database clock only, so workers whose clocks
    disagree cannot reap each other's live runs.

    Built once per ``(name, plus_s)`` and shared: SQL expressions are immutable, and building
    the function calls and their coercions was a quarter of a one-run submit's CPU on
    PostgreSQL. The offsets in use are few (lease TTLs, retry backoffs).
    """
    return _db_now(name, float(plus_s))


@functools.lru_cache(maxsize=256)
def _db_now(name: DialectName, plus_s: float) -> ColumnElement[datetime]:
    expr: ColumnElement[Any]
    if name == "sqlite":
        modifier = f"{plus_s:+.6f} seconds"
        expr = func.strftime(_SQLITE_NOW_FORMAT, "now", modifier)
    elif name == "postgresql":
        expr = func.clock_timestamp() + func.make_interval(0, 0, 0, 0, 0, 0, literal(plus_s))
    else:
        micros = round(plus_s * 1_000_000)
        expr = func.timestampadd(literal_column("MICROSECOND"), micros, func.utc_timestamp(6))
    return type_coerce(expr, UTCDateTime())


@functools.cache
def transaction_time(name: DialectName) -> ColumnElement[datetime] | None:
    """The database's time at the start of the transaction, or None where there is none.

    For writes that want the database's time without reading it first (a round trip): one
    value for every row and every statement of the transaction (in autocommit, the
    statement's start), never later than :func:`db_now`, which leases compare against.
    PostgreSQL only (``transaction_timestamp()``); None elsewhere.
    """
    if name != "postgresql":
        return None
    return type_coerce(func.transaction_timestamp(), UTCDateTime())


def microseconds_after(
    time: ColumnElement[datetime], delay_us: ColumnElement[int]
) -> ColumnElement[datetime]:
    """``time`` plus ``delay_us`` microseconds, exactly, for a :func:`transaction_time`.

    An interval of microseconds only, no days: no time-zone arithmetic, so Python's
    ``time + timedelta(microseconds=delay_us)`` gives the same instant.
    """
    micro = literal_column("interval '1 microsecond'", type_=Interval())
    return type_coerce(time.op("+")(micro.op("*")(delay_us)), UTCDateTime())


def rows_parameter(
    name: DialectName, parameter: str, columns: Mapping[str, TypeEngine[Any]]
) -> TableValuedAlias | None:
    """A table whose rows are bound as one parameter, for one statement of many rows.

    The parameter ``parameter`` is a list of dicts by column name (a key missing from a dict
    is NULL); the table has the ``columns`` given (name: type). The statement's
    text is the same whatever the number of rows, so it is compiled, cached and prepared
    once, and binding one parameter costs less CPU than one per row and column. PostgreSQL
    (``jsonb_to_recordset``) only; None elsewhere.
    """
    if name != "postgresql":
        return None
    table = func.jsonb_to_recordset(bindparam(parameter, type_=postgresql.JSONB()))
    named = [column(each, type_) for each, type_ in columns.items()]
    return table.table_valued(*named).render_derived(with_types=True)


def statement_time(
    dialect: Dialect,
) -> tuple[ColumnElement[datetime], ColumnElement[datetime]] | None:
    """For an INSERT that returns what it stored: the database's time, and it plus ``delay_us``.

    The same value for every row of the statement (its start), so the INSERT stamps its rows
    and returns the time, instead of a ``SELECT`` of the time going first (a round trip). The
    second expression adds the bound integer parameter ``delay_us`` microseconds exactly.
    MariaDB from 10.5 (``INSERT … RETURNING``; SQLAlchemy's ``insert_returning``, set from the
    server's version) only: MySQL has no ``RETURNING``, PostgreSQL has :func:`transaction_time`
    for one statement that writes the run and its event, and SQLite's time read is no round
    trip. None elsewhere.
    """
    if dialect_name_of(dialect) != "mysql" or not dialect.insert_returning:
        return None
    return _mysql_statement_time()


@functools.cache
def _mysql_statement_time() -> tuple[ColumnElement[datetime], ColumnElement[datetime]]:
    # UTC_TIMESTAMP is evaluated once per statement, at its start, like NOW().
    later = func.timestampadd(
        literal_column("MICROSECOND"),
        bindparam("delay_us", type_=BigInteger()),
        func.utc_timestamp(6),
    )
    return db_now("mysql"), type_coerce(later, UTCDateTime())


@functools.cache
def select_db_now(name: DialectName) -> Select[Any]:
    """``SELECT`` of the database's current time, built once per dialect."""
    return select(db_now(name))


READ_ONLY_SQLSTATE = "25006"
"""PostgreSQL's read_only_sql_transaction: a write reached a standby or a demoted primary."""
READ_ONLY_MYSQL_ERRORS = frozenset({1290, 1792, 1836})
"""MySQL/MariaDB: --read-only option, read-only transaction, read-only mode."""


def is_read_only_error(exc: BaseException) -> bool:
    """Whether a driver error says the node does not accept writes (it was demoted)."""
    if getattr(exc, "sqlstate", None) == READ_ONLY_SQLSTATE:
        return True
    cause = exc.__cause__
    if cause is not None and getattr(cause, "sqlstate", None) == READ_ONLY_SQLSTATE:
        return True
    args: tuple[object, ...] = exc.args
    return bool(args) and args[0] in READ_ONLY_MYSQL_ERRORS


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a lost or refused connection that a retry may cure."""
    if isinstance(exc, OperationalError | DisconnectionError):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


# --- Dispatch hooks -------------------------------------------------------------------------
# The claim, reaper and leader statements in ``moorline.db.repos.queue`` are written once; these
# hooks are the only places their SQL differs between backends.

_SelectT = TypeVar("_SelectT", bound=Select[Any])


def uses_row_locks(name: DialectName) -> bool:
    """Whether writers are serialised by row locks rather than one database-wide write lock.

    Server databases lock rows; SQLite's ``BEGIN IMMEDIATE`` takes one write lock. With row
    locks a claim must lock what it counts (the tenant rows) and skip rows other claimers
    hold; under SQLite's write lock nothing else can write while a claim runs.
    """
    return name != "sqlite"


def write_isolation_level(name: DialectName) -> str | None:
    """The isolation level of dispatch write transactions, or None for the backend default.

    READ COMMITTED on both servers: a claim counts a tenant's running runs *after* waiting for
    the tenant's row lock and must see what the previous holder committed. Under MySQL's
    default REPEATABLE READ the count would read the snapshot taken by the transaction's first
    SELECT, from before the wait, and the cap could be exceeded. PostgreSQL defaults to READ
    COMMITTED already; it is set explicitly so a server-wide default cannot change it.
    SQLite serialises writers with ``BEGIN IMMEDIATE`` and has no such level.
    """
    return None if name == "sqlite" else "READ COMMITTED"


def lock_rows(stmt: _SelectT, name: DialectName) -> _SelectT:
    """``stmt`` taking exclusive row locks that wait, held until the transaction ends.

    On PostgreSQL ``FOR NO KEY UPDATE``: it excludes other claimers but not the
    ``FOR KEY SHARE`` lock a foreign-key check takes, so enqueuing runs for a tenant never
    waits behind a claim. SQLite needs no row lock under its write lock.
    """
    if name == "postgresql":
        return stmt.with_for_update(key_share=True)
    if name == "mysql":
        return stmt.with_for_update()
    return stmt


def lock_rows_skip_locked(stmt: _SelectT, name: DialectName) -> _SelectT:
    """``stmt`` as ``SELECT … FOR UPDATE SKIP LOCKED`` (PostgreSQL, MariaDB ≥ 10.6, MySQL 8)."""
    if name == "sqlite":
        return stmt
    return stmt.with_for_update(skip_locked=True)


def supports_update_returning(name: DialectName) -> bool:
    """Whether ``UPDATE … RETURNING`` exists (not on MariaDB or MySQL)."""
    return name != "mysql"


def insert_ignoring_duplicates(table: Table, name: DialectName) -> Insert:
    """An INSERT into ``table`` that inserts nothing (rowcount 0) on a duplicate key."""
    if name == "postgresql":
        return postgresql.insert(table).on_conflict_do_nothing()
    if name == "sqlite":
        return sqlite.insert(table).on_conflict_do_nothing()
    return mysql.insert(table).prefix_with("IGNORE")


def insert_or_lock_existing(table: Table, name: DialectName, column: str) -> Insert:
    """An INSERT into ``table`` that leaves an existing row (same key) as it is.

    Unlike :func:`insert_ignoring_duplicates`, no shared lock is left on the existing row for
    a later UPDATE of the same transaction to upgrade: MariaDB's ``INSERT IGNORE`` takes one,
    and two transactions that both upgrade theirs deadlock. There ``ON DUPLICATE KEY UPDATE
    <column> = <column>`` takes the exclusive lock at once, so such transactions queue.
    PostgreSQL's ``ON CONFLICT DO NOTHING`` locks nothing, and SQLite has one writer.

    Args:
        table: The table to insert into.
        name: The database's dialect.
        column: A non-key column of ``table``, "updated" to itself on a duplicate.
    """
    if name == "mysql":
        return mysql.insert(table).on_duplicate_key_update({column: table.c[column]})
    return insert_ignoring_duplicates(table, name)


def increment_below(
    table: Table, name: DialectName, *, column: str, limit: int, keys: dict[str, Any]
) -> Insert | None:
    """One statement adding 1 to ``column`` of the row at ``keys`` while it is below ``limit``.

    The row is inserted with ``column = 1`` when it does not exist; the statement returns the
    new value, or no row when the value had reached ``limit`` (nothing changed). The limit is
    a predicate of the conflict's UPDATE, so it is checked on the locked row. None on MySQL and
    MariaDB, which have no ``INSERT … ON CONFLICT … RETURNING``: callers fall back to
    :func:`insert_or_lock_existing` and a conditional UPDATE.

    Args:
        table: The table.
        name: The database's dialect.
        column: The counter column.
        limit: The largest value the counter may reach (at least 1).
        keys: The row's primary key, by column name.
    """
    if name == "mysql":
        return None
    upsert = postgresql.insert(table) if name == "postgresql" else sqlite.insert(table)
    counter = table.c[column]
    return (
        upsert.values({**keys, column: 1})
        .on_conflict_do_update(
            index_elements=list(keys),
            set_={column: counter + 1},
            where=counter < limit,
        )
        .returning(counter)
    )
