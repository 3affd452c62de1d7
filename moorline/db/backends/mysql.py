"""MySQL and MariaDB (aiomysql, as :mod:`moorline.db.mysql_driver` adapts it).

Row locks and SKIP LOCKED, no ``UPDATE … RETURNING``. aiomysql's switch to autocommit and back
costs three round trips each way, so one-statement writes get a second pool whose connections
stay in autocommit.
"""

import functools
from collections.abc import Sequence
from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import (
    BigInteger,
    Float,
    Insert,
    Select,
    Table,
    bindparam,
    func,
    insert,
    literal_column,
    select,
    type_coerce,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Dialect, Engine
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.elements import ColumnElement

from moorline.db import mysql_driver
from moorline.db.backends.base import Capabilities, DialectName, Pools, SelectT
from moorline.db.backends.server import ServerBackend
from moorline.db.dsn import ConnectTarget
from moorline.db.schema import runs
from moorline.db.types import UTCDateTime
from moorline.settings import Settings


class MySQLBackend(ServerBackend):
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
        dml_in_cte=False,
        listen_notify=False,
        session_state=True,
        terminate_backend=False,
        migrations=True,
    )
    url_scheme = "mysql+aiomysql://"

    def now(self, *, plus_s: float = 0.0) -> ColumnElement[datetime]:
        return _now(float(plus_s))

    def now_less(self, parameter: str) -> ColumnElement[datetime]:
        return _now_less(parameter)

    def select_now(self) -> Select[Any]:
        return _select_now()

    def statement_time(
        self, dialect: Dialect
    ) -> tuple[ColumnElement[datetime], ColumnElement[datetime]] | None:
        """``UTC_TIMESTAMP(6)``, where the server has ``INSERT … RETURNING`` (MariaDB ≥ 10.5)."""
        if not dialect.insert_returning:
            return None
        return _statement_time()

    def lock_rows(self, stmt: SelectT) -> SelectT:
        return stmt.with_for_update()

    def lock_rows_skip_locked(self, stmt: SelectT) -> SelectT:
        return stmt.with_for_update(skip_locked=True)

    def insert_ignoring_duplicates(self, table: Table) -> Insert:
        """``INSERT IGNORE``, which leaves a shared lock on an existing row."""
        return mysql.insert(table).prefix_with("IGNORE")

    def insert_or_lock_existing(self, table: Table, column: str) -> Insert:
        """``ON DUPLICATE KEY UPDATE <column> = <column>``: the exclusive lock at once.

        ``INSERT IGNORE`` takes a shared lock, and two transactions that both upgrade theirs
        deadlock; with the exclusive lock taken at once such transactions queue.
        """
        return mysql.insert(table).on_duplicate_key_update({column: table.c[column]})

    def add_to_counters(
        self, table: Table, *, keys: Sequence[str], columns: Sequence[str]
    ) -> Insert:
        """``ON DUPLICATE KEY UPDATE``, which needs no key columns named."""
        insert = mysql.insert(table)
        return insert.on_duplicate_key_update(
            {column: table.c[column] + insert.inserted[column] for column in columns}
        )

    def increment_below(
        self, table: Table, *, column: str, limit: int, keys: dict[str, Any]
    ) -> Insert | None:
        """None: no ``INSERT … ON CONFLICT … RETURNING`` on MySQL or MariaDB."""
        return None

    def analyze_statement(self, tables: Sequence[str]) -> str:
        """``ANALYZE TABLE`` of ``tables``: MySQL names the tables it analyses."""
        return f"ANALYZE TABLE {', '.join(tables)}"

    def create_pools(self, settings: Settings, url: str, targets: Sequence[ConnectTarget]) -> Pools:
        return Pools(
            main=self.create_engine(settings, targets, autocommit=False),
            autocommit=self.create_engine(settings, targets, autocommit=True),
        )

    def autocommit_target(self, pools: Pools) -> tuple[Engine, bool]:
        """The autocommit pool, whose connections are already there."""
        assert pools.autocommit is not None  # create_pools always makes it
        return pools.autocommit.sync_engine, False

    async def commit_with_next_statement(self, conn: AsyncConnection) -> None:
        """Send ``COMMIT`` in the same query as the next statement: a round trip less.

        For a write transaction's last statement, executed once (not an ``executemany``
        SQLAlchemy may split); the transaction's own commit then sends nothing
        (:meth:`moorline.db.mysql_driver.Connection.commit_with_next_statement`). Nothing may
        run in the transaction after that statement.
        """
        driver = (await conn.get_raw_connection()).driver_connection
        if isinstance(driver, mysql_driver.Connection):
            driver.commit_with_next_statement()

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


@functools.lru_cache(maxsize=256)
def _now(plus_s: float) -> ColumnElement[datetime]:
    micros = round(plus_s * 1_000_000)
    expr = func.timestampadd(literal_column("MICROSECOND"), micros, func.utc_timestamp(6))
    return type_coerce(expr, UTCDateTime())


@functools.cache
def _now_less(parameter: str) -> ColumnElement[datetime]:
    # TIMESTAMPADD takes whole units: the seconds as microseconds.
    micros = func.round(bindparam(parameter, type_=Float()) * -1_000_000)
    expr = func.timestampadd(literal_column("MICROSECOND"), micros, func.utc_timestamp(6))
    return type_coerce(expr, UTCDateTime())


@functools.cache
def _select_now() -> Select[Any]:
    return select(_now(0.0))


@functools.cache
def _statement_time() -> tuple[ColumnElement[datetime], ColumnElement[datetime]]:
    # UTC_TIMESTAMP is evaluated once per statement, at its start, like NOW().
    later = func.timestampadd(
        literal_column("MICROSECOND"),
        bindparam("delay_us", type_=BigInteger()),
        func.utc_timestamp(6),
    )
    return _now(0.0), type_coerce(later, UTCDateTime())
