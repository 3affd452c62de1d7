"""Primary-first failover and the DSN keys, against real PostgreSQL and MariaDB servers.

Every test builds its own DatabaseManager from the admin URLs of ``tests.servers`` and only
reads, or writes to temporary tables, so nothing is left behind on the servers.
"""

import asyncio
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from moorline.db.dsn import DatabaseUnreachable, make_failover_creator, parse_target
from moorline.db.manager import DatabaseManager
from moorline.errors import BackendUnavailable
from moorline.settings import Settings
from tests.servers import MYSQL_ADMIN_URL, PG_ADMIN_URL, require_server

PASSWORD = "s3cret-pw"


@pytest.fixture(params=["postgresql", "mysql"])
def kind(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    require_server(name)
    return name


@pytest.fixture
def admin_url(kind: str) -> str:
    return PG_ADMIN_URL if kind == "postgresql" else MYSQL_ADMIN_URL


def closed_port() -> int:
    """A local TCP port nobody listens on: bound once to pick it, then released."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def at_port(url: str, port: int, *, password: str | None = None) -> str:
    parsed = make_url(url).set(host="127.0.0.1", port=port)
    if password is not None:
        parsed = parsed.set(password=password)
    return parsed.render_as_string(hide_password=False)


def with_query(url: str, **query: str) -> str:
    parsed = make_url(url)
    return parsed.update_query_dict(query).render_as_string(hide_password=False)


def tagged(kind: str, url: str, tag: str) -> str:
    """``url`` whose connections report ``tag`` (see :func:`read_tag`)."""
    if kind == "postgresql":
        return with_query(url, application_name=tag)
    return with_query(url, init_command=f"SET @moorline_tag = '{tag}'")


async def read_tag(kind: str, db: DatabaseManager, stack: AsyncExitStack) -> str:
    """Open one more connection (kept open on ``stack``) and report the tag of its URL."""
    conn = await stack.enter_async_context(db.connect())
    sql = "SHOW application_name" if kind == "postgresql" else "SELECT @moorline_tag"
    tag: str = (await conn.execute(text(sql))).scalar_one()
    return tag


@asynccontextmanager
async def manager(*urls: str) -> AsyncIterator[DatabaseManager]:
    db = DatabaseManager(Settings(database_urls=list(urls)))
    try:
        yield db
    finally:
        await db.dispose()


class TcpForwarder:
    """A primary that can be switched off and on: forwards one local port to a real server."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._pipes: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self) -> None:
        # Binding the same port again after stop() is what makes "the primary is back".
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening and cut every forwarded connection, as a dead server would."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.close()
        for pipe in list(self._pipes):
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)
        for writer in list(self._writers):
            try:
                await writer.wait_closed()
            except OSError:  # the peer may already have reset the connection
                pass
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(*self._target)
        self._writers.update((writer, upstream_writer))
        pipes = [
            asyncio.create_task(self._pipe(reader, upstream_writer)),
            asyncio.create_task(self._pipe(upstream_reader, writer)),
        ]
        self._pipes.update(pipes)
        for pipe in pipes:
            pipe.add_done_callback(self._pipes.discard)

    @staticmethod
    async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        except OSError:
            pass
        finally:
            sink.close()


@pytest.fixture
async def forwarder(admin_url: str) -> AsyncIterator[TcpForwarder]:
    parsed = make_url(admin_url)
    proxy = TcpForwarder(parsed.host or "127.0.0.1", parsed.port or 0)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()


def is_local_socket(path: str) -> bool:
    return bool(path) and Path(path).is_socket()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts TCP connections and then never says a word."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port: int = sock.getsockname()[1]
        yield port


async def test_closed_primary_falls_over_to_the_second_address(
    kind: str, admin_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    primary = at_port(admin_url, closed_port(), password=PASSWORD)
    async with manager(primary, admin_url) as db:
        with caplog.at_level(logging.WARNING, logger="moorline.db.dsn"):
            async with db.connect() as conn:
                assert (await conn.execute(text("SELECT 1"))).scalar_one() == 1
    [record] = [r for r in caplog.records if r.name == "moorline.db.dsn"]
    assert record.args, "log with %-style arguments"
    message = record.getMessage()
    assert parse_target(primary).display in message
    assert parse_target(admin_url).display in message
    assert PASSWORD not in message


async def test_all_addresses_down_is_one_error_listing_each(kind: str, admin_url: str) -> None:
    first = at_port(admin_url, closed_port(), password=PASSWORD)
    second = at_port(admin_url, closed_port(), password=PASSWORD)
    async with manager(first, second) as db:
        with pytest.raises(DatabaseUnreachable) as info:
            async with db.connect():
                pass
    error = info.value
    assert isinstance(error, BackendUnavailable)
    message = str(error)
    assert message.startswith("no database address answered: ")
    assert parse_target(first).display in message
    assert parse_target(second).display in message
    assert message.count("Connect call failed") >= 2  # each address with its own reason
    assert [address for address, _ in error.failures] == [
        parse_target(first).display,
        parse_target(second).display,
    ]
    assert PASSWORD not in message


async def test_order_is_fixed_and_the_primary_is_used_again_once_back(
    kind: str, admin_url: str, forwarder: TcpForwarder
) -> None:
    primary = tagged(kind, at_port(admin_url, forwarder.port), "primary")
    secondary = tagged(kind, admin_url, "secondary")
    async with manager(primary, secondary) as db:
        # Both answer: every new connection goes to the primary, none is rotated away.
        async with AsyncExitStack() as stack:
            assert [await read_tag(kind, db, stack) for _ in range(4)] == ["primary"] * 4

        await forwarder.stop()
        await db.engine.dispose()
        async with AsyncExitStack() as stack:
            assert [await read_tag(kind, db, stack) for _ in range(2)] == ["secondary"] * 2

        # The next new connection tries the primary first again: no stickiness to the second.
        await forwarder.start()
        await db.engine.dispose()
        async with AsyncExitStack() as stack:
            assert await read_tag(kind, db, stack) == "primary"


async def test_silent_address_is_abandoned_after_the_probe_timeout(
    kind: str, admin_url: str, silent_port: int
) -> None:
    # DatabaseManager uses the fixed 5 s; the creator takes a shorter one so the test is quick.
    targets = [parse_target(at_port(admin_url, silent_port)), parse_target(admin_url)]
    create = make_failover_creator(targets, probe_timeout_s=0.3)
    started = time.monotonic()
    connection = await create()
    elapsed_s = time.monotonic() - started
    try:
        assert 0.3 <= elapsed_s < 3.0
    finally:
        closing = connection.close()
        if asyncio.iscoroutine(closing):  # asyncpg's close is a coroutine, aiomysql's is not
            await closing


async def test_application_name_reaches_postgresql() -> None:
    require_server("postgresql")
    async with manager(with_query(PG_ADMIN_URL, application_name="moorline probe")) as db:
        async with db.connect() as conn:
            assert (await conn.execute(text("SHOW application_name"))).scalar_one() == (
                "moorline probe"
            )
            seen = await conn.execute(
                text("SELECT application_name FROM pg_stat_activity WHERE pid = pg_backend_pid()")
            )
            assert seen.scalar_one() == "moorline probe"


async def test_mysql_init_command_runs_on_each_new_connection() -> None:
    require_server("mysql")
    url = with_query(MYSQL_ADMIN_URL, init_command="SET @moorline_probe = 7")
    async with manager(url) as db, AsyncExitStack() as stack:
        for _ in range(2):
            conn = await stack.enter_async_context(db.connect())
            assert (await conn.execute(text("SELECT @moorline_probe"))).scalar_one() == 7


async def test_mysql_defaults_to_utf8mb4() -> None:
    require_server("mysql")
    async with manager(MYSQL_ADMIN_URL) as db, db.connect() as conn:
        charset = (await conn.execute(text("SELECT @@character_set_client"))).scalar_one()
    assert charset == "utf8mb4"


async def test_mysql_rowcount_counts_matched_rows() -> None:
    require_server("mysql")
    async with manager(MYSQL_ADMIN_URL) as db, db.connect() as conn:
        await conn.execute(
            text("CREATE TEMPORARY TABLE moorline_rowcount (id INT PRIMARY KEY, v INT)")
        )
        try:
            await conn.execute(text("INSERT INTO moorline_rowcount (id, v) VALUES (1, 5)"))
            # v is already 5: MySQL changes no row, but the conditional update did match one.
            same = await conn.execute(text("UPDATE moorline_rowcount SET v = 5 WHERE id = 1"))
            assert same.rowcount == 1
            missing = await conn.execute(text("UPDATE moorline_rowcount SET v = 5 WHERE id = 2"))
            assert missing.rowcount == 0
        finally:
            await conn.execute(text("DROP TEMPORARY TABLE moorline_rowcount"))


async def test_mysql_unix_socket_without_host() -> None:
    require_server("mysql")
    async with manager(MYSQL_ADMIN_URL) as db, db.connect() as conn:
        socket_path: str = (await conn.execute(text("SELECT @@socket"))).scalar_one()
    # The server may run elsewhere (a container); then its socket is not ours to reach.
    if not is_local_socket(socket_path):
        pytest.skip(f"the server's socket {socket_path!r} is not on this machine")
    parsed = make_url(MYSQL_ADMIN_URL).set(host=None, port=None)
    url = with_query(parsed.render_as_string(hide_password=False), unix_socket=socket_path)
    async with manager(url) as db, db.connect() as conn:
        host = await conn.execute(
            text("SELECT host FROM information_schema.processlist WHERE id = CONNECTION_ID()")
        )
        assert host.scalar_one() == "localhost"  # TCP connections show "127.0.0.1:<port>"


async def test_a_pooled_connection_that_turned_read_only_is_dropped_and_the_write_retried() -> None:
    # As when its node is demoted under it: the one pooled connection refuses writes from now.
    require_server("postgresql")
    table = f"moorline_ro_probe_{uuid.uuid4().hex[:10]}"
    db = DatabaseManager(
        Settings(database_url=PG_ADMIN_URL, db_pool_size=1, db_max_overflow=0, db_retry_base=0.01)
    )
    try:
        async with db.connect() as conn:
            first_pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
            await conn.execute(text("SET SESSION default_transaction_read_only = on"))
            await conn.commit()

        async def write() -> int:
            async with db.transaction() as conn:
                await conn.execute(text(f"CREATE TABLE {table} (x int)"))
                pid: int = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
                return pid

        # The read-only refusal counts as a lost connection: the pool drops it and the retry
        # runs on a fresh connection, which the failover creator checked is writable.
        assert await db.with_retry(write) != first_pid
    finally:
        async with db.transaction() as conn:
            await conn.execute(text(f"DROP TABLE IF EXISTS {table}"))
        await db.dispose()


async def test_a_read_only_address_is_skipped_like_a_dead_one() -> None:
    # A standby is simulated by a role whose sessions are read-only. (MariaDB's read_only is
    # global to the shared server: its side of the check is not exercised against a read-only
    # node here.)
    require_server("postgresql")
    kind, admin_url = "postgresql", PG_ADMIN_URL
    role = f"moorline_ro_{uuid.uuid4().hex[:10]}"
    async with manager(admin_url) as admin, admin.transaction() as conn:
        await conn.execute(text(f"CREATE ROLE {role} LOGIN SUPERUSER"))
        await conn.execute(text(f"ALTER ROLE {role} SET default_transaction_read_only = on"))
    try:
        read_only = make_url(admin_url).set(username=role).render_as_string(hide_password=False)
        async with manager(tagged(kind, read_only, "standby"), tagged(kind, admin_url, "ok")) as db:
            async with AsyncExitStack() as stack:
                assert await read_tag(kind, db, stack) == "ok"
        async with manager(read_only) as db:
            with pytest.raises(DatabaseUnreachable, match="read-only"):
                async with db.connect():
                    pass
    finally:
        async with manager(admin_url) as admin, admin.transaction() as conn:
            await conn.execute(text(f"DROP ROLE IF EXISTS {role}"))
