"""MySQL and MariaDB (aiomysql): row locks and SKIP LOCKED, no ``UPDATE … RETURNING``."""

import functools
from datetime import datetime
from typing import ClassVar

from sqlalchemy import ColumnElement, Insert, insert
from sqlalchemy.engine import Dialect

from moorline.db.backends.base import Backend, Capabilities, DialectName
from moorline.db.schema import runs


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

    # --- run inserts ---

    def stamped_runs_insert(self, dialect: Dialect) -> Insert | None:
        """MariaDB's ``INSERT … RETURNING`` stamped with ``UTC_TIMESTAMP(6)``; None on MySQL.

        MySQL has no ``RETURNING``; SQLAlchemy sets ``insert_returning`` from the server's
        version, hence the connected ``dialect``.
        """
        times = self.statement_time(dialect)
        return None if times is None else self._stamped_runs(times)

    @staticmethod
    @functools.cache
    def _stamped_runs(times: tuple[ColumnElement[datetime], ColumnElement[datetime]]) -> Insert:
        # One statement object for every batch: SQLAlchemy derives its cache key once.
        start, later = times
        return (
            insert(runs)
            .values(created_at=start, updated_at=start, not_before=later)
            .returning(runs.c.id, runs.c.created_at)
        )
