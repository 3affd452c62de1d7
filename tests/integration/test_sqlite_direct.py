"""The SQLite write connection's statements, sent past SQLAlchemy's execution."""

import sqlite3
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import (
    Column,
    Integer,
    MetaData,
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
from sqlalchemy.exc import IntegrityError, StatementError

from moorline.db import sqlite_driver
from moorline.db.backends import sqlite_direct
from moorline.db.manager import DatabaseManager
from moorline.db.types import JSONDocument, UTCDateTime
from moorline.settings import Settings
from tests.contract.statements import data_statements

metadata = MetaData()
things = Table(
    "things",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("name", String(40), unique=True),
    Column("label", String(40)),
    Column("data", JSONDocument()),
    Column("at", UTCDateTime()),
    Column("weight", Integer, nullable=False, default=7),
    Column("origin", String(40), default=lambda: "computed"),
)
RENAME = (
    update(things)
    .where(things.c.id.in_(bindparam("ids", expanding=True)))
    .values(label=bindparam("new_label"), data=bindparam("new_data"), at=bindparam("new_at"))
)
NAME = update(things).where(things.c.id == bindparam("b_id")).values(name=bindparam("new_name"))
AT = datetime(2026, 11, 29, 20, 15, 1, 250000, tzinfo=UTC)


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[DatabaseManager]:
    manager = DatabaseManager(Settings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'm.db'}"))
    try:
        async with manager.transaction() as conn:
            await conn.run_sync(metadata.create_all)
            await conn.execute(insert(things), [{"id": i, "name": f"n{i}"} for i in range(1, 5)])
        yield manager
    finally:
        await manager.dispose()


def stored(db: DatabaseManager, ids: tuple[int, ...]) -> list[tuple[Any, ...]]:
    """The rows as SQLite holds them (text, not SQLAlchemy's types), read by a connection apart."""
    path = db.engine.url.database
    assert path is not None
    connection = sqlite3.connect(path)
    try:
        marks = ",".join("?" * len(ids))
        return connection.execute(
            f"SELECT label, data, at, weight FROM things WHERE id IN ({marks}) ORDER BY id", ids
        ).fetchall()
    finally:
        connection.close()


async def test_a_direct_write_binds_its_parameters_as_sqlalchemy_does(
    db: DatabaseManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[str] = []
    write_alone = sqlite_driver.Connection.write_alone

    async def counted(self: sqlite_driver.Connection, begin: str, sql: str, args: Any) -> int:
        sent.append(sql)
        return await write_alone(self, begin, sql, args)

    monkeypatch.setattr(sqlite_driver.Connection, "write_alone", counted)
    data = {"text": "ü ✓", "n": [1, 2.5, None]}
    params = {"new_label": "direct", "new_data": data, "new_at": AT}
    assert await db.write_statement(RENAME, {**params, "ids": [1, 2]}) == 2
    assert sent == ["UPDATE things SET label=?, data=?, at=? WHERE things.id IN (?, ?)"]
    with data_statements(db, None) as seen:
        changed = await db.write_statement(RENAME, {**params, "new_label": "sqla", "ids": [3, 4]})
    assert changed == 2
    assert len(seen) == 1, "a listener sees the statement: SQLAlchemy's path ran it"
    assert len(sent) == 1
    # Execution options are SQLAlchemy's to read: such a statement goes its way.
    with_options = RENAME.execution_options(synchronize_session=False)
    assert await db.write_statement(with_options, {**params, "ids": [1]}) == 1
    assert len(sent) == 1
    direct, through_sqlalchemy = stored(db, (1, 2)), stored(db, (3, 4))
    assert [row[1:] for row in direct] == [row[1:] for row in through_sqlalchemy]
    assert direct[0][2] == "2026-11-29 20:15:01.250000"  # SQLAlchemy's SQLite datetime text
    async with db.connect() as conn:
        row = (await conn.execute(things.select().where(things.c.id == 1))).one()
    assert (row.label, row.data, row.at) == ("direct", data, AT)


async def test_a_failed_direct_write_raises_sqlalchemys_error_and_leaves_nothing_open(
    db: DatabaseManager,
) -> None:
    with pytest.raises(IntegrityError, match="UNIQUE"):
        await db.write_statement(NAME, {"new_name": "n2", "b_id": 1})
    path = db.engine.url.database
    assert path is not None
    other = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")  # the write lock is free
        other.execute("ROLLBACK")
    finally:
        other.close()
    assert await db.write_statement(NAME, {"new_name": "free", "b_id": 1}) == 1
    async with db.connect() as conn:
        names = (await conn.execute(select(things.c.name).order_by(things.c.id))).scalars()
        assert list(names) == ["free", "n2", "n3", "n4"]


async def test_python_side_defaults_are_bound_as_sqlalchemy_computes_them(
    db: DatabaseManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent = count_direct(monkeypatch, "write_alone")
    # ``weight``'s default is a constant, bound directly; ``origin``'s a function, which only
    # SQLAlchemy's execution calls.
    assert await db.write_statement(insert(things), {"id": 9, "origin": "given"}) == 1
    assert sent == ["statement"]
    assert await db.write_statement(insert(things), {"id": 10}) == 1
    assert sent == ["statement"]
    assert stored(db, (9, 10)) == [(None, None, None, 7), (None, None, None, 7)]
    async with db.connect() as conn:
        origins = (await conn.execute(select(things.c.origin).where(things.c.id > 8))).scalars()
        assert list(origins) == ["given", "computed"]


async def test_an_executemany_binds_each_set_as_sqlalchemy_does(
    db: DatabaseManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent = count_direct(monkeypatch, "execute_many")
    shared = {"same": "object"}

    def sets(first: int) -> list[dict[str, Any]]:
        # Values shared by every set and values of their own, a default left to the column.
        return [
            {"id": first + i, "label": f"l{i}", "data": shared if i % 2 else {"i": i}, "at": AT}
            for i in range(12)
        ] + [{"id": first + 12, "label": "last", "data": shared, "at": None}]

    async with db.transaction() as conn:
        assert (await conn.execute(insert(things).values(origin="x"), sets(100))).rowcount == 13
    assert sent == ["statement"]
    with data_statements(db, None) as seen:
        async with db.transaction() as conn:
            await conn.execute(insert(things).values(origin="x"), sets(200))
    assert len(seen) == 1 and sent == ["statement"], "with a listener, SQLAlchemy's path ran it"
    direct, through_sqlalchemy = (
        stored(db, tuple(range(100, 113))),
        stored(db, tuple(range(200, 213))),
    )
    assert direct == through_sqlalchemy
    assert direct[1] == ("l1", '{"same": "object"}', "2026-11-29 20:15:01.250000", 7)
    # Every column given in every set (a run's INSERT): the rows are read by their keys.
    whole = [{**values, "weight": 3, "origin": "y"} for values in sets(400)]
    async with db.transaction() as conn:
        assert (await conn.execute(insert(things), whole)).rowcount == 13
    assert sent == ["statement", "statement"]
    with data_statements(db, None):
        async with db.transaction() as conn:
            await conn.execute(insert(things), [{**row, "id": row["id"] + 100} for row in whole])
    assert stored(db, tuple(range(400, 413))) == stored(db, tuple(range(500, 513)))
    assert stored(db, (401, 412)) == [
        ("l1", '{"same": "object"}', "2026-11-29 20:15:01.250000", 3),
        ("last", '{"same": "object"}', None, 3),
    ]
    # Sets that name other keys, or a function default, go SQLAlchemy's way, which decides:
    # it compiles for the first set's keys, ignores others' extra keys, refuses a missing one.
    uneven = [{"id": 300, "label": "a"}, {"id": 301, "label": "b", "at": AT}]
    async with db.transaction() as conn:
        await conn.execute(insert(things).values(origin="x"), uneven)
        await conn.execute(insert(things), [{"id": 302}, {"id": 303}])
    with pytest.raises(StatementError, match="A value is required for bind parameter 'at'"):
        async with db.transaction() as conn:
            await conn.execute(insert(things).values(origin="x"), uneven[::-1])
    assert sent == ["statement", "statement"]
    assert stored(db, (301,)) == [("b", None, None, 7)]
    async with db.connect() as conn:
        found = await conn.execute(
            select(things.c.id, things.c.origin).where(things.c.id.between(300, 399))
        )
        assert sorted(tuple(row) for row in found) == [
            (300, "x"),
            (301, "x"),
            (302, "computed"),
            (303, "computed"),
        ]


async def test_a_failed_executemany_writes_none_of_its_sets(db: DatabaseManager) -> None:
    clashing = [{"id": 20, "name": "fresh"}, {"id": 21, "name": "n1"}]
    with pytest.raises(IntegrityError, match="UNIQUE"):
        async with db.transaction() as conn:
            await conn.execute(insert(things).values(origin="x"), clashing)
    assert stored(db, (20, 21)) == []


def count_direct(monkeypatch: pytest.MonkeyPatch, method: str) -> list[str]:
    """A list that gets ``"statement"`` for each statement ``DirectWrites.<method>`` sent
    (``execute_many`` answers None for one it leaves to SQLAlchemy)."""
    direct: list[str] = []
    original = getattr(sqlite_direct.DirectWrites, method)

    async def counted(self: sqlite_direct.DirectWrites, *args: Any) -> Any:
        result = await original(self, *args)
        if result is not None:
            direct.append("statement")
        return result

    monkeypatch.setattr(sqlite_direct.DirectWrites, method, counted)
    return direct


async def test_a_transactions_statements_go_direct_and_return_what_sqlalchemy_returns(
    db: DatabaseManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    direct = count_direct(monkeypatch, "execute")
    data = {"k": ["v", 1.5]}
    params = {"new_label": "x", "new_data": data, "new_at": AT, "ids": [1, 2, 3]}
    reading = select(things.c.id, things.c.data, things.c.at.label("when"), func.count().over())

    async def scenario() -> list[Any]:
        seen: list[Any] = []
        async with db.transaction() as conn:
            seen.append((await conn.execute(RENAME, params)).rowcount)
            # A copy of a statement that ran: SQLAlchemy copies what it memoized about it.
            returning = RENAME.returning(things.c.id, things.c.at)
            found = await conn.execute(
                reading.where(things.c.id < bindparam("below")), {"below": 3}
            )
            seen.append([(row.id, row.data, row.when, row[3]) for row in found])
            seen.append((await conn.execute(returning, params)).mappings().all())
            seen.append((await conn.execute(select(func.count()).select_from(things))).scalar_one())
            await conn.execute(update(things).values(label=None))
        return seen

    first = await scenario()
    assert len(direct) == 5, "every statement of the transaction went to the driver"
    with data_statements(db, None) as seen:
        again = await scenario()
    assert len(seen) == 5 and len(direct) == 5, "with a listener, SQLAlchemy's path ran them"
    assert first == again
    assert first[0] == 3
    assert first[1] == [(1, data, AT, 2), (2, data, AT, 2)]
    assert first[2] == [{"id": i, "at": AT} for i in (1, 2, 3)]
    assert first[3] == 4


async def test_in_lists_of_any_length_bind_as_sqlalchemy_binds_them(db: DatabaseManager) -> None:
    # The expanded SQL is kept per list length: lengths that come and go, an empty list, a
    # value embedded in the statement (the ``'n%'`` below), a value rendered into the SQL.
    picked = (
        select(things.c.id)
        .where(things.c.id.in_(bindparam("ids", expanding=True)))
        .where(things.c.name.like("n%"))
        .where(things.c.weight.in_(bindparam("weights", expanding=True)))
        .order_by(things.c.id)
    )
    rendered = select(things.c.id).where(things.c.id < bindparam("below", literal_execute=True))
    calls = [[1, 2, 3], [2], [], [4, 1], [2], [1, 2, 3]]

    async def scenario() -> list[Any]:
        seen: list[Any] = []
        async with db.transaction() as conn:
            await conn.execute(update(things).values(weight=1))
            for ids in calls:
                found = await conn.execute(picked, {"ids": ids, "weights": [1, 2][: len(ids)]})
                seen.append(found.scalars().all())
            seen.append((await conn.execute(rendered, {"below": 3})).scalars().all())
        return seen

    first = await scenario()
    with data_statements(db, None) as seen:
        again = await scenario()
    assert len(seen) == len(calls) + 2, "with a listener, SQLAlchemy's path ran them"
    assert first == again == [[1, 2, 3], [2], [], [1, 4], [2], [1, 2, 3], [1, 2]]


async def test_a_write_transaction_is_begun_and_committed_on_the_driver(
    db: DatabaseManager,
) -> None:
    # SQLAlchemy's begin and commit (a greenlet each, with their events) are not run for a
    # transaction of direct statements; one of SQLAlchemy's way joins the driver's transaction.
    transactions: list[str] = []
    engine = db.engine.sync_engine
    for name in ("begin", "commit", "rollback"):
        event.listen(engine, name, lambda _conn, name=name: transactions.append(name))
    async with db.transaction() as conn:
        await conn.execute(NAME, {"b_id": 1, "new_name": "direct"})
    assert transactions == []
    async with db.transaction() as conn:
        await conn.execute(NAME, {"b_id": 2, "new_name": "both"})
        await conn.execute(text("UPDATE things SET label = 'by text' WHERE id = 2"))
        await conn.execute(NAME, {"b_id": 3, "new_name": "after"})
    assert transactions == ["begin", "commit"]
    with pytest.raises(RuntimeError, match="refused"):
        async with db.transaction() as conn:
            await conn.execute(NAME, {"b_id": 4, "new_name": "lost"})
            await conn.execute(text("UPDATE things SET label = 'lost' WHERE id = 4"))
            raise RuntimeError("refused")
    async with db.transaction() as conn:
        await conn.execute(NAME, {"b_id": 1, "new_name": "again"})
    path = db.engine.url.database
    assert path is not None
    connection = sqlite3.connect(path)
    try:
        rows = connection.execute("SELECT id, name, label FROM things ORDER BY id").fetchall()
    finally:
        connection.close()
    assert rows == [(1, "again", None), (2, "both", "by text"), (3, "after", None), (4, "n4", None)]
