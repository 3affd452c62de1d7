"""aiosqlite connections that cross to their thread once per statement, not three or four times.

aiosqlite runs every sqlite3 call on the connection's own thread and hands each result back
to the event loop. Through SQLAlchemy's adapter one statement is four such crossings (create
the cursor, execute, fetch the rows, close the cursor) and a transaction adds ``BEGIN``,
``COMMIT`` and the pool's rollback-on-return. A crossing costs little on an idle loop, but on a
busy one each waits behind every ready callback, and SQLite writers hold the write lock while
they wait: a one-statement write transaction took about ten crossings, and under load the
lock's hold time, not SQLite, set the pace of every write (RELIABILITY.md, "what is slow").

This module keeps aiosqlite (its thread, queue and error handling) and changes only how a
statement crosses:

- a cursor is created on the connection's thread by its first statement, not by a crossing
  of its own;
- a statement and the fetch of all its rows are one crossing; SQLAlchemy's ``fetchall`` then
  reads the buffered rows;
- closing a cursor whose rows were all read is free: sqlite3 has already reset its statement,
  so nothing holds a lock or a read snapshot, and the object is dropped;
- ``BEGIN …`` is held back and sent in the same crossing as the transaction's first
  statement (or dropped, when the transaction ends before any statement);
- a rollback with no transaction open (the pool's reset after a commit) does not cross;
- a transaction that is one statement by construction (``DatabaseManager.write_statement``)
  can ask for its ``COMMIT`` to go with that statement too
  (:meth:`Connection.commit_with_next_statement`); SQLAlchemy's commit then finds nothing
  open and does not cross.

A write transaction of one statement is thus two crossings (statement, commit) instead of
about ten, or one when it commits with its statement. No maintained async SQLite driver for
SQLAlchemy offers this, which is why it is written here; it plugs in through
``create_async_engine(async_creator=...)``, SQLAlchemy's documented hook for supplying the
driver connection.
"""

import sqlite3
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import aiosqlite

T = TypeVar("T")


class _Cursor(aiosqlite.Cursor):
    """An aiosqlite cursor whose statement and row fetch share one thread crossing."""

    def __init__(self, conn: "Connection") -> None:
        # The sqlite3 cursor is created on the connection's thread by the first statement.
        self.iter_chunk_size = conn._iter_chunk_size
        self._conn = self._owner = conn
        self._raw: sqlite3.Cursor | None = None
        self._rows: list[Any] = []

    @property
    def _cursor(self) -> sqlite3.Cursor:
        if self._raw is None:
            raise sqlite3.ProgrammingError("the cursor has not executed a statement")
        return self._raw

    @_cursor.setter
    def _cursor(self, value: sqlite3.Cursor) -> None:
        self._raw = value

    async def execute(self, sql: str, parameters: Iterable[Any] | None = None) -> "_Cursor":
        """Run ``sql`` and buffer all its rows, in one crossing (``BEGIN`` held back)."""
        if _is_begin(sql):
            self._owner.hold_begin(sql)
            self._rows = []
            return self
        begin, commit = self._owner.take_begin(), self._owner.take_commit()
        params: Any = [] if parameters is None else parameters
        self._rows = await self._owner.cross(self._run, begin, sql, params, commit, many=False)
        return self

    async def executemany(self, sql: str, parameters: Iterable[Iterable[Any]]) -> "_Cursor":
        """Run ``sql`` for each parameter set, in one crossing (``BEGIN`` held back)."""
        begin, commit = self._owner.take_begin(), self._owner.take_commit()
        self._rows = await self._owner.cross(self._run, begin, sql, parameters, commit, many=True)
        return self

    def _run(
        self, begin: str | None, sql: str, parameters: Any, commit: bool, *, many: bool
    ) -> list[Any]:
        # On the connection's thread.
        connection = self._owner._conn
        raw = self._raw
        if raw is None:
            raw = self._raw = connection.cursor()
        if begin is not None:
            raw.execute(begin)
        try:
            if many:
                raw.executemany(sql, parameters)
            else:
                raw.execute(sql, parameters)
            rows = raw.fetchall() if raw.description is not None else []
        except BaseException:
            if commit and connection.in_transaction:
                # What SQLAlchemy's rollback would do next, which then finds nothing open.
                connection.rollback()
            raise
        if commit and connection.in_transaction:
            # rowcount and lastrowid are the cursor's: the commit leaves them as they are.
            connection.commit()
        return rows

    async def fetchone(self) -> sqlite3.Row | None:
        """The next buffered row, or None."""
        return self._rows.pop(0) if self._rows else None

    async def fetchmany(self, size: int | None = None) -> list[Any]:
        """Up to ``size`` buffered rows (``arraysize`` by default)."""
        count = self._cursor.arraysize if size is None else size
        taken, self._rows = self._rows[:count], self._rows[count:]
        return taken

    async def fetchall(self) -> list[Any]:
        """Every buffered row."""
        taken, self._rows = self._rows, []
        return taken

    async def close(self) -> None:
        """Drop the cursor: its rows were read when it executed, so it holds nothing."""
        self._rows = []

    @property
    def rowcount(self) -> int:
        """The rows the last statement changed (-1 before any)."""
        return -1 if self._raw is None else self._raw.rowcount

    @property
    def lastrowid(self) -> int | None:
        """The row id of the last row inserted, or None."""
        return None if self._raw is None else self._raw.lastrowid

    @property
    def description(self) -> Any:
        """The columns of the last statement's rows (None when it returns none)."""
        return None if self._raw is None else self._raw.description

    @property
    def arraysize(self) -> int:
        """The default ``fetchmany`` size."""
        return 1 if self._raw is None else self._raw.arraysize

    @arraysize.setter
    def arraysize(self, value: int) -> None:
        self._cursor.arraysize = value


class _OpenCursor:
    """What ``Connection.cursor()`` returns: awaitable and an async context manager, no crossing."""

    def __init__(self, cursor: _Cursor) -> None:
        self._cursor = cursor

    def __await__(self) -> Any:
        return self.__aenter__().__await__()

    async def __aenter__(self) -> _Cursor:
        return self._cursor

    async def __aexit__(self, *exc: object) -> None:
        await self._cursor.close()


class Connection(aiosqlite.Connection):
    """An aiosqlite connection with the crossings described in the module docstring."""

    def __init__(self, connector: Callable[[], sqlite3.Connection]) -> None:
        super().__init__(connector, iter_chunk_size=64)
        # Like SQLAlchemy's own aiosqlite connect: the thread must not keep the process alive.
        self._thread.daemon = True
        self._held_begin: str | None = None
        self._commit_next = False

    async def cross(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the connection's thread and return its result."""
        result: T = await self._execute(fn, *args, **kwargs)  # type: ignore[no-untyped-call]
        return result

    def hold_begin(self, sql: str) -> None:
        """Keep ``BEGIN …`` until the transaction's first statement."""
        self._held_begin = sql

    def take_begin(self) -> str | None:
        """The held ``BEGIN …`` to send now, if any."""
        begin, self._held_begin = self._held_begin, None
        return begin

    def commit_with_next_statement(self) -> None:
        """Commit (or, on error, roll back) the transaction in the next statement's crossing.

        For a transaction that is that one statement: whatever follows it in the transaction
        would run outside it, so only ``DatabaseManager.write_statement`` asks for this.
        """
        self._commit_next = True

    def take_commit(self) -> bool:
        """Whether the statement about to cross must commit its transaction."""
        commit, self._commit_next = self._commit_next, False
        return commit

    def cursor(self) -> _OpenCursor:  # type: ignore[override]
        """A cursor, without a crossing (its sqlite3 cursor comes with its first statement)."""
        return _OpenCursor(_Cursor(self))

    async def commit(self) -> None:
        """Commit the open transaction; no crossing when none is open (no statement ran)."""
        self._held_begin, self._commit_next = None, False
        if not self._is_in_transaction():
            return
        await super().commit()

    async def rollback(self) -> None:
        """Roll back the open transaction; no crossing when none is open."""
        self._held_begin, self._commit_next = None, False
        if not self._is_in_transaction():
            return
        await super().rollback()

    def _is_in_transaction(self) -> bool:
        # Read from the event loop's thread: sqlite3 checks only that the connection is open
        # (not the thread), and nothing runs on this connection between two of its awaits.
        connection = self._connection
        return connection is not None and connection.in_transaction


def connector(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Callable[[], Connection]:
    """An ``async_creator`` for ``create_async_engine``: connections ``sqlite3.connect`` opens.

    Args:
        args: The positional arguments of ``sqlite3.connect``.
        kwargs: Its keyword arguments. Take both from the aiosqlite dialect's
            ``create_connect_args`` for the URL, so a URL means what it means without this
            module (``?mode=ro&uri=true``, ``?timeout=``, ``check_same_thread=False``); the
            engine's ``connect`` listener then applies the pragmas and hands transactions to
            the ``begin`` listener.
    """

    def create() -> Connection:
        return Connection(lambda: sqlite3.connect(*args, **kwargs))

    return create


def _is_begin(sql: str) -> bool:
    return sql[:5].upper() == "BEGIN"


__all__: Sequence[str] = ("Connection", "connector")
