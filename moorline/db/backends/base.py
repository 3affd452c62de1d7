"""The backend seam: :class:`Capabilities` and the strategies each database implements."""

from dataclasses import dataclass, fields
from typing import ClassVar, Literal

DialectName = Literal["sqlite", "postgresql", "mysql"]


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
