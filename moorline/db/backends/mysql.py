"""MySQL and MariaDB (aiomysql): row locks and SKIP LOCKED, no ``UPDATE … RETURNING``."""

from typing import ClassVar

from moorline.db.backends.base import Backend, Capabilities, DialectName


class MySQLBackend(Backend):
    """MariaDB ≥ 10.6 (and MySQL 8): ``INSERT … RETURNING`` on MariaDB only."""

    name: ClassVar[DialectName] = "mysql"
    capabilities: ClassVar[Capabilities] = Capabilities(
        server=True,
        embedded=False,
        row_locks=True,
        skip_locked=True,
        update_returning=False,
        insert_returning=True,
        upsert_returning=False,
        one_statement_submit=False,
        listen_notify=False,
        terminate_backend=False,
    )
