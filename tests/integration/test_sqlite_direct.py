"""One-statement writes on SQLite sent past SQLAlchemy's execution (``sqlite_direct``)."""

import sqlite3
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
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
    insert,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError

from moorline.db import sqlite_driver
from moorline.db.manager import DatabaseManager
from moorline.db.types import JSONDocument, UTCDateTime
from moorline.settings import Settings

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


@contextmanager
def statements_seen(db: DatabaseManager) -> Iterator[list[str]]:
    """What SQLAlchemy's cursor events see; listening also turns the direct path off."""
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        seen.append(statement)

    engine = db.engine.sync_engine
    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


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
    with statements_seen(db) as seen:
        changed = await db.write_statement(RENAME, {**params, "new_label": "sqla", "ids": [3, 4]})
    assert changed == 2
    assert len(seen) == 1, "a listener sees the statement: SQLAlchemy's path ran it"
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


async def test_a_statement_with_python_side_defaults_goes_through_sqlalchemy(
    db: DatabaseManager,
) -> None:
    # ``weight`` has a Python-side default, which SQLAlchemy's execution computes.
    assert await db.write_statement(insert(things), {"id": 9, "label": "defaulted"}) == 1
    assert stored(db, (9,)) == [("defaulted", None, None, 7)]
