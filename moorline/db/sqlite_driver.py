"""aiosqlite connections that run statements on the event loop, or cross to their thread once.

aiosqlite runs every sqlite3 call on the connection's own thread and hands each result back
to the event loop. Through SQLAlchemy's adapter one statement is four such crossings (create
the cursor, execute, fetch the rows, close the cursor) and a transaction adds ``BEGIN``,
``COMMIT`` and the pool's rollback-on-return. A crossing costs little on an idle loop, but on a
busy one each waits behind every ready callback, and SQLite writers hold the write lock while
they wait: a one-statement write transaction took about ten crossings, and under load the
lock's hold time, not SQLite, set the pace of every write (docs/reliability.md, "what is slow").

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
about ten, or one when it commits with its statement.

Once the engine has configured a connection it asks for more (:meth:`Connection.run_inline`):
a call then runs on the event loop's own thread, with no crossing at all. A crossing is two
thread wake-ups, and on this project's 2-core machines it costs more than the SQLite call it
carries (tens of microseconds: WAL with ``synchronous=NORMAL`` does not sync on commit); with
the CPUs contended, each crossing also waits for the other thread to be scheduled. Measured
with the machine loaded, a single-run submit (four crossings) took 13.2 ms through the thread
and 8.0 ms inline (medians of 900 submits, the two run alternately; 2026-11-25 note).
Three things still cross:

- the busy handler, which sleeps up to the busy timeout while another process holds the write
  lock, must never run on the loop: an inline connection has a busy timeout of 0, and a call
  that SQLite refuses as busy is resumed on the connection's thread, with the configured
  timeout, from the step that was refused (SQLite refuses a statement as a whole, so nothing
  of it has happened);
- a big statement (more than ``_INLINE_MAX_PARAMETERS`` parameters, or an executemany of more
  than ``_INLINE_MAX_ROWS`` rows: bulk submissions and wide batches), or one whose SQL took
  more than ``_INLINE_SLOW_S`` of CPU on its last inline runs (a listing over many rows), takes
  milliseconds, the crossing little beside it, and the loop does other work meanwhile; its
  transaction's commit crosses with it;
- an executemany with no transaction open, which SQLite commits row by row, so that a busy
  refusal part-way could not be resumed.

No maintained async SQLite driver for SQLAlchemy offers any of this, which is why it is written
here; it plugs in through ``create_async_engine(async_creator=...)``, SQLAlchemy's documented
hook for supplying the driver connection.

It subclasses aiosqlite's classes and uses their private attributes, listed in
:data:`moorline.fastpaths.PRIVATE_NAMES`; :func:`connector` checks them before the first
connection. With the setting ``fast_paths`` False it gives plain ``aiosqlite.connect``
connections instead, which cross to the thread for every call.
"""

import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from functools import partial
from typing import Any, Protocol, TypeVar

import aiosqlite

from moorline import fastpaths

T = TypeVar("T")

_INLINE_MAX_PARAMETERS = 512
"""A statement with more parameters than this (a batch submission's, say) crosses to the thread.

A worker's ordinary batches stay inline: the outcomes of a lane's slots written with its next
claim bind eight or nine parameters a run, and with the lane's claims waiting on them the
loop has nothing else to do meanwhile, so a crossing only added two thread wake-ups to every
claim (at 64, a default worker of nine slots sent each batch of outcomes, and its commit, to
the thread; docs/performance.md has the drain with each)."""
_INLINE_MAX_ROWS = 64
"""An executemany of more parameter sets than this crosses to the thread (the ``queued`` or
``started`` events of a lane's batch stay inline; a bulk submission's crosses)."""
_INLINE_SLOW_S = 0.002
"""A statement that kept the loop's thread busy longer than this inline (its CPU time, with
the fetch of its rows), ``_SLOW_RUNS`` times in a row, crosses to the thread from then on.

CPU time, not wall time: a statement of a hundred microseconds takes milliseconds of wall time
whenever the process is descheduled (a loaded machine) or another thread holds the GIL as it
returns, and it would then cross forever. Measured by wall time, the two statements of a
checkpointed step were found slow 10-15 times in 4,000 on the loaded shared machine, and
every step crossed twice from then on. A listing over many rows is slow in CPU every time.

Reading the thread's CPU clock is a system call, twice a statement; the wall clock is not. A
statement is timed by the wall clock, and only one that took longer than this by it is timed
by CPU on its next runs (a suspect); docs/performance.md has the costs ("2026-11-30,
08:43-09:50 UTC")."""
_SLOW_RUNS = 2
"""Slow runs by CPU in a row, after a suspect's slow run by the wall clock, that send a
statement to the thread.

Not one: in a virtual machine, time the host takes the CPU away can be counted as the
running thread's CPU time, so a cheap statement is now and then slow once, and a run's single
INSERT so found crossed twice (its commit too) on every submission after it, for good
(docs/performance.md, same section). A listing over many rows is slow on every run, and runs
inline three times."""
_SLOW_STATEMENTS: set[str] = set()
"""The SQL of the statements found slow (a listing over many rows, say), shared by all
connections; forgotten all at once when it reaches ``_SLOW_STATEMENTS_MAX``, so statements
with ever-new SQL cannot make it grow without bound."""
_SLOW_STATEMENTS_MAX = 256
_SUSPECTS: dict[str, int] = {}
"""Statements whose last inline run was slow by the wall clock: their slow runs by CPU in a
row since (bounded as the set is)."""

_OFF_LOOP: ContextVar[bool] = ContextVar("moorline_sqlite_off_loop", default=False)
"""Set by :func:`off_loop`: this task's statements cross to the thread whatever their size."""


@contextmanager
def off_loop() -> Iterator[None]:
    """Within it, the current task's statements (and their commit) run on the thread.

    For background work beside the hot path (the retention cleaner): its statements are small
    enough to run inline, yet they come in a stream, and inline each one holds the event loop
    while the claims and submits behind it wait; on the thread only the crossing is the loop's.
    """
    token = _OFF_LOOP.set(True)
    try:
        yield
    finally:
        _OFF_LOOP.reset(token)


def _execute_and_fetch(
    raw: sqlite3.Cursor, sql: str, parameters: Any, *, many: bool, inline: bool
) -> list[Any]:
    """Run ``sql`` on ``raw`` and fetch all its rows; inline, note whether it was slow."""
    suspect = inline and sql in _SUSPECTS
    clock = time.thread_time if suspect else time.perf_counter
    started_s = clock()
    if many:
        raw.executemany(sql, parameters)
    else:
        raw.execute(sql, parameters)
    rows = raw.fetchall() if raw.description is not None else []
    if inline:
        if clock() - started_s > _INLINE_SLOW_S:
            _remember_slow(sql, by_cpu=suspect)
        elif suspect:
            # pop, not del: a sync portal's loop runs statements inline on a thread of its own.
            _SUSPECTS.pop(sql, None)
    return rows


def _remember_slow(sql: str, *, by_cpu: bool) -> None:
    runs = _SUSPECTS.get(sql, 0) + by_cpu
    if runs < _SLOW_RUNS:
        if sql not in _SUSPECTS and len(_SUSPECTS) >= _SLOW_STATEMENTS_MAX:
            _SUSPECTS.clear()
        _SUSPECTS[sql] = runs
        return
    _SUSPECTS.pop(sql, None)
    if len(_SLOW_STATEMENTS) >= _SLOW_STATEMENTS_MAX:
        _SLOW_STATEMENTS.clear()
    _SLOW_STATEMENTS.add(sql)


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
        self._rows = await self._owner.cross_statement(self._run, begin, sql, params, commit)
        return self

    async def executemany(self, sql: str, parameters: Iterable[Iterable[Any]]) -> "_Cursor":
        """Run ``sql`` for each parameter set, in one crossing (``BEGIN`` held back)."""
        begin, commit = self._owner.take_begin(), self._owner.take_commit()
        self._rows = await self._owner.cross_statement(
            self._run, begin, sql, parameters, commit, many=True
        )
        return self

    def _run(
        self,
        begin: str | None,
        sql: str,
        parameters: Any,
        commit: bool,
        *,
        many: bool,
        inline: bool = False,
    ) -> list[Any]:
        # On the connection's thread, or on the loop's with ``inline`` (see Connection.run_inline):
        # a step refused as busy then raises _Busy with the rest of the work to resume.
        connection = self._owner._conn
        raw = self._raw
        if raw is None:
            raw = self._raw = connection.cursor()
        if begin is not None:
            try:
                raw.execute(begin)
            except sqlite3.OperationalError as exc:
                if inline and _is_busy(exc):
                    raise _Busy(self._run, begin, sql, parameters, commit, many=many) from exc
                raise
        try:
            rows = _execute_and_fetch(raw, sql, parameters, many=many, inline=inline)
        except sqlite3.OperationalError as exc:
            if inline and _is_busy(exc):
                # The transaction (if any) stays open; the statement is sent again from there.
                raise _Busy(self._run, None, sql, parameters, commit, many=many) from exc
            _roll_back_if(commit, connection)
            raise
        except BaseException:
            _roll_back_if(commit, connection)
            raise
        if commit and connection.in_transaction:
            # rowcount and lastrowid are the cursor's: the commit leaves them as they are.
            try:
                connection.commit()
            except sqlite3.OperationalError as exc:
                if inline and _is_busy(exc):
                    raise _Busy(_commit_then, connection, rows) from exc
                raise
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
        # The busy timeout a call refused as busy waits with on the thread; None: no inline calls.
        self._busy_timeout_ms: int | None = None
        # The open transaction ran a big statement: its commit crosses too.
        self._big_transaction = False
        # Calls sent to the thread, and calls the thread finished: each counted by one thread
        # only. While they differ the thread may be inside sqlite3 (a caller cancelled while
        # its call waits for the lock does not stop the call), and a call made inline beside
        # it, such as SQLAlchemy closing the connection it gave up on, would crash sqlite3.
        self._sent_to_thread = 0
        self._done_on_thread = 0

    def run_inline(self, *, busy_timeout_ms: int) -> None:
        """Run calls on the event loop's thread from now on; see the module docstring.

        Called from the engine's ``connect`` listener, which runs on the loop's thread while
        nothing else uses the connection: its own busy timeout becomes 0, so SQLite answers
        ``SQLITE_BUSY`` at once instead of sleeping on the loop, and a call so refused goes to
        the thread and waits up to ``busy_timeout_ms`` there.
        """
        if busy_timeout_ms < 0:
            raise ValueError(f"busy_timeout_ms must be at least 0, got {busy_timeout_ms}")
        self._conn.execute("PRAGMA busy_timeout=0")
        self._busy_timeout_ms = busy_timeout_ms

    async def cross_statement(
        self,
        run: "_Statement",
        begin: str | None,
        sql: str,
        parameters: Any,
        commit: bool,
        *,
        many: bool = False,
    ) -> list[Any]:
        """Run one statement (``_Cursor._run``): inline if the connection allows, else crossing."""
        big = (
            len(parameters) > (_INLINE_MAX_ROWS if many else _INLINE_MAX_PARAMETERS)
            or sql in _SLOW_STATEMENTS
            or _OFF_LOOP.get()
        )
        # executemany with no transaction open would commit row by row, so a busy refusal at
        # row n could not be resumed without repeating rows 1..n-1: it always crosses.
        autocommitting = many and begin is None and not self._is_in_transaction()
        if self._busy_timeout_ms is None or big or autocommitting or self._is_thread_busy():
            # A big statement (a bulk submission's runs) costs milliseconds, the
            # crossing little beside it, and the loop goes on with other work meanwhile; its
            # transaction's commit writes as many pages, and crosses too.
            self._big_transaction = self._big_transaction or big
            rows: list[Any] = await self._on_thread(run, begin, sql, parameters, commit, many=many)
            if commit:
                self._big_transaction = False
            return rows
        return await self._inline(run, begin, sql, parameters, commit, many=many, inline=True)

    async def _execute(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` for this connection the way aiosqlite does (commit, rollback, close …).

        Inline when the connection allows; such a call is one step, so one refused as busy
        has done nothing and is sent again, whole, from the thread.
        """
        if self._busy_timeout_ms is None or self._big_transaction or self._is_thread_busy():
            return await self._on_thread(fn, *args, **kwargs)
        return await self._inline(fn, *args, **kwargs)

    def _is_thread_busy(self) -> bool:
        """Whether a call sent to the thread may still run there (then the next one queues)."""
        return self._sent_to_thread != self._done_on_thread

    async def _on_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the connection's thread, with the busy timeout an inline one lacks."""
        if self._busy_timeout_ms is None:
            return await self._execute_on_thread(fn, *args, **kwargs)
        return await self._execute_on_thread(self._waiting_for_lock, partial(fn, *args, **kwargs))

    async def _inline(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if not self._running or self._connection is None:
            raise ValueError("Connection closed")
        try:
            return fn(*args, **kwargs)
        except _Busy as busy:
            rest: Callable[[], Any] = busy.rest
        except sqlite3.OperationalError as exc:
            if not _is_busy(exc):
                raise
            rest = partial(fn, *args, **kwargs)
        # Awaited like any crossing: the caller cannot send anything else meanwhile.
        result: T = await self._execute_on_thread(self._waiting_for_lock, rest)
        return result

    def _waiting_for_lock(self, rest: Callable[[], T]) -> T:
        # On the connection's thread: the call refused on the loop, with the busy handler.
        connection = self._conn
        connection.execute(f"PRAGMA busy_timeout={self._busy_timeout_ms}")
        try:
            return rest()
        finally:
            if not _is_closed(connection):  # ``rest`` may be the close itself
                connection.execute("PRAGMA busy_timeout=0")

    async def _execute_on_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if not self._running or self._connection is None:
            raise ValueError("Connection closed")  # as aiosqlite says it, before any count
        self._sent_to_thread += 1
        call = partial(fn, *args, **kwargs)
        result: T = await super()._execute(self._counted, call)  # type: ignore[no-untyped-call]
        return result

    def _counted(self, call: Callable[[], T]) -> T:
        # On the connection's thread.
        try:
            return call()
        finally:
            self._done_on_thread += 1

    def hold_begin(self, sql: str) -> None:
        """Keep ``BEGIN …`` until the transaction's first statement."""
        self._held_begin = sql

    def holds_transaction(self) -> bool:
        """Whether a transaction is open, or its ``BEGIN`` held for the next statement."""
        return self._held_begin is not None or self._is_in_transaction()

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

    async def write_alone(self, begin: str, sql: str, parameters: Sequence[Any]) -> int:
        """``begin``, the statement and its commit as one call: the rows the statement changed.

        For a statement that is a transaction by itself, sent past SQLAlchemy
        (:mod:`moorline.db.backends.sqlite_direct`); an error rolls the transaction back.
        """
        if self._held_begin is not None or self._is_in_transaction():
            raise sqlite3.ProgrammingError("write_alone with a transaction open")
        cursor = _Cursor(self)
        await self.cross_statement(cursor._run, begin, sql, parameters, True)
        return cursor.rowcount

    def cursor(self) -> _OpenCursor:  # type: ignore[override]
        """A cursor, without a crossing (its sqlite3 cursor comes with its first statement)."""
        return _OpenCursor(_Cursor(self))

    async def commit(self) -> None:
        """Commit the open transaction; no crossing when none is open (no statement ran)."""
        self._held_begin, self._commit_next = None, False
        try:
            if self._is_in_transaction():
                await super().commit()
        finally:
            self._big_transaction = False

    async def close(self) -> None:
        """Roll back whatever is open, then close (aiosqlite's close, with the rollback first).

        sqlite3 cannot free a connection while a statement of it lives on, in a cursor that an
        exception's traceback still holds (an attempt's failed event write keeps its error):
        the closed connection stays behind as a zombie that keeps its transaction, and so
        the write lock, until that cursor is collected. Rolled back first, it holds nothing.
        """
        if self._connection is None:
            return
        try:
            await self._execute(_roll_back_and_close, self._connection)
        finally:
            self._connection = None
            stopped = self.stop()
            if stopped is not None:
                await stopped

    async def rollback(self) -> None:
        """Roll back the open transaction; no crossing when none is open."""
        self._held_begin, self._commit_next = None, False
        try:
            if self._is_in_transaction():
                await super().rollback()
        finally:
            self._big_transaction = False

    def _is_in_transaction(self) -> bool:
        # Read from the event loop's thread: sqlite3 checks only that the connection is open
        # (not the thread), and nothing runs on this connection between two of its awaits,
        # except a call given up by its caller that still runs on the thread. That one may yet
        # open a transaction (its BEGIN goes with its statement): count one as open then, so
        # that the commit or rollback crosses and queues behind it.
        connection = self._connection
        return connection is not None and (self._is_thread_busy() or connection.in_transaction)


def connector(
    args: Sequence[Any], kwargs: Mapping[str, Any], *, fast: bool = True
) -> Callable[[], aiosqlite.Connection]:
    """An ``async_creator`` for ``create_async_engine``: connections ``sqlite3.connect`` opens.

    Args:
        args: The positional arguments of ``sqlite3.connect``.
        kwargs: Its keyword arguments. Take both from the aiosqlite dialect's
            ``create_connect_args`` for the URL, so a URL means what it means without this
            module (``?mode=ro&uri=true``, ``?timeout=``, ``check_same_thread=False``); the
            engine's ``connect`` listener then applies the pragmas and hands transactions to
            the ``begin`` listener.
        fast: This module's :class:`Connection` (the setting ``fast_paths``); False gives
            plain ``aiosqlite.connect`` connections, which use none of aiosqlite's internals
            and cross to the thread for every call (the engine's listeners then send
            ``BEGIN`` as a statement, as they do for ``:memory:``).

    Raises:
        ConfigError: ``fast`` and the installed aiosqlite lacks an internal this module uses.
    """
    if not fast:
        return partial(_public_connection, args, kwargs)
    fastpaths.require("aiosqlite")

    def create() -> Connection:
        return Connection(lambda: sqlite3.connect(*args, **kwargs))

    return create


def _public_connection(args: Sequence[Any], kwargs: Mapping[str, Any]) -> aiosqlite.Connection:
    # aiosqlite's own thread is not a daemon; the pool closes every connection it opened
    # (DatabaseManager.dispose), as it must with SQLAlchemy's own aiosqlite connections.
    return aiosqlite.connect(*args, **kwargs)


def _is_begin(sql: str) -> bool:
    return sql[:5].upper() == "BEGIN"


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    """Whether SQLite refused for a lock another connection holds (``SQLITE_BUSY_*``)."""
    code: int = getattr(exc, "sqlite_errorcode", 0)
    return code & 0xFF == sqlite3.SQLITE_BUSY


class _Busy(Exception):
    """An inline call was refused as busy part-way; ``rest`` is what is left to run."""

    def __init__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        super().__init__("database is locked")
        self.rest: Callable[[], Any] = partial(fn, *args, **kwargs)


class _Statement(Protocol):
    def __call__(
        self,
        begin: str | None,
        sql: str,
        parameters: Any,
        commit: bool,
        *,
        many: bool,
        inline: bool = False,
    ) -> list[Any]: ...


def _roll_back_if(commit: bool, connection: sqlite3.Connection) -> None:
    if commit and connection.in_transaction:
        # What SQLAlchemy's rollback would do next, which then finds nothing open.
        connection.rollback()


def _commit_then(connection: sqlite3.Connection, rows: list[Any]) -> list[Any]:
    connection.commit()
    return rows


__all__: Sequence[str] = ("Connection", "connector")


def _is_closed(connection: sqlite3.Connection) -> bool:
    try:
        connection.total_changes  # noqa: B018 - any attribute read checks the connection
    except sqlite3.ProgrammingError:
        return True
    return False


def _roll_back_and_close(connection: sqlite3.Connection) -> None:
    try:
        if connection.in_transaction:
            connection.rollback()
    finally:
        connection.close()
