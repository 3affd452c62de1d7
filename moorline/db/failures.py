"""What a database error means: lost connection, demoted node, or a bug.

Every layer that must tell a database outage from a bug asks here, so none of them imports a
driver's or SQLAlchemy's exception classes: the API answers 503 for what
:func:`as_unavailable` translates, the reaper and the wake-ups retry what :func:`is_transient`
calls transient, and the pools discard a connection :func:`is_read_only_error` recognises.

Imports: SQLAlchemy's exceptions and ``moorline.errors`` only (no manager, no repository), so
``moorline.db.health``, ``moorline.db.migrate`` and the manager can all use it without a cycle.
"""

from sqlalchemy.exc import DBAPIError, DisconnectionError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from moorline.errors import BackendUnavailable

MAX_REASON_CHARS = 300

READ_ONLY_SQLSTATE = "25006"
"""PostgreSQL's read_only_sql_transaction: a write reached a standby or a demoted primary."""
READ_ONLY_MYSQL_ERRORS = frozenset({1290, 1792, 1836})
"""MySQL/MariaDB: --read-only option, read-only transaction, read-only mode."""

DATABASE_ERRORS: tuple[type[Exception], ...] = (DBAPIError, PoolTimeoutError)
"""The errors a database call can raise besides Moorline's own: a driver's (wrapped by
SQLAlchemy) and a pool that had no connection to give in time."""


def is_read_only_error(exc: BaseException) -> bool:
    """Whether a driver error says the node does not accept writes (it was demoted)."""
    if getattr(exc, "sqlstate", None) == READ_ONLY_SQLSTATE:
        return True
    cause = exc.__cause__
    if cause is not None and getattr(cause, "sqlstate", None) == READ_ONLY_SQLSTATE:
        return True
    args: tuple[object, ...] = exc.args
    return bool(args) and args[0] in READ_ONLY_MYSQL_ERRORS


PERMANENT_SQLITE_CODES = {
    8: "the database file is read-only",  # SQLITE_READONLY
    3: "no permission to use the database",  # SQLITE_PERM
    23: "no permission to use the database",  # SQLITE_AUTH
    13: "the disk is full",  # SQLITE_FULL
    14: "the database file cannot be opened",  # SQLITE_CANTOPEN
    11: "the database file is corrupt",  # SQLITE_CORRUPT
    26: "the file is not a database",  # SQLITE_NOTADB
}
"""SQLite's primary result codes that no retry cures, and what each means to an operator."""
PERMANENT_SQLSTATES = {
    "42501": "no permission for this statement",  # insufficient_privilege
    "42P01": "a table is missing: is the schema at the code's revision?",  # undefined_table
    "42703": "a column is missing: is the schema at the code's revision?",  # undefined_column
    "53100": "the disk is full",  # disk_full
    "3D000": "the database does not exist",  # invalid_catalog_name
    "28000": "the role may not log in",  # invalid_authorization_specification
    "28P01": "the password was refused",  # invalid_password
}
"""PostgreSQL's SQLSTATEs that no retry cures. (25006, a read-only transaction, is not here:
it means a demoted primary, which the pool fails over from.)"""
PERMANENT_MYSQL_ERRORS = {
    1142: "no permission for this statement",  # ER_TABLEACCESS_DENIED_ERROR
    1227: "no permission for this statement",  # ER_SPECIFIC_ACCESS_DENIED_ERROR
    1044: "no permission to use the database",  # ER_DBACCESS_DENIED_ERROR
    1045: "the user or password was refused",  # ER_ACCESS_DENIED_ERROR
    1049: "the database does not exist",  # ER_BAD_DB_ERROR
    1146: "a table is missing: is the schema at the code's revision?",  # ER_NO_SUCH_TABLE
    1054: "a column is missing: is the schema at the code's revision?",  # ER_BAD_FIELD_ERROR
    1114: "a table is full (the disk?)",  # ER_RECORD_FILE_FULL
    1021: "the disk is full",  # ER_DISK_FULL
}
"""MySQL/MariaDB error numbers that no retry cures."""


def permanent_reason(exc: BaseException) -> str | None:
    """Why a database error is one that no retry cures, or None when a retry may.

    A read-only file, missing permissions, a full disk, a missing table or database: retrying
    them only delays the same answer (a trigger waited seven seconds for its 503), so they are
    answered at once and refused at start. The driver's own error is read (SQLite's result
    code, PostgreSQL's SQLSTATE, MySQL's error number), wherever SQLAlchemy wrapped it.
    """
    for error in _driver_errors(exc):
        code = getattr(error, "sqlite_errorcode", None)
        if isinstance(code, int):
            if code & 0xFF in PERMANENT_SQLITE_CODES:
                return PERMANENT_SQLITE_CODES[code & 0xFF]
            if "no such table" in str(error):
                return "a table is missing: is the schema at the code's revision?"
        sqlstate = getattr(error, "sqlstate", None)
        if isinstance(sqlstate, str) and sqlstate in PERMANENT_SQLSTATES:
            return PERMANENT_SQLSTATES[sqlstate]
        args: tuple[object, ...] = error.args
        if args and isinstance(args[0], int) and args[0] in PERMANENT_MYSQL_ERRORS:
            return PERMANENT_MYSQL_ERRORS[args[0]]
    return None


def _driver_errors(exc: BaseException) -> list[BaseException]:
    """``exc``, the driver error SQLAlchemy wrapped in it, and their causes (at most a few)."""
    found: list[BaseException] = []
    pending: list[BaseException | None] = [exc]
    while pending and len(found) < 8:
        error = pending.pop()
        if error is None or error in found:
            continue
        found.append(error)
        pending.append(error.__cause__)
        if isinstance(error, DBAPIError):
            pending.append(error.orig)
    return found


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a lost or refused connection that a retry may cure."""
    if permanent_reason(exc) is not None:
        return False
    if isinstance(exc, OperationalError | DisconnectionError):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


def is_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database is out of reach: transient, or no pooled connection."""
    return is_transient(exc) or isinstance(exc, PoolTimeoutError)


def as_unavailable(exc: BaseException) -> BackendUnavailable | None:
    """``exc`` as Moorline's :class:`~moorline.errors.BackendUnavailable`, if it is an outage.

    An outage is a lost or refused connection (:func:`is_transient`), a pool that gave no
    connection in time, or a database that refuses the work for good (:func:`permanent_reason`:
    answered at once, with the reason); anything else is a bug (or a constraint the caller
    should have translated) and gives None.
    """
    reason = permanent_reason(exc)
    if reason is not None:
        return BackendUnavailable(f"the database refuses the work: {reason}")
    if is_unavailable(exc):
        return BackendUnavailable("the database is unavailable; retry later")
    return None


def describe_db_error(exc: BaseException) -> str:
    """One line saying why a database operation failed, from the driver's own error.

    SQLAlchemy wraps driver errors (and its asyncpg adapter wraps them once more) with the
    statement and parameters attached; the innermost driver message is what an operator needs.
    """
    inner: BaseException = exc
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        inner = exc.orig
        while inner.__cause__ is not None and type(inner).__module__.startswith("sqlalchemy"):
            inner = inner.__cause__
    text = " ".join(str(inner).split())
    reason = f"{type(inner).__name__}: {text}" if text else type(inner).__name__
    if len(reason) > MAX_REASON_CHARS:
        reason = reason[: MAX_REASON_CHARS - 1] + "…"
    return reason
