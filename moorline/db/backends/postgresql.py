"""PostgreSQL (asyncpg): row locks, SKIP LOCKED, RETURNING everywhere, LISTEN/NOTIFY."""

from typing import ClassVar

from moorline.db.backends.base import Backend, Capabilities, DialectName


class PostgreSQLBackend(Backend):
    """The server backend with every capability."""

    name: ClassVar[DialectName] = "postgresql"
    capabilities: ClassVar[Capabilities] = Capabilities(
        server=True,
        embedded=False,
        row_locks=True,
        skip_locked=True,
        update_returning=True,
        insert_returning=True,
        upsert_returning=True,
        one_statement_submit=True,
        listen_notify=True,
        terminate_backend=True,
    )
