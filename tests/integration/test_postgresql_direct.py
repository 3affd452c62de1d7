"""PostgreSQL's statements, sent to asyncpg past SQLAlchemy's execution."""

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import asyncpg
import pytest
from sqlalchemy import (
    Column,
    Float,
    Integer,
    MetaData,
    Numeric,
    String,
    Table,
    bindparam,
    event,
    func,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, IntegrityError

from moorline.db.backends import postgresql_direct
from moorline.db.manager import DatabaseManager
from moorline.db.types import JSONDocument, UTCDateTime
from moorline.settings import Settings
from tests.servers import PG_ADMIN_URL

metadata = MetaData()
gadgets = Table(
    "gadgets",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("name", String(40), unique=True),
    Column("label", String(40)),
    Column("data", JSONDocument()),
    Column("at", UTCDateTime()),
    Column("weight", Integer, nullable=False, default=7),
    Column("score", Float, nullable=False, default=0.5),
    Column("price", Numeric(10, 2), nullable=False, default=Decimal("1.25")),
)
ADD = insert(gadgets).returning(gadgets.c.id, gadgets.c.data, gadgets.c.at, gadgets.c.weight)
RENAME = (
    update(gadgets)
    .where(gadgets.c.id.in_(bindparam("ids", expanding=True)))
    .values(label=bindparam("new_label"), data=bindparam("new_data"), at=bindparam("new_at"))
)
SLOW_RENAME = (
    update(gadgets)
    .where(gadgets.c.id == bindparam("b_id"), text("pg_sleep(:pause_s) IS NOT NULL"))
    .values(label=bindparam("new_label"))
)
# An IN list before another parameter: numbered $2, $3 … after the $1 of ``at_least``.
HEAVY = select(gadgets.c.id, gadgets.c.score, gadgets.c.price).where(
    gadgets.c.id.in_(bindparam("ids", expanding=True)), gadgets.c.weight >= bindparam("at_least")
)
AT = datetime(2026, 11, 30, 3, 15, 1, 250000, tzinfo=UTC)


@pytest.fixture(scope="module", params=["postgresql", "pgbouncer"])
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
async def db(settings: Settings) -> AsyncIterator[DatabaseManager]:
    # One pooled connection: a test that changes or loses it knows the next write's.
    manager = DatabaseManager(settings.model_copy(update={"db_pool_size": 1, "db_max_overflow": 0}))
    try:
        async with manager.transaction() as conn:
            await conn.run_sync(metadata.drop_all)
            await conn.run_sync(metadata.create_all)
            await conn.execute(insert(gadgets), [{"id": i, "name": f"n{i}"} for i in range(1, 5)])
        yield manager
    finally:
        await manager.dispose()


def count_direct(monkeypatch: pytest.MonkeyPatch, method: str = "write") -> list[str]:
    """A list that gets each statement's SQL as ``DirectStatements.<method>`` sends it
    (``write``: in autocommit; ``execute``: in a transaction)."""
    sent: list[str] = []
    original = getattr(postgresql_direct.DirectStatements, method)

    async def counted(self: postgresql_direct.DirectStatements, *args: Any) -> Any:
        sent.append(str(args[-2].compiled))  # the form
        return await original(self, *args)

    monkeypatch.setattr(postgresql_direct.DirectStatements, method, counted)
    return sent


def listening(db: DatabaseManager) -> Callable[[], None]:
    """Attach a cursor listener (SQLAlchemy's path from now on); returns its removal."""

    def seen(*_: Any) -> None:
        pass

    engine = db.engine.sync_engine
    event.listen(engine, "before_cursor_execute", seen)
    return lambda: event.remove(engine, "before_cursor_execute", seen)


async def stored(db: DatabaseManager, ids: list[int]) -> list[tuple[Any, ...]]:
    query = select(gadgets.c.label, gadgets.c.data, gadgets.c.at, gadgets.c.weight)
    async with db.connect() as conn:
        found = await conn.execute(query.where(gadgets.c.id.in_(ids)).order_by(gadgets.c.id))
        return [tuple(row) for row in found]


async def test_a_one_statement_write_goes_direct_and_does_what_sqlalchemy_does(
    db: DatabaseManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent = count_direct(monkeypatch)
    params = {"ids": [1, 2], "new_label": "direct", "new_data": {"k": [1, "é"]}, "new_at": AT}
    assert await db.write_statement(RENAME, params) == 2
    added = await db.write_statement_rows(ADD, {"id": 10, "name": "ten", "data": {"a": None}})
    assert len(sent) == 2

    stop = listening(db)
    try:
        again = {**params, "ids": [3, 4]}
        assert await db.write_statement(RENAME, again) == 2
        added_by_sqlalchemy = await db.write_statement_rows(
            ADD, {"id": 11, "name": "eleven", "data": {"a": None}}
        )
    finally:
        stop()
    assert len(sent) == 2  # the listener sent both SQLAlchemy's way

    assert await stored(db, [1, 2]) == await stored(db, [3, 4])
    assert (await stored(db, [1]))[0] == ("direct", {"k": [1, "é"]}, AT, 7)
    # The rows as SQLAlchemy gives them: keys, types and the constant column default.
    assert added[0]._mapping.keys() == added_by_sqlalchemy[0]._mapping.keys()
    assert (added[0].id, added[0].data, added[0].at, added[0].weight) == (10, {"a": None}, None, 7)
    assert added_by_sqlalchemy[0].id == 11
    assert added_by_sqlalchemy[0][1:] == added[0][1:]


async def test_a_refused_write_raises_sqlalchemys_error_and_keeps_the_connection(
    db: DatabaseManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent = count_direct(monkeypatch)
    with pytest.raises(IntegrityError) as refused:
        await db.write_statement_rows(ADD, {"id": 20, "name": "n1"})
    assert not refused.value.connection_invalidated
    assert "gadgets_name_key" in str(refused.value)
    assert len(sent) == 1
    assert db.pool_usage()[0] == 0  # checked back in
    assert (
        await db.write_statement(
            RENAME, {"ids": [1], "new_label": "after", "new_data": None, "new_at": AT}
        )
        == 1
    )
    async with db.connect() as conn:
        assert await conn.scalar(select(func.count()).select_from(gadgets)) == 4


@pytest.fixture
async def admin() -> AsyncIterator[asyncpg.Connection]:
    """A connection of the server's own, apart from the pool under test."""
    connection = await asyncpg.connect(PG_ADMIN_URL.replace("+asyncpg", ""))
    try:
        yield connection
    finally:
        await connection.close()


async def sleeping(admin: asyncpg.Connection) -> int:
    """The pid of the server process running the slow rename (its ``pg_sleep``)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pid = await admin.fetchval(
            "SELECT pid FROM pg_stat_activity WHERE state = 'active' "
            "AND query LIKE '%pg_sleep%' AND pid <> pg_backend_pid()"
        )
        if pid is not None:
            return int(pid)
        await asyncio.sleep(0.02)
    raise AssertionError("the slow rename did not start")


async def test_a_lost_connection_is_invalidated_and_the_write_retried(
    backend: str, db: DatabaseManager, admin: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend == "pgbouncer":
        pytest.skip("behind PgBouncer the client's connection outlives a server session")
    sent = count_direct(monkeypatch)
    params = {"b_id": 2, "new_label": "slow", "pause_s": 2.0}
    write = asyncio.create_task(db.write_statement(SLOW_RENAME, params))
    assert await admin.fetchval("SELECT pg_terminate_backend($1)", await sleeping(admin))
    # with_retry is the caller's: this write is not retried here, it fails as SQLAlchemy's would.
    with pytest.raises(DBAPIError) as lost:
        await write
    assert lost.value.connection_invalidated
    assert len(sent) == 1
    # The pool opens a new connection for the next write, which succeeds.
    quick = {**params, "pause_s": 0.0}
    assert await db.with_retry(lambda: db.write_statement(SLOW_RENAME, quick)) == 1
    assert (await stored(db, [2]))[0][0] == "slow"


async def test_a_node_turned_read_only_is_a_lost_connection(
    backend: str, db: DatabaseManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend == "pgbouncer":
        pytest.skip("a session setting does not stay with a PgBouncer client")
    async with db.engine.connect() as conn:  # the pool's one connection
        await conn.execute(text("SET SESSION default_transaction_read_only = on"))
        await conn.commit()
    sent = count_direct(monkeypatch)
    params = {"ids": [3], "new_label": "ro", "new_data": None, "new_at": AT}
    with pytest.raises(DBAPIError) as refused:
        await db.write_statement(RENAME, params)
    assert refused.value.connection_invalidated
    assert await db.write_statement(RENAME, params) == 1  # on a new connection
    assert len(sent) == 2


async def test_a_cancelled_write_does_not_leave_its_connection_in_the_pool(
    backend: str, db: DatabaseManager, admin: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend == "pgbouncer":
        pytest.skip("PgBouncer keeps its server session after the client goes")
    sent = count_direct(monkeypatch)
    params = {"b_id": 3, "new_label": "cancelled", "pause_s": 30.0}
    write = asyncio.create_task(db.write_statement(SLOW_RENAME, params))
    pid = await sleeping(admin)
    write.cancel()
    with pytest.raises(asyncio.CancelledError):
        await write
    assert db.pool_usage()[0] == 0
    # The pool's one connection was dropped: the next write runs at once, on a new session,
    # while the cancelled statement may still sleep on the server (as on SQLAlchemy's path).
    renamed = (
        update(gadgets)
        .where(gadgets.c.id == 4)
        .values(label="next")
        .returning(func.pg_backend_pid().label("pid"))
    )
    async with asyncio.timeout(10):
        rows = await db.write_statement_rows(renamed, {})
    assert rows[0].pid != pid
    assert len(sent) == 2
    await admin.execute("SELECT pg_terminate_backend($1)", pid)


async def test_a_connection_past_the_pools_size_is_closed_as_it_comes_back(
    backend: str,
    db: DatabaseManager,
    settings: Settings,
    admin: asyncpg.Connection,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if backend == "pgbouncer":
        pytest.skip("PgBouncer keeps its server sessions; the client's are what is checked")
    sent = count_direct(monkeypatch)
    sessions = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()"
    )
    database = make_url(settings.database_url).database
    before = await admin.fetchval(sessions, database)  # the table's maker's, say
    two = DatabaseManager(settings.model_copy(update={"db_pool_size": 1, "db_max_overflow": 1}))
    try:
        slow = [
            two.write_statement(SLOW_RENAME, {"b_id": n, "new_label": "both", "pause_s": 0.3})
            for n in (1, 2)
        ]
        assert await asyncio.gather(*slow) == [1, 1]
        assert len(sent) == 2
        # Two connections were open at once; the one past the pool's size is closed, not left
        # for the garbage collector.
        deadline = time.monotonic() + 10
        while (open_now := await admin.fetchval(sessions, database)) != before + 1:
            assert time.monotonic() < deadline, f"{open_now - before} sessions open, not 1"
            await asyncio.sleep(0.02)
        assert two.pool_usage() == (0, 1)
    finally:
        await two.dispose()


async def test_a_transactions_statements_go_direct_and_do_what_sqlalchemy_does(
    db: DatabaseManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent = count_direct(monkeypatch, "execute")
    params = {"ids": [1, 2], "new_label": "in", "new_data": {"k": "v"}, "new_at": AT}
    async with db.transaction() as conn:
        assert (await conn.execute(RENAME, params)).rowcount == 2
        added = (await conn.execute(ADD, {"id": 30, "name": "thirty"})).all()
        read = (await conn.execute(select(gadgets.c.label).where(gadgets.c.id == 1))).scalar()
    async with db.transaction() as conn:
        heavy = (await conn.execute(HEAVY, {"ids": [1, 2, 30, 99], "at_least": 7})).all()
    assert len(sent) == 4
    assert read == "in"  # the transaction's own write, seen inside it
    assert [tuple(row) for row in heavy] == [(i, 0.5, Decimal("1.25")) for i in (1, 2, 30)]

    stop = listening(db)
    try:
        async with db.transaction() as conn:
            await conn.execute(RENAME, {**params, "ids": [3, 4]})
            added_by_sqlalchemy = (await conn.execute(ADD, {"id": 31, "name": "t1"})).all()
            heavy_by_sqlalchemy = (
                await conn.execute(HEAVY, {"ids": [1, 2, 30, 99], "at_least": 7})
            ).all()
    finally:
        stop()
    assert len(sent) == 4
    assert [tuple(row) for row in heavy_by_sqlalchemy] == [tuple(row) for row in heavy]
    assert [type(value) for value in heavy[0]] == [type(value) for value in heavy_by_sqlalchemy[0]]
    assert await stored(db, [1, 2]) == await stored(db, [3, 4])
    assert added[0]._mapping.keys() == added_by_sqlalchemy[0]._mapping.keys()
    assert added[0][1:] == added_by_sqlalchemy[0][1:]


async def test_a_direct_statement_is_part_of_its_transaction(
    db: DatabaseManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent = count_direct(monkeypatch, "execute")
    params = {"ids": [1], "new_label": "undone", "new_data": None, "new_at": AT}
    with pytest.raises(RuntimeError):
        async with db.transaction() as conn:
            await conn.execute(RENAME, params)  # begins the transaction, as a cursor would
            await conn.execute(text("SET LOCAL statement_timeout = '5s'"))  # SQLAlchemy's
            await conn.execute(ADD, {"id": 40, "name": "forty"})
            raise RuntimeError("after the writes")
    assert len(sent) == 2
    assert (await stored(db, [1]))[0][0] != "undone"
    with pytest.raises(IntegrityError):
        async with db.transaction() as conn:
            await conn.execute(ADD, {"id": 41, "name": "forty-one"})
            await conn.execute(ADD, {"id": 42, "name": "n2"})  # taken
    async with db.connect() as conn:
        found = await conn.scalar(select(func.count()).where(gadgets.c.id.in_([40, 41, 42])))
    assert found == 0
    assert db.pool_usage()[0] == 0


async def test_a_connection_lost_in_a_transaction_is_invalidated(
    backend: str, db: DatabaseManager, admin: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend == "pgbouncer":
        pytest.skip("behind PgBouncer the client's connection outlives a server session")
    sent = count_direct(monkeypatch, "execute")
    params = {"b_id": 2, "new_label": "lost", "pause_s": 2.0}

    async def rename_slowly() -> None:
        async with db.transaction() as conn:
            await conn.execute(ADD, {"id": 50, "name": "fifty"})
            await conn.execute(SLOW_RENAME, params)

    write = asyncio.create_task(rename_slowly())
    assert await admin.fetchval("SELECT pg_terminate_backend($1)", await sleeping(admin))
    with pytest.raises(DBAPIError) as lost:
        await write
    assert lost.value.connection_invalidated
    assert len(sent) == 2
    assert db.pool_usage()[0] == 0
    async with db.transaction() as conn:  # a new connection
        await conn.execute(SLOW_RENAME, {**params, "pause_s": 0.0})
    assert (await stored(db, [2]))[0][0] == "lost"
    async with db.connect() as conn:
        assert await conn.scalar(select(func.count()).where(gadgets.c.id == 50)) == 0


async def test_without_fast_paths_every_write_is_sqlalchemys(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent = count_direct(monkeypatch)
    db = DatabaseManager(settings.model_copy(update={"fast_paths": False}))
    try:
        params = {"ids": [4], "new_label": "public", "new_data": [], "new_at": AT}
        assert await db.write_statement(RENAME, params) == 1
    finally:
        await db.dispose()
    assert sent == []
