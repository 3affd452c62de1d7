"""SQLite (aiosqlite): one file, one writer at a time, statements on the event loop."""

from typing import ClassVar

from moorline.db.backends.base import Backend, Capabilities, DialectName


class SQLiteBackend(Backend):
    """The embedded default: no server, ``BEGIN IMMEDIATE`` serialises writers."""

    name: ClassVar[DialectName] = "sqlite"
    capabilities: ClassVar[Capabilities] = Capabilities(
        server=False,
        embedded=True,
        row_locks=False,
        skip_locked=False,
        update_returning=True,
        insert_returning=True,
        upsert_returning=True,
        one_statement_submit=False,
        listen_notify=False,
        terminate_backend=False,
    )
