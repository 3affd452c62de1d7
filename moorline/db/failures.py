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


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a lost or refused connection that a retry may cure."""
    if isinstance(exc, OperationalError | DisconnectionError):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


def is_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database is out of reach: transient, or no pooled connection."""
    return is_transient(exc) or isinstance(exc, PoolTimeoutError)


def as_unavailable(exc: BaseException) -> BackendUnavailable | None:
    """``exc`` as Moorline's :class:`~moorline.errors.BackendUnavailable`, if it is an outage.

    An outage is a lost or refused connection (:func:`is_transient`) or a pool that gave no
    connection in time; anything else is a bug (or a constraint the caller should have
    translated) and gives None.
    """
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
