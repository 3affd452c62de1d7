"""The backend seam: :class:`Capabilities` and the strategies each database implements.

A :class:`Backend` is built per :class:`~moorline.db.manager.DatabaseManager` (it may hold that
database's process-local state: SQLite's writer queue and WAL checkpointer). Its SQL fragments
are built once per process by cached module-level helpers of each backend module (SQL
expressions are immutable, and building them was a measurable part of a submit's CPU), so a
backend object costs nothing to make.
"""

import abc
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, ClassVar, Literal, TypeVar

from sqlalchemy import Executable, Insert, Row, Select, Table
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import CTE, TableValuedAlias
from sqlalchemy.types import TypeEngine

from moorline.db.dsn import ConnectTarget
from moorline.settings import Settings

DialectName = Literal["sqlite", "postgresql", "mysql"]

SelectT = TypeVar("SelectT", bound=Select[Any])


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
    """Writers are serialised by row locks (``SELECT … FOR UPDATE``), not one write lock.

    With row locks a claim must lock what it counts (the tenant rows) and skip rows other
    claimers hold; under SQLite's write lock nothing else can write while a claim runs."""
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
    dml_in_cte: bool
    """One statement may change rows and insert from what it changed (``WITH moved AS (UPDATE
    … RETURNING …) INSERT … SELECT … FROM moved``): a transition and its events in one round
    trip."""
    listen_notify: bool
    """``LISTEN``/``NOTIFY``, a wake-up transport without Redis."""
    session_state: bool
    """A pooled connection is one server session from its opening to its end, so what a
    session keeps between transactions (a ``LISTEN``, named prepared statements) is there
    for its next transaction. False behind a transaction pooler (PgBouncer), where the next
    transaction may run on another server session."""
    terminate_backend: bool
    """The server can end another session (``pg_terminate_backend``), as fault tests do."""
    migrations: bool
    """The schema is reached through Alembic revisions (``moorline db upgrade``); without,
    ``create_all`` builds it from the metadata at start."""

    def names(self) -> frozenset[str]:
        """The names of the capabilities this backend has."""
        return frozenset(f.name for f in fields(self) if getattr(self, f.name))


@dataclass(frozen=True, slots=True, kw_only=True)
class Pools:
    """The engines a backend made for one manager."""

    main: AsyncEngine
    """Reads and transactions."""
    autocommit: AsyncEngine | None = None
    """Connections that stay in autocommit, for one-statement writes (MariaDB only)."""

    @property
    def all(self) -> tuple[AsyncEngine, ...]:
        """Every engine, the main one first."""
        return (self.main,) if self.autocommit is None else (self.main, self.autocommit)


class Backend(abc.ABC):
    """One database's strategies. Subclasses set :attr:`name` and :attr:`capabilities`."""

    name: ClassVar[DialectName]
    capabilities: ClassVar[Capabilities]

    @property
    def shared_file(self) -> str | None:
        """The database file that every process on this host opens (SQLite), else None.

        None for a server, and for an in-memory database (one process). Processes that share
        the file can reach each other through the file system next to it (the datagram
        wake-ups of ``moorline.dispatch.datagrams``).
        """
        return None

    # --- SQL fragments ------------------------------------------------------------------------

    @property
    def write_isolation_level(self) -> str | None:
        """The isolation level of dispatch write transactions, or None for the default.

        READ COMMITTED on both servers: a claim counts a tenant's running runs *after* waiting
        for the tenant's row lock and must see what the previous holder committed. SQLite
        serialises writers with ``BEGIN IMMEDIATE`` and has no such level.
        """
        return None

    @abc.abstractmethod
    def now(self, *, plus_s: float = 0.0) -> ColumnElement[datetime]:
        """The database's current UTC time (plus an offset), as an SQL expression.

        Leases and the reaper compare against the database clock only, so workers whose clocks
        disagree cannot reap each other's live runs. Built once per offset and shared; the
        offsets in use are few (lease TTLs, retry backoffs).
        """

    @abc.abstractmethod
    def now_less(self, parameter: str) -> ColumnElement[datetime]:
        """The database's current UTC time less the seconds bound as ``parameter`` (a float).

        For a time the worker measured as an age rather than read: the start of a step that is
        recorded once it has ended. Built once per parameter name and shared.
        """

    @abc.abstractmethod
    def select_now(self) -> Select[Any]:
        """``SELECT`` of the database's current time, built once."""

    def transaction_time(self) -> ColumnElement[datetime] | None:
        """The database's time at the start of the transaction, or None where there is none.

        For writes that want the database's time without reading it first (a round trip): one
        value for every row and every statement of the transaction, never later than
        :meth:`now`. PostgreSQL only.
        """
        return None

    def rows_parameter(
        self, parameter: str, columns: Mapping[str, TypeEngine[Any]]
    ) -> TableValuedAlias | None:
        """A table whose rows are bound as one parameter, or None where there is none.

        The parameter ``parameter`` is a list of dicts by column name (a key missing from a
        dict is NULL); the table has the ``columns`` given. The statement's text is the same
        whatever the number of rows, so it is compiled and prepared once. PostgreSQL only.
        """
        return None

    def statement_time(
        self, dialect: Dialect
    ) -> tuple[ColumnElement[datetime], ColumnElement[datetime]] | None:
        """For an INSERT that returns what it stored: its time, and it plus ``delay_us``.

        The same value for every row of the statement (its start), so the INSERT stamps its
        rows and returns the time instead of a ``SELECT`` of the time going first. The second
        expression adds the bound integer parameter ``delay_us`` microseconds. MariaDB from
        10.5 only (``dialect.insert_returning``); None elsewhere.
        """
        return None

    def lock_rows(self, stmt: SelectT) -> SelectT:
        """``stmt`` taking exclusive row locks that wait, held until the transaction ends.

        Unchanged where there are no row locks (SQLite's write lock covers it).
        """
        return stmt

    def lock_rows_skip_locked(self, stmt: SelectT) -> SelectT:
        """``stmt`` as ``SELECT … FOR UPDATE SKIP LOCKED`` where there are row locks."""
        return stmt

    @abc.abstractmethod
    def insert_ignoring_duplicates(self, table: Table) -> Insert:
        """An INSERT into ``table`` that inserts nothing (rowcount 0) on a duplicate key."""

    def insert_or_lock_existing(self, table: Table, column: str) -> Insert:
        """An INSERT into ``table`` that leaves an existing row (same key) as it is.

        Unlike :meth:`insert_ignoring_duplicates`, no shared lock is left on the existing row
        for a later UPDATE of the same transaction to upgrade (two such upgrades deadlock).

        Args:
            table: The table to insert into.
            column: A non-key column of ``table``, "updated" to itself on a duplicate.
        """
        return self.insert_ignoring_duplicates(table)

    @abc.abstractmethod
    def increment_below(
        self, table: Table, *, column: str, limit: int, keys: dict[str, Any]
    ) -> Insert | None:
        """One statement adding 1 to ``column`` of the row at ``keys`` while below ``limit``.

        The row is inserted with ``column = 1`` when it does not exist; the statement returns
        the new value, or no row when the value had reached ``limit``. None where there is no
        ``INSERT … ON CONFLICT … RETURNING``: callers fall back to
        :meth:`insert_or_lock_existing` and a conditional UPDATE.

        Args:
            table: The table.
            column: The counter column.
            limit: The largest value the counter may reach (at least 1).
            keys: The row's primary key, by column name.
        """

    @abc.abstractmethod
    def add_to_counters(
        self, table: Table, *, keys: Sequence[str], columns: Sequence[str]
    ) -> Insert:
        """An INSERT of counter rows that adds ``columns`` to the rows that exist already.

        One statement for many rows (``.values([...])``): a row whose key (``keys``, the
        table's primary key) is new is inserted as given, an existing one gets the given
        values added to its ``columns``.
        """

    def analyze_statement(self, tables: Sequence[str]) -> str:
        """The statement refreshing the planner's statistics of ``tables`` (or of all)."""
        return "ANALYZE"

    # --- Connections and transactions ---------------------------------------------------------

    @abc.abstractmethod
    def create_pools(self, settings: Settings, url: str, targets: Sequence[ConnectTarget]) -> Pools:
        """The engines of one manager, over ``url`` (SQLite) or the failover ``targets``."""

    @asynccontextmanager
    async def transaction(self, pools: Pools) -> AsyncIterator[AsyncConnection]:
        """One write transaction on ``pools``, committed on exit, rolled back on error."""
        async with pools.main.connect() as conn, conn.begin():
            yield conn

    async def read_in_index_order(self, conn: AsyncConnection) -> None:
        """For the rest of ``conn``'s transaction, read ordered rows from an index, never sort.

        The claim reads a tenant's next runs in ``ix_runs_lane_tenant``'s order. Nothing by
        default: the other planners find that index from its columns alone.
        """
        return None

    def index_order_condition(self) -> ColumnElement[bool] | None:
        """A condition that does what :meth:`read_in_index_order` does, from a statement's WHERE.

        For a transaction whose first statement comes before the claim anyway (a slot
        handoff's lock of the runs it ends): one round trip less than a statement of its own.
        The condition is true, and takes effect whether or not the statement finds rows.
        None: nothing to do (the default, as for :meth:`read_in_index_order`).
        """
        return None

    def notify_condition(self) -> ColumnElement[bool] | None:
        """A condition that sends a notification per bound payload, true; None where none.

        The parameters are ``wake_channel`` (the channel) and ``wake_payloads`` (a list of
        strings). Notifications go out when the statement's transaction commits, and not at
        all if it rolls back, so a write can announce its own rows (see
        :mod:`moorline.db.repos.announcements`). PostgreSQL's ``pg_notify`` only.
        """
        return None

    async def commit_with_next_statement(self, conn: AsyncConnection) -> None:
        """Let the next statement on ``conn`` carry its transaction's commit, where it can.

        Nothing by default: PostgreSQL's commit has a round trip of its own, and SQLite's
        statements run inline.
        """
        return None

    @abc.abstractmethod
    async def write_statement(
        self, pools: Pools, statement: Executable, params: dict[str, Any]
    ) -> int:
        """Run one write ``statement`` as a transaction of its own; return its rowcount."""

    @abc.abstractmethod
    async def write_statement_rows(
        self, pools: Pools, statement: Executable, params: dict[str, Any]
    ) -> list[Row[Any]]:
        """As :meth:`write_statement`, for a statement with ``RETURNING``: its rows."""

    def background(self) -> AbstractContextManager[None]:
        """Within it, the current task's database work yields to the hot path where it can.

        SQLite runs small statements inline on the event loop; background work (the retention
        cleaner) sends them to the connection's thread instead. Nothing on the servers, whose
        statements never run on the loop.
        """
        return nullcontext()

    async def reclaim_space(self, pools: Pools, max_pages: int) -> int:
        """Give up to ``max_pages`` pages freed by deletions back to the file system.

        Returns the pages given back. Nothing on the servers, whose own background work
        (PostgreSQL's autovacuum, InnoDB's purge) makes the space of deleted rows reusable.
        """
        return 0

    async def data_version(self) -> int | None:
        """A number that changes whenever another connection commits a write; else None.

        The retention cleaner compares two readings to learn whether anything else wrote
        meanwhile. None where the backend cannot tell cheaply (the servers: other sessions'
        commits are not visible to one session without reading statistics).
        """
        return None

    def wal_bytes(self) -> int | None:
        """Size of the write-ahead log file where the backend watches one; else None."""
        return None

    async def close(self) -> None:
        """Let background work of the backend end (before the pools are disposed)."""
        return None

    # --- run inserts ---

    def submitted_runs(self, columns: tuple[str, ...], gate: CTE | None = None) -> CTE | None:
        """Runs bound as one parameter, inserted in one statement that stamps them itself.

        ``INSERT INTO runs … SELECT … FROM <the runs parameter> RETURNING id, attempt,
        updated_at``, as the CTE ``submitted``. The ``runs`` parameter holds one dict per run
        with ``columns`` and ``delay_us``; ``status`` is one parameter for all. Each run is
        stamped with the transaction's time (``created_at``, ``updated_at``) and ``not_before``
        is that plus its ``delay_us`` microseconds, exactly, so ``time + timedelta`` in Python
        gives the same instant. With ``gate`` (a CTE of the same statement), the runs are
        inserted only if it returns a row: a quota's units taken. None where a submission is
        not one statement (the capability ``one_statement_submit``).
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


def upsert_below(
    upsert: Any, table: Table, column: str, limit: int, keys: dict[str, Any]
) -> Insert:
    """The upsert of :meth:`~moorline.db.backends.base.Backend.increment_below`.

    The limit is a predicate of the conflict's UPDATE, so it is checked on the locked row.
    For PostgreSQL and SQLite, whose ``insert`` constructs share ``on_conflict_do_update``.
    """
    counter = table.c[column]
    stmt: Insert = (
        upsert.values({**keys, column: 1})
        .on_conflict_do_update(
            index_elements=list(keys),
            set_={column: counter + 1},
            where=counter < limit,
        )
        .returning(counter)
    )
    return stmt
