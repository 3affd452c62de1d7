"""PostgreSQL behind PgBouncer in transaction mode: what it takes, and the settings' checks.

A PgBouncer of this module's own with ONE server session makes the sharing certain: every
client's transactions run on that session, one after another. The plain PostgreSQL backend
leaves its named prepared statements there (which another client may not find, or find taken),
the PgBouncer backend leaves none. The contract suite runs through the shared
bouncer of :mod:`tests.pgbouncer`; ``tests/e2e/test_pgbouncer.py`` runs real processes.
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from sqlalchemy import literal, select, text
from sqlalchemy.engine import make_url

from moorline.db.backends import PgBouncerBackend
from moorline.db.manager import DatabaseManager
from moorline.dispatch.pg_wakeups import PostgresWakeups
from moorline.dispatch.wakeups import LocalWakeups, make_wakeups
from moorline.errors import ConfigError
from moorline.settings import DatabasePooler, Settings
from tests.helpers import wait_for
from tests.pgbouncer import PrivateBouncer, direct_url, require_pgbouncer
from tests.servers import MYSQL_ADMIN_URL

CLIENTS = 4
ROUNDS = 20


@pytest.fixture(scope="module")
def backend() -> str:
    """Every ``db`` of this module is reached through the shared bouncer."""
    return "pgbouncer"


@pytest.fixture(scope="module")
def one_session(database_url: str) -> Iterator[PrivateBouncer]:
    """A bouncer of this module's own with a single server session."""
    bouncer = PrivateBouncer(require_pgbouncer(), server_pool=1)
    bouncer.start()
    try:
        yield bouncer
    finally:
        bouncer.stop()


def _through(bouncer: PrivateBouncer, database_url: str, pooler: DatabasePooler) -> Settings:
    name = make_url(database_url).database or ""
    return Settings(database_url=bouncer.url(name), database_pooler=pooler, db_retry_base=0.01)


@pytest.fixture
async def managers(
    request: pytest.FixtureRequest, one_session: PrivateBouncer, database_url: str
) -> AsyncIterator[list[DatabaseManager]]:
    settings = _through(one_session, database_url, request.param)
    made = [DatabaseManager(settings) for _ in range(CLIENTS)]
    try:
        yield made
    finally:
        for manager in made:
            await manager.dispose()


async def _work(db: DatabaseManager, client: int) -> None:
    # A read, a transaction and a one-statement write (autocommit), several times each.
    for round_ in range(ROUNDS):
        async with db.connect() as conn:
            value = client + round_
            assert (await conn.execute(select(literal(value)))).scalar_one() == value
        async with db.transaction() as conn:
            await conn.execute(text("SELECT pg_notify('moorline_pgb_test', 'x')"))
        await db.write_statement(text("SELECT CAST(:value AS integer)"), {"value": round_})


async def _prepared_statements_left(db: DatabaseManager) -> int:
    async with db.connect() as conn:
        # The one server session every client used.
        count = (await conn.execute(text("SELECT count(*) FROM pg_prepared_statements"))).scalar()
    assert isinstance(count, int)
    return count


@pytest.mark.parametrize("managers", [DatabasePooler.PGBOUNCER], indirect=True)
async def test_clients_share_a_session_and_leave_no_prepared_statement(
    managers: list[DatabaseManager],
) -> None:
    assert isinstance(managers[0].backend, PgBouncerBackend)
    await asyncio.gather(*(_work(db, index) for index, db in enumerate(managers)))
    assert await _prepared_statements_left(managers[0]) == 0


@pytest.mark.parametrize("managers", [DatabasePooler.NONE], indirect=True)
async def test_the_plain_backend_leaves_named_statements_on_the_session(
    managers: list[DatabaseManager],
) -> None:
    # Why the setting exists (and proof the check above can fail): asyncpg's statement cache
    # leaves __asyncpg_stmt_<n>__ on whichever server session ran it. Another process's
    # client, counting from 1 too, collides with those names; another session lacks them.
    await asyncio.gather(*(_work(db, index) for index, db in enumerate(managers)))
    assert await _prepared_statements_left(managers[0]) > 0


async def test_listen_goes_to_the_listen_url(
    db: DatabaseManager, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    assert settings.listen_url is not None
    assert [t.kwargs["port"] for t in db.listen_targets] == [make_url(settings.listen_url).port]
    other = DatabaseManager(settings)
    producer, consumer = PostgresWakeups(db), PostgresWakeups(other)
    await consumer.start()
    try:
        waiter = asyncio.create_task(consumer.wait("lane-pgb", 10.0))
        # The NOTIFY goes through the bouncer, the LISTEN is direct: the consumer is woken.
        await producer.notify({"lane-pgb"})
        assert await waiter is True
    finally:
        await consumer.close()
        await producer.close()
        await other.dispose()


async def test_without_a_listen_url_wakeups_fall_back_to_the_poll(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    bare = settings.model_copy(update={"listen_url": None})
    db = DatabaseManager(bare)
    try:
        assert db.listen_targets == []
        with pytest.raises(ConfigError, match="MOORLINE_LISTEN_URL"):
            PostgresWakeups(db)
        with caplog.at_level(logging.WARNING, logger="moorline.dispatch.wakeups"):
            notifier, waiter = make_wakeups(bare, db)
        assert isinstance(notifier, LocalWakeups) and waiter is notifier
        [line] = [r.getMessage() for r in caplog.records]
        assert "no LISTEN behind PgBouncer without MOORLINE_LISTEN_URL" in line
    finally:
        await db.dispose()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"database_url": "sqlite+aiosqlite:///:memory:", "database_pooler": "pgbouncer"},
            "MOORLINE_DATABASE_POOLER=pgbouncer needs PostgreSQL URLs",
        ),
        (
            {"database_url": MYSQL_ADMIN_URL, "database_pooler": "pgbouncer"},
            "MOORLINE_DATABASE_POOLER=pgbouncer needs PostgreSQL URLs",
        ),
        (
            {"database_url": MYSQL_ADMIN_URL, "listen_url": direct_url("x")},
            "MOORLINE_LISTEN_URL is for PostgreSQL's LISTEN/NOTIFY",
        ),
        (
            {"database_url": direct_url("x"), "listen_url": MYSQL_ADMIN_URL},
            "is not a PostgreSQL URL",
        ),
        (
            {"database_url": direct_url("x"), "listen_url": direct_url("x") + "?nonsense=1"},
            "query key 'nonsense'",
        ),
        ({"database_url": direct_url("x"), "listen_url": " , "}, "names no URL"),
    ],
)
def test_bad_pooler_settings_fail_at_start(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DatabaseManager(Settings(**changes))


def test_an_unknown_pooler_is_refused() -> None:
    with pytest.raises(ValueError, match="database_pooler"):
        Settings(database_pooler="pgpool")


async def test_several_listen_urls_are_tried_primary_first(settings: Settings) -> None:
    assert settings.listen_url is not None
    down = "postgresql+asyncpg://postgres@127.0.0.1:1/nowhere"
    both = f"{down},{settings.listen_url}"
    db = DatabaseManager(settings.model_copy(update={"listen_url": both}))
    try:
        direct = make_url(settings.listen_url).port
        assert [t.kwargs["port"] for t in db.listen_targets] == [1, direct]
        wakeups = PostgresWakeups(db)
        await wakeups.start()
        try:
            # The first address refuses; the listener connects to the second.
            await wait_for(lambda: _listening(wakeups), message="the listener to connect")
        finally:
            await wakeups.close()
    finally:
        await db.dispose()


async def _listening(wakeups: PostgresWakeups) -> bool:
    return wakeups.backend_pid is not None
