"""PostgreSQL (asyncpg): row locks, SKIP LOCKED, RETURNING everywhere, LISTEN/NOTIFY.

One pool serves transactions and one-statement writes alike: asyncpg's transaction mode is
client-side, so a checkout switches to autocommit and back without a round trip. With
``fast_paths`` both send their statements to asyncpg past SQLAlchemy's execution
(:mod:`moorline.db.backends.postgresql_direct`), and a one-statement write does not switch at
all: a checked-in connection has no transaction open.
"""

import functools
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import (
    BigInteger,
    Executable,
    Float,
    Insert,
    Interval,
    Row,
    Select,
    Table,
    Text,
    bindparam,
    column,
    exists,
    func,
    insert,
    literal,
    literal_column,
    select,
    text,
    type_coerce,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import CTE, TableValuedAlias
from sqlalchemy.types import TypeEngine

from moorline import fastpaths
from moorline.db.backends.base import Capabilities, DialectName, Pools, SelectT, upsert_below
from moorline.db.backends.direct import DirectConnection
from moorline.db.backends.postgresql_direct import DirectStatements
from moorline.db.backends.server import ServerBackend, discard_read_only
from moorline.db.dsn import ConnectTarget
from moorline.db.schema import runs
from moorline.db.types import UTCDateTime
from moorline.settings import Settings


class PostgreSQLBackend(ServerBackend):
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
        dml_in_cte=True,
        listen_notify=True,
        session_state=True,
        terminate_backend=True,
        migrations=True,
    )
    url_scheme = "postgresql+asyncpg://"
    _direct: DirectStatements | None = None
    """Statements past SQLAlchemy's execution (with ``fast_paths``)."""

    def now(self, *, plus_s: float = 0.0) -> ColumnElement[datetime]:
        return _now(float(plus_s))

    def now_less(self, parameter: str) -> ColumnElement[datetime]:
        return _now_less(parameter)

    def select_now(self) -> Select[Any]:
        return _select_now()

    def transaction_time(self) -> ColumnElement[datetime] | None:
        """``transaction_timestamp()``: in autocommit, the statement's start."""
        return _transaction_time()

    def rows_parameter(
        self, parameter: str, columns: Mapping[str, TypeEngine[Any]]
    ) -> TableValuedAlias | None:
        """``jsonb_to_recordset`` of the parameter: one bound value for all the rows."""
        table = func.jsonb_to_recordset(bindparam(parameter, type_=postgresql.JSONB()))
        named = [column(each, type_) for each, type_ in columns.items()]
        return table.table_valued(*named).render_derived(with_types=True)

    async def read_in_index_order(self, conn: AsyncConnection) -> None:
        """``SET LOCAL enable_sort = off``: a backlog is never read whole to be sorted.

        PostgreSQL estimates rows from statistics, and those of ``runs`` are often wrong for
        queued runs: a young table has none, and a table analysed while little was queued
        says few are. Then reading the tenant's queued runs through another index (its
        conversations, its listing) and sorting them looks as cheap as reading the first few
        in ``ix_runs_lane_tenant``'s order, and costs a scan of the whole backlog per claim.
        A sort is priced out for this transaction only; where no index gives the order, the
        planner still sorts.
        """
        await conn.execute(_INDEX_ORDER)

    def index_order_condition(self) -> ColumnElement[bool]:
        """``SET LOCAL enable_sort = off``, as a condition: ``(SELECT set_config(…)) = 'off'``.

        An uncorrelated subquery: the planner makes the comparison the statement's one-time
        filter, evaluated once before the first row is read, so the setting is made even when
        no row matches. ``set_config(…, true)`` lasts until the transaction ends, as
        ``SET LOCAL`` does.
        """
        return _INDEX_ORDER_CONDITION

    def notify_condition(self) -> ColumnElement[bool]:
        """``(SELECT count(pg_notify(channel, p)) FROM unnest(payloads) p) >= 0``.

        An uncorrelated subquery, as in :meth:`index_order_condition`: it runs once, before
        the statement's first row is read. A statement that stores no rows may send them all
        the same (a spare wake-up, which costs a claim); one that stores rows always does.
        """
        return _NOTIFY_CONDITION

    def lock_rows(self, stmt: SelectT) -> SelectT:
        """``FOR NO KEY UPDATE``: it excludes other claimers, not a foreign-key check.

        A foreign-key check takes ``FOR KEY SHARE``, so enqueuing runs for a tenant never
        waits behind a claim.
        """
        return stmt.with_for_update(key_share=True)

    def lock_rows_skip_locked(self, stmt: SelectT) -> SelectT:
        return stmt.with_for_update(skip_locked=True)

    def insert_ignoring_duplicates(self, table: Table) -> Insert:
        """``ON CONFLICT DO NOTHING``, which locks nothing."""
        return postgresql.insert(table).on_conflict_do_nothing()

    def add_to_counters(
        self, table: Table, *, keys: Sequence[str], columns: Sequence[str]
    ) -> Insert:
        insert = postgresql.insert(table)
        return insert.on_conflict_do_update(
            index_elements=list(keys),
            set_={column: table.c[column] + insert.excluded[column] for column in columns},
        )

    def increment_below(
        self, table: Table, *, column: str, limit: int, keys: dict[str, Any]
    ) -> Insert | None:
        return upsert_below(postgresql.insert(table), table, column, limit, keys)

    def create_pools(self, settings: Settings, url: str, targets: Sequence[ConnectTarget]) -> Pools:
        engine = self.create_engine(settings, targets, autocommit=False)
        if settings.fast_paths:
            fastpaths.require("sqlalchemy")
            self._direct = DirectStatements(engine.sync_engine, own_hooks=(discard_read_only,))
        return Pools(main=engine)

    @asynccontextmanager
    async def transaction(self, pools: Pools) -> AsyncIterator[AsyncConnection]:
        """As the base's, on a connection whose statements go to asyncpg past SQLAlchemy."""
        if self._direct is None:
            async with super().transaction(pools) as conn:
                yield conn
            return
        async with DirectConnection(pools.main, self._direct) as direct, direct.begin():
            yield direct

    async def write_statement(
        self, pools: Pools, statement: Executable, params: dict[str, Any]
    ) -> int:
        direct = self._direct
        if direct is not None and (form := direct.form(statement, params, rows=False)) is not None:
            return (await direct.write(form, params)).rowcount
        return await super().write_statement(pools, statement, params)

    async def write_statement_rows(
        self, pools: Pools, statement: Executable, params: dict[str, Any]
    ) -> list[Row[Any]]:
        direct = self._direct
        if direct is not None and (form := direct.form(statement, params, rows=True)) is not None:
            return list(await direct.write(form, params))
        return await super().write_statement_rows(pools, statement, params)

    # --- run inserts ---

    def submitted_runs(self, columns: tuple[str, ...], gate: CTE | None = None) -> CTE:
        """Runs from ``jsonb_to_recordset``, stamped with ``transaction_timestamp()``.

        A data-modifying CTE, so the caller's outer statement can insert the runs' events
        from what it returns: one round trip where a transaction takes five (BEGIN, the
        time, two INSERTs, COMMIT), whatever the number of runs, and as atomic.
        """
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
            microseconds_after(start, source.c.delay_us),
        )
        if gate is not None:
            # Every CTE of a statement sees one snapshot, but what a data-modifying one
            # returns is visible to the others: the runs go in only beside the units taken.
            chosen = chosen.where(exists(select(literal(1)).select_from(gate)))
        names = [*columns, "status", "created_at", "updated_at", "not_before"]
        # The columns not named take their server defaults: SQLAlchemy's own would be bound
        # parameters, which it leaves unset when the statement holds another DML CTE first.
        return (
            insert(runs)
            .from_select(names, chosen, include_defaults=False)
            .returning(runs.c.id, runs.c.attempt, runs.c.updated_at)
            .cte("submitted")
        )


def microseconds_after(
    time: ColumnElement[datetime], delay_us: ColumnElement[int]
) -> ColumnElement[datetime]:
    """``time`` plus ``delay_us`` microseconds, exactly, for a :meth:`transaction_time`.

    An interval of microseconds only, no days: no time-zone arithmetic, so Python's
    ``time + timedelta(microseconds=delay_us)`` gives the same instant.
    """
    micro = literal_column("interval '1 microsecond'", type_=Interval())
    return type_coerce(time.op("+")(micro.op("*")(delay_us)), UTCDateTime())


_INDEX_ORDER = text("SET LOCAL enable_sort = off")
_INDEX_ORDER_CONDITION = select(
    func.set_config("enable_sort", "off", True)
).scalar_subquery() == literal("off")

_WAKE_PAYLOADS = func.unnest(bindparam("wake_payloads", type_=postgresql.ARRAY(Text()))).alias(
    "payload"
)
_NOTIFY_CONDITION = (
    select(func.count(func.pg_notify(bindparam("wake_channel", type_=Text()), column("payload"))))
    .select_from(_WAKE_PAYLOADS)
    .scalar_subquery()
    >= 0
)


@functools.lru_cache(maxsize=256)
def _now(plus_s: float) -> ColumnElement[datetime]:
    expr = func.clock_timestamp() + func.make_interval(0, 0, 0, 0, 0, 0, literal(plus_s))
    return type_coerce(expr, UTCDateTime())


@functools.cache
def _now_less(parameter: str) -> ColumnElement[datetime]:
    seconds = bindparam(parameter, type_=Float())
    expr = func.clock_timestamp() - func.make_interval(0, 0, 0, 0, 0, 0, seconds)
    return type_coerce(expr, UTCDateTime())


@functools.cache
def _select_now() -> Select[Any]:
    return select(_now(0.0))


@functools.cache
def _transaction_time() -> ColumnElement[datetime]:
    return type_coerce(func.transaction_timestamp(), UTCDateTime())
