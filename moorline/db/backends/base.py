"""The backend seam: :class:`Capabilities` and the strategies each database implements."""

from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, ClassVar, Literal, TypeVar

from sqlalchemy import Insert, Select, Table
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import CTE, TableValuedAlias
from sqlalchemy.types import TypeEngine

DialectName = Literal["sqlite", "postgresql", "mysql"]

_SelectT = TypeVar("_SelectT", bound=Select[Any])


@dataclass(frozen=True, slots=True, kw_only=True)
class Capabilities:
    """What a database can do, as the code and the test suite's ``requires`` markers name it.

    A test marked ``@pytest.mark.requires("skip_locked")`` runs on the backends whose
    capability of that name is true; the code branches on the same fields, never on a name.
    """

    server: bool
    """A database server shared by many processes (not a file one process embeds)."""
    embedded: bool
    """A file in the process (SQLite): one writer at a time, no server to stop or partition."""
    row_locks: bool
    """Writers are serialised by row locks (``SELECT … FOR UPDATE``), not one write lock."""
    skip_locked: bool
    """``SELECT … FOR UPDATE SKIP LOCKED``."""
    update_returning: bool
    """``UPDATE … RETURNING``."""
    insert_returning: bool
    """``INSERT … RETURNING``."""
    upsert_returning: bool
    """``INSERT … ON CONFLICT … DO UPDATE … RETURNING``."""
    one_statement_submit: bool
    """A submission (runs and their events) is one statement, stamped with the server's time."""
    listen_notify: bool
    """``LISTEN``/``NOTIFY``, a wake-up transport without Redis."""
    terminate_backend: bool
    """The server can end another session (``pg_terminate_backend``), as fault tests do."""

    def names(self) -> frozenset[str]:
        """The names of the capabilities this backend has."""
        return frozenset(f.name for f in fields(self) if getattr(self, f.name))


class Backend:
    """One database's strategies. Subclasses set :attr:`name` and :attr:`capabilities`."""

    name: ClassVar[DialectName]
    capabilities: ClassVar[Capabilities]

    # --- SQL fragments (delegating to moorline.db.dialects until it is folded in here) -----

    @property
    def write_isolation_level(self) -> str | None:
        """The isolation level of dispatch write transactions, or None for the default."""
        from moorline.db import dialects

        return dialects.write_isolation_level(self.name)

    def now(self, *, plus_s: float = 0.0) -> ColumnElement[datetime]:
        """The database's current UTC time (plus an offset), as an SQL expression."""
        from moorline.db import dialects

        return dialects.db_now(self.name, plus_s=plus_s)

    def select_now(self) -> Select[Any]:
        """``SELECT`` of the database's current time."""
        from moorline.db import dialects

        return dialects.select_db_now(self.name)

    def transaction_time(self) -> ColumnElement[datetime] | None:
        """The database's time at the start of the transaction, or None where there is none."""
        from moorline.db import dialects

        return dialects.transaction_time(self.name)

    def rows_parameter(
        self, parameter: str, columns: Mapping[str, TypeEngine[Any]]
    ) -> TableValuedAlias | None:
        """A table whose rows are bound as one parameter, or None where there is none."""
        from moorline.db import dialects

        return dialects.rows_parameter(self.name, parameter, columns)

    def statement_time(
        self, dialect: Dialect
    ) -> tuple[ColumnElement[datetime], ColumnElement[datetime]] | None:
        """For an INSERT that returns what it stored: its time, and it plus ``delay_us``."""
        from moorline.db import dialects

        return dialects.statement_time(dialect)

    def lock_rows(self, stmt: _SelectT) -> _SelectT:
        """``stmt`` taking exclusive row locks that wait, held until the transaction ends."""
        from moorline.db import dialects

        return dialects.lock_rows(stmt, self.name)

    def lock_rows_skip_locked(self, stmt: _SelectT) -> _SelectT:
        """``stmt`` as ``SELECT … FOR UPDATE SKIP LOCKED`` where there are row locks."""
        from moorline.db import dialects

        return dialects.lock_rows_skip_locked(stmt, self.name)

    def insert_ignoring_duplicates(self, table: Table) -> Insert:
        """An INSERT into ``table`` that inserts nothing (rowcount 0) on a duplicate key."""
        from moorline.db import dialects

        return dialects.insert_ignoring_duplicates(table, self.name)

    def insert_or_lock_existing(self, table: Table, column: str) -> Insert:
        """An INSERT into ``table`` that leaves an existing row (same key) as it is, locked."""
        from moorline.db import dialects

        return dialects.insert_or_lock_existing(table, self.name, column)

    def increment_below(
        self, table: Table, *, column: str, limit: int, keys: dict[str, Any]
    ) -> Insert | None:
        """One statement adding 1 to ``column`` while below ``limit``, or None where none."""
        from moorline.db import dialects

        return dialects.increment_below(table, self.name, column=column, limit=limit, keys=keys)

    # --- run inserts ---

    def submitted_runs(self, columns: tuple[str, ...]) -> CTE | None:
        """Runs bound as one parameter, inserted in one statement that stamps them itself.

        ``INSERT INTO runs … SELECT … FROM <the runs parameter> RETURNING id, attempt,
        updated_at``, as the CTE ``submitted``. The ``runs`` parameter holds one dict per run
        with ``columns`` and ``delay_us``; ``status`` is one parameter for all. Each run is
        stamped with the transaction's time (``created_at``, ``updated_at``) and ``not_before``
        is that plus its ``delay_us`` microseconds, exactly, so ``time + timedelta`` in Python
        gives the same instant. None where a submission is not one statement (the capability
        ``one_statement_submit``).
        """
        return None

    def stamped_runs_insert(self, dialect: Dialect) -> Insert | None:
        """An INSERT of runs that stamps them with its own time and returns it, or None.

        ``created_at`` and ``updated_at`` are the statement's time, ``not_before`` that plus
        the bound ``delay_us`` microseconds; it returns ``id`` and ``created_at`` per run, so
        the time is never read in a statement of its own. None where the connected server
        (``dialect``, which knows its version) has no such INSERT.
        """
        return None


def backend_for(name: DialectName) -> Backend:
    """The backend of the dialect ``name``."""
    from moorline.db.backends.mysql import MySQLBackend
    from moorline.db.backends.postgresql import PostgreSQLBackend
    from moorline.db.backends.sqlite import SQLiteBackend

    classes: dict[str, type[Backend]] = {
        "sqlite": SQLiteBackend,
        "postgresql": PostgreSQLBackend,
        "mysql": MySQLBackend,
    }
    return classes[name]()
