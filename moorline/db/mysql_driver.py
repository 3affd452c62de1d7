"""aiomysql connections that skip the round trips a pool spends on MariaDB/MySQL for nothing.

Through SQLAlchemy's pool every aiomysql transaction paid two round trips besides its own
statements and ``COMMIT``: the pre-ping at checkout (``COM_PING``), and a ``ROLLBACK`` at checkin
(SQLAlchemy resets a connection as it returns to the pool whenever its transaction was ended
by a commit, and ends an autocommit statement's transaction with a rollback too). aiomysql
sends both every time, where asyncpg and this project's SQLite driver know on the client side
that there is nothing to do. On a claim, a submission or a finish, each about five round
trips of real work, those were two more, one of them on the dispatch latency's critical path
(the submission's rollback runs before its caller hears of the commit and wakes the workers).

:class:`Connection` is aiomysql's connection with three additions:

- :meth:`Connection.rollback` does not send ``ROLLBACK`` when no transaction can be open: the
  last command sent was a ``COMMIT`` or ``ROLLBACK`` that succeeded, or a statement that
  completed in autocommit mode outside an explicit transaction (the status flags of its reply
  say ``SERVER_STATUS_AUTOCOMMIT`` and not ``SERVER_STATUS_IN_TRANS``). Those flags alone would
  not do: MariaDB leaves ``SERVER_STATUS_IN_TRANS`` clear in a transaction that has only read
  so far, and such a transaction holds metadata locks until it ends. After a command that
  failed or was cut short (an error packet carries no flags, and a failed statement may have
  opened a transaction and kept locks), or an unbuffered query (its flags come with its last
  row), the rollback is sent.
- :meth:`Connection.commit_with_next_statement` sends a transaction's ``COMMIT`` in the same
  query as its last statement (the connection accepts several statements per query), so a
  transaction costs its statements' round trips and no more. The repositories ask for it
  through ``DatabaseManager.commit_with_next_statement`` on the paths that lead to a worker
  starting a run (a submission, a claim), where every round trip is dispatch latency.
- :meth:`Connection.is_closed` says, without a round trip, that the server has closed the
  connection (its FIN, or the error packet MariaDB sends when a connection is killed, read
  by the event loop), as asyncpg's method of that name does; the manager checks it at
  checkout instead of the ping (see ``DatabaseManager``).

No maintained async MySQL driver for SQLAlchemy does this (aiomysql and asyncmy both send the
statement), which is why it is written here; it plugs in through the manager's
``async_creator``, as the SQLite driver does.

Multi-statements are kept, confined to one code path. :meth:`Connection.commit_with_next_statement`
needs ``CLIENT.MULTI_STATEMENTS``: without it the ``COMMIT`` is a round trip of its own on every
submission and claim, which is dispatch latency (dropping it would change the benchmarks' figures,
which this refactor must not). The flag is the connection's, so what confines it is:

- aiomysql itself asks for it on every connection, so it is not this module that widens what
  an injection could do: with ``fast=False`` (``MOORLINE_FAST_PATHS``) :func:`connect` gives
  aiomysql's own class with the flag cleared, and the server refuses a second statement;
- the only text this module adds to a statement is the constant :data:`COMMIT_SUFFIX`, in
  :meth:`Connection._query_and_commit`, and only for a statement a repository marked as its
  transaction's last; every statement is SQLAlchemy's, its values bound as parameters and
  escaped by the driver into quoted literals (``tests/integration/test_mysql_multi_statements.py``
  sends hostile text through each marked path and checks that, outside the literals, the query
  sent is one statement and the suffix);
- a query that returns more than one result anywhere else (several statements reached the
  server) fails at once (:class:`SeveralStatements`) instead of being read as one.
"""

from typing import Any

import aiomysql
from pymysql.constants import CLIENT, SERVER_STATUS

from moorline import fastpaths

_AUTOCOMMIT = SERVER_STATUS.SERVER_STATUS_AUTOCOMMIT
_OUTSIDE_TRANSACTION = SERVER_STATUS.SERVER_STATUS_AUTOCOMMIT | SERVER_STATUS.SERVER_STATUS_IN_TRANS
"""The flags that, equal to ``_AUTOCOMMIT``, say a completed statement left nothing open."""

COMMIT_SUFFIX = "; COMMIT"
"""The only text this module adds to a statement (:meth:`Connection.commit_with_next_statement`)."""


class SeveralStatements(aiomysql.ProgrammingError):  # type: ignore[misc]
    """A query outside :meth:`Connection.commit_with_next_statement` ran several statements."""


class Connection(aiomysql.Connection):  # type: ignore[misc]
    """An aiomysql connection that knows when a rollback has nothing to do, and when it is dead."""

    _result: Any
    """aiomysql's last result read (a ``MySQLResult``), which its cursors read from."""

    _is_idle = False
    """No transaction can be open on the server (see the module docstring)."""

    _commits_with_next = False
    """The next query carries the transaction's ``COMMIT`` (:meth:`commit_with_next_statement`)."""

    def commit_with_next_statement(self) -> None:
        """Send ``COMMIT`` with the next statement, which must end its transaction.

        For a transaction's last statement, sent as one buffered execute: the statement and
        ``; COMMIT`` go as one query (the connection allows several statements per query),
        so the commit costs no round trip of its own; the statement's result is what its
        caller reads, and the commit's reply is read behind it. If the statement fails, the
        server runs nothing after it, so nothing commits and the caller's rollback ends the
        transaction; if the ``COMMIT`` fails, its error is the statement's. Once it went
        through, the caller's own commit (and the pool's rollback) find nothing open and send
        nothing.
        """
        self._commits_with_next = True

    async def query(self, sql: Any, unbuffered: bool = False) -> int:
        self._is_idle = False
        if self._commits_with_next and not unbuffered:
            self._commits_with_next = False
            return await self._query_and_commit(sql)
        affected: int = await super().query(sql, unbuffered)
        result: Any = self._result
        if not unbuffered and result is not None and result.has_next:
            # Multi-statements are for _query_and_commit alone (see the module docstring).
            raise SeveralStatements("a query outside commit_with_next_statement ran several")
        # An unbuffered result's flags come with its last row, read later.
        self._is_idle = not unbuffered and self.server_status & _OUTSIDE_TRANSACTION == _AUTOCOMMIT
        return affected

    async def _query_and_commit(self, sql: Any) -> int:
        # The one place a query carries two statements; the second is a constant.
        suffix = COMMIT_SUFFIX.encode() if isinstance(sql, bytes | bytearray) else COMMIT_SUFFIX
        await super().query(sql + suffix)
        result: Any = self._result
        if not (result is not None and result.has_next):  # pragma: no cover - server bug
            raise aiomysql.InternalError("no reply to the COMMIT sent with a statement")
        # The COMMIT's reply (its error, if it failed); then the statement's result is put
        # back for the cursor, with nothing left to read behind it.
        await self.next_result()
        if self._result is not None and self._result.has_next:
            raise SeveralStatements("a statement sent with its COMMIT ran more than one")
        result.has_next = False
        self._result = result
        self._affected_rows = result.affected_rows
        self._is_idle = True
        affected: int = result.affected_rows
        return affected

    async def begin(self) -> None:
        self._is_idle = False
        await super().begin()

    async def commit(self) -> None:
        self._commits_with_next = False
        if self._is_idle:
            return  # committed with its last statement, or nothing is open
        self._is_idle = False
        await super().commit()
        self._is_idle = True

    async def rollback(self) -> None:
        self._commits_with_next = False
        if self._is_idle:
            return  # nothing is open on the server: nothing to roll back
        await super().rollback()
        self._is_idle = True

    def is_closed(self) -> bool:
        """Whether the connection is closed, or the server has closed its end of it."""
        # The same checks as aiomysql's own pool makes of its idle connections; eof_received
        # is set by aiomysql's reader even when the server sent an error packet before closing.
        reader = self._reader
        return (
            self._writer is None
            or reader is None
            or reader.eof_received
            or reader.at_eof()
            or reader.exception() is not None
        )


async def connect(*, fast: bool = True, **kwargs: Any) -> aiomysql.Connection:
    """Open a connection: ``aiomysql.connect``, with this module's class when ``fast``.

    Args:
        fast: A :class:`Connection` (the setting ``fast_paths``), which accepts several
            statements in one query, for :meth:`Connection.commit_with_next_statement`. False
            gives aiomysql's own connection class, single statements only (see
            :func:`_connect_single_statement`): it has no ``is_closed`` and no
            ``commit_with_next_statement``, so its engine checks connections with
            SQLAlchemy's ``pool_pre_ping`` and commits with ``COMMIT``.
        kwargs: ``aiomysql.connect``'s arguments.

    Raises:
        ConfigError: ``fast`` and the installed aiomysql lacks an internal this class uses.
    """
    if not fast:
        return await _connect_single_statement(**kwargs)
    fastpaths.require("aiomysql")
    flags = kwargs.pop("client_flag", 0) | CLIENT.MULTI_STATEMENTS
    connection = Connection(client_flag=flags, **kwargs)
    # What aiomysql.connect does with its own class (aiomysql.connection._connect).
    await connection._connect()
    return connection


async def _connect_single_statement(**kwargs: Any) -> aiomysql.Connection:
    """Open aiomysql's own connection, without ``CLIENT.MULTI_STATEMENTS``.

    aiomysql asks for multi-statements on every connection (its ``Connection.__init__`` adds
    the flag to ``client_flag`` whatever it is given), so ``aiomysql.connect`` cannot leave it
    out. The connection is built with aiomysql's public class, its flag cleared before the
    handshake, and opened by its public ``ping(reconnect=True)``, which connects a connection
    not yet open (one ``COM_PING`` more per new connection, on the fallback only).
    """
    connection = aiomysql.Connection(**kwargs)
    connection.client_flag &= ~CLIENT.MULTI_STATEMENTS
    await connection.ping(reconnect=True)
    return connection
