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
"""

from typing import Any

import aiomysql
from pymysql.constants import CLIENT, SERVER_STATUS

_AUTOCOMMIT = SERVER_STATUS.SERVER_STATUS_AUTOCOMMIT
_OUTSIDE_TRANSACTION = SERVER_STATUS.SERVER_STATUS_AUTOCOMMIT | SERVER_STATUS.SERVER_STATUS_IN_TRANS
"""The flags that, equal to ``_AUTOCOMMIT``, say a completed statement left nothing open."""


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
        # An unbuffered result's flags come with its last row, read later.
        self._is_idle = not unbuffered and self.server_status & _OUTSIDE_TRANSACTION == _AUTOCOMMIT
        return affected

    async def _query_and_commit(self, sql: Any) -> int:
        suffix = b"; COMMIT" if isinstance(sql, bytes | bytearray) else "; COMMIT"
        await super().query(sql + suffix)
        result: Any = self._result
        if not (result is not None and result.has_next):  # pragma: no cover - server bug
            raise aiomysql.InternalError("no reply to the COMMIT sent with a statement")
        # The COMMIT's reply (its error, if it failed); then the statement's result is put
        # back for the cursor, with nothing left to read behind it.
        await self.next_result()
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


async def connect(**kwargs: Any) -> Connection:
    """Open a :class:`Connection`: ``aiomysql.connect`` with this module's class.

    The connection accepts several statements in one query, for
    :meth:`Connection.commit_with_next_statement`. Every statement this project sends is
    built by SQLAlchemy with its values escaped by the driver, as before.
    """
    flags = kwargs.pop("client_flag", 0) | CLIENT.MULTI_STATEMENTS
    connection = Connection(client_flag=flags, **kwargs)
    # What aiomysql.connect does with its own class (aiomysql.connection._connect).
    await connection._connect()
    return connection
