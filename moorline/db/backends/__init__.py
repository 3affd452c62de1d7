"""One class per database: what each backend can do and the strategies that differ.

:class:`~moorline.db.backends.base.Backend` names every point where SQLite, PostgreSQL and
MySQL/MariaDB differ; :mod:`.sqlite`, :mod:`.postgresql` and :mod:`.mysql` implement them (and
:mod:`.pgbouncer`, PostgreSQL behind PgBouncer in transaction mode),
the two servers over what :mod:`.server` shares (the failover pool, autocommit writes), and
SQLite with its WAL checkpointer (:mod:`.sqlite_checkpoint`). What a database error means is
decided beside them, in :mod:`moorline.db.failures`. The rest of ``moorline.db`` asks the
manager's ``backend`` (a :class:`Backend`) and its frozen
:class:`~moorline.db.backends.base.Capabilities`, and never tests a dialect name itself.

Imports: SQLAlchemy, the drivers (and Moorline's adapters of them, ``moorline.db.sqlite_driver``
and ``moorline.db.mysql_driver``), ``moorline.db.types``, ``moorline.db.dsn``,
``moorline.db.failures``, ``moorline.settings`` and ``moorline.errors``; never the manager or a
repository.
"""

from collections.abc import Mapping

from moorline.db.backends.base import Backend, Capabilities, DialectName, Pools
from moorline.db.backends.mysql import MySQLBackend
from moorline.db.backends.pgbouncer import PgBouncerBackend
from moorline.db.backends.postgresql import PostgreSQLBackend
from moorline.db.backends.sqlite import SQLiteBackend
from moorline.db.dsn import Driver
from moorline.errors import ConfigError
from moorline.settings import DatabasePooler

__all__ = [
    "Backend",
    "Capabilities",
    "DialectName",
    "PgBouncerBackend",
    "Pools",
    "backend_for",
    "backend_for_driver",
]

_CLASSES: Mapping[str, type[Backend]] = {
    "sqlite": SQLiteBackend,
    "postgresql": PostgreSQLBackend,
    "mysql": MySQLBackend,
}


_BY_DRIVER: Mapping[Driver, type[Backend]] = {
    "sqlite": SQLiteBackend,
    "postgres": PostgreSQLBackend,
    "mysql": MySQLBackend,
}


def backend_for(name: DialectName) -> Backend:
    """A new backend of the dialect ``name``: no pools yet, and cheap to make."""
    return _CLASSES[name]()


def backend_for_driver(driver: Driver, pooler: DatabasePooler = DatabasePooler.NONE) -> Backend:
    """A new backend for URLs of the driver family ``driver`` (see ``dsn.driver_of``).

    Args:
        driver: The URLs' driver family.
        pooler: What the URLs reach (``MOORLINE_DATABASE_POOLER``).

    Raises:
        ConfigError: a pooler named for a database it does not pool.
    """
    if pooler is DatabasePooler.PGBOUNCER:
        if driver != "postgres":
            raise ConfigError(
                "MOORLINE_DATABASE_POOLER=pgbouncer needs PostgreSQL URLs "
                f"(postgresql+asyncpg://), not {driver}"
            )
        return PgBouncerBackend()
    return _BY_DRIVER[driver]()
