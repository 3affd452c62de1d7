"""Compatibility names for code not yet moved to :mod:`moorline.db.backends`.

Every function here asks the backend of ``name`` (``db.backend`` does the same without the
name); nothing is decided here. It goes once the run and queue repositories call
``db.backend`` directly.
"""

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import Insert, Select, Table
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import TableValuedAlias
from sqlalchemy.types import TypeEngine

from moorline.db.backends import Backend, DialectName, backend_for
from moorline.db.backends.base import SelectT
from moorline.db.backends.mysql import MySQLBackend
from moorline.db.backends.postgresql import PostgreSQLBackend, microseconds_after
from moorline.db.backends.sqlite import SQLiteBackend
from moorline.db.failures import (
    READ_ONLY_MYSQL_ERRORS,
    READ_ONLY_SQLSTATE,
    is_read_only_error,
    is_transient,
)

__all__ = [
    "READ_ONLY_MYSQL_ERRORS",
    "READ_ONLY_SQLSTATE",
    "DialectName",
    "db_now",
    "dialect_name_of",
    "increment_below",
    "insert_ignoring_duplicates",
    "insert_or_lock_existing",
    "is_read_only_error",
    "is_transient",
    "lock_rows",
    "lock_rows_skip_locked",
    "microseconds_after",
    "rows_parameter",
    "select_db_now",
    "statement_time",
    "supports_update_returning",
    "transaction_time",
    "uses_row_locks",
    "write_isolation_level",
]

_CLASSES: Mapping[str, type[Backend]] = {
    "sqlite": SQLiteBackend,
    "postgresql": PostgreSQLBackend,
    "mysql": MySQLBackend,
    "mariadb": MySQLBackend,
}


def _backend(name: str) -> Backend:
    return backend_for(_CLASSES[name].name)


def dialect_name_of(dialect: Dialect) -> DialectName:
    """Normalise SQLAlchemy's dialect name (``mariadb`` counts as ``mysql``)."""
    if dialect.name not in _CLASSES:
        raise ValueError(f"unsupported database dialect {dialect.name!r}")
    return _CLASSES[dialect.name].name


def db_now(name: DialectName, *, plus_s: float = 0.0) -> ColumnElement[datetime]:
    """:meth:`Backend.now <moorline.db.backends.base.Backend.now>` of ``name``."""
    return _backend(name).now(plus_s=plus_s)


def select_db_now(name: DialectName) -> Select[Any]:
    """:meth:`Backend.select_now <moorline.db.backends.base.Backend.select_now>`."""
    return _backend(name).select_now()


def transaction_time(name: DialectName) -> ColumnElement[datetime] | None:
    """:meth:`Backend.transaction_time <moorline.db.backends.base.Backend.transaction_time>`."""
    return _backend(name).transaction_time()


def rows_parameter(
    name: DialectName, parameter: str, columns: Mapping[str, TypeEngine[Any]]
) -> TableValuedAlias | None:
    """:meth:`Backend.rows_parameter <moorline.db.backends.base.Backend.rows_parameter>`."""
    return _backend(name).rows_parameter(parameter, columns)


def statement_time(
    dialect: Dialect,
) -> tuple[ColumnElement[datetime], ColumnElement[datetime]] | None:
    """:meth:`Backend.statement_time <moorline.db.backends.base.Backend.statement_time>`."""
    return _backend(dialect.name).statement_time(dialect)


def uses_row_locks(name: DialectName) -> bool:
    """``Capabilities.row_locks`` of ``name``."""
    return _CLASSES[name].capabilities.row_locks


def supports_update_returning(name: DialectName) -> bool:
    """``Capabilities.update_returning`` of ``name``."""
    return _CLASSES[name].capabilities.update_returning


def write_isolation_level(name: DialectName) -> str | None:
    """``Backend.write_isolation_level`` of ``name``."""
    return _backend(name).write_isolation_level


def lock_rows(stmt: SelectT, name: DialectName) -> SelectT:
    """:meth:`Backend.lock_rows <moorline.db.backends.base.Backend.lock_rows>`."""
    return _backend(name).lock_rows(stmt)


def lock_rows_skip_locked(stmt: SelectT, name: DialectName) -> SelectT:
    """:meth:`Backend.lock_rows_skip_locked`."""
    return _backend(name).lock_rows_skip_locked(stmt)


def insert_ignoring_duplicates(table: Table, name: DialectName) -> Insert:
    """:meth:`Backend.insert_ignoring_duplicates`."""
    return _backend(name).insert_ignoring_duplicates(table)


def insert_or_lock_existing(table: Table, name: DialectName, column: str) -> Insert:
    """:meth:`Backend.insert_or_lock_existing`."""
    return _backend(name).insert_or_lock_existing(table, column)


def increment_below(
    table: Table, name: DialectName, *, column: str, limit: int, keys: dict[str, Any]
) -> Insert | None:
    """:meth:`Backend.increment_below`."""
    return _backend(name).increment_below(table, column=column, limit=limit, keys=keys)
