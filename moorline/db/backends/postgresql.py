"""PostgreSQL (asyncpg): row locks, SKIP LOCKED, RETURNING everywhere, LISTEN/NOTIFY."""

from typing import ClassVar

from sqlalchemy import BigInteger, bindparam, insert, select
from sqlalchemy.sql.selectable import CTE

from moorline.db.backends.base import Backend, Capabilities, DialectName
from moorline.db.schema import runs


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

    # --- run inserts ---

    def submitted_runs(self, columns: tuple[str, ...]) -> CTE:
        """Runs from ``jsonb_to_recordset``, stamped with ``transaction_timestamp()``.

        A data-modifying CTE, so the caller's outer statement can insert the runs' events
        from what it returns: one round trip where a transaction takes five (BEGIN, the
        time, two INSERTs, COMMIT), whatever the number of runs, and as atomic.
        """
        from moorline.db import dialects

        start = self.transaction_time()
        types = {**{name: runs.c[name].type for name in columns}, "delay_us": BigInteger()}
        source = self.rows_parameter("runs", types)
        if start is None or source is None:  # pragma: no cover - PostgreSQL has both
            raise AssertionError("PostgreSQL has a transaction time and a rows parameter")
        chosen = select(
            *(source.c[name] for name in columns),
            bindparam("status", type_=runs.c.status.type),
            start,
            start,
            dialects.microseconds_after(start, source.c.delay_us),
        )
        names = [*columns, "status", "created_at", "updated_at", "not_before"]
        return (
            insert(runs)
            .from_select(names, chosen)
            .returning(runs.c.id, runs.c.attempt, runs.c.updated_at)
            .cte("submitted")
        )
