"""DatabaseManager on every backend: it connects, writes, and reports database time."""

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import insert, select, text
from sqlalchemy.exc import IntegrityError

from moorline.db.manager import DatabaseManager
from moorline.db.schema import tenants


async def test_transaction_commits_and_reads_back(db: DatabaseManager) -> None:
    async with db.transaction() as conn:
        await conn.execute(text("CREATE TABLE IF NOT EXISTS probe_t (v INTEGER)"))
    async with db.transaction() as conn:
        await conn.execute(text("INSERT INTO probe_t (v) VALUES (42)"))
    async with db.connect() as conn:
        value = (await conn.execute(text("SELECT max(v) FROM probe_t"))).scalar_one()
    assert value == 42


async def test_database_time_is_utc_and_offsets_apply(db: DatabaseManager) -> None:
    async with db.connect() as conn:
        now, later = (
            await conn.execute(select(db.backend.now(), db.backend.now(plus_s=90.5)))
        ).one()
    assert now.tzinfo is not None
    assert abs(now - datetime.now(UTC)) < timedelta(seconds=5)
    assert timedelta(seconds=90) < later - now < timedelta(seconds=91)


async def test_strings_compare_exactly_on_every_backend(db: DatabaseManager) -> None:
    # MySQL's default collation would call these equal and refuse the second as a duplicate.
    # (Trailing spaces still compare equal there: utf8mb4_bin pads; names are validated.)
    now = datetime.now(UTC)
    names = [f"Acme-{uuid.uuid4().hex[:8]}"]
    names.append(names[0].lower())
    async with db.transaction() as conn:
        for name in names:
            await conn.execute(
                insert(tenants).values(
                    id=str(uuid.uuid4()), name=name, plan="p", created_at=now, updated_at=now
                )
            )
    async with db.connect() as conn:
        found = await conn.execute(select(tenants.c.name).where(tenants.c.name == names[0]))
        assert list(found.scalars()) == [names[0]]


@pytest.mark.requires("server")
async def test_a_write_transaction_sees_what_others_committed_since_it_began(
    db: DatabaseManager,
) -> None:
    # READ COMMITTED on every pooled connection: after a lock wait a statement must see the
    # previous holder's commit. Under MySQL's default REPEATABLE READ the second count would
    # still read the snapshot of the first.
    async with db.transaction() as conn:
        await conn.execute(text("CREATE TABLE IF NOT EXISTS probe_rc (v INTEGER)"))
    async with db.write_transaction() as conn:
        before = (await conn.execute(text("SELECT count(*) FROM probe_rc"))).scalar_one()
        async with db.transaction() as other:
            await other.execute(text("INSERT INTO probe_rc (v) VALUES (1)"))
        after = (await conn.execute(text("SELECT count(*) FROM probe_rc"))).scalar_one()
    assert after == before + 1


async def test_a_write_statement_commits_alone_and_reports_its_rowcount(
    db: DatabaseManager,
) -> None:
    async with db.transaction() as conn:
        await conn.execute(text("CREATE TABLE IF NOT EXISTS probe_ws (k INTEGER PRIMARY KEY)"))
        await conn.execute(text("DELETE FROM probe_ws"))
    insert_k = text("INSERT INTO probe_ws (k) VALUES (:k)")
    assert await db.write_statement(insert_k, {"k": 1}) == 1
    with pytest.raises(IntegrityError):
        await db.write_statement(insert_k, {"k": 1})
    # Nothing of the refused statement stays open on its connection: the pool goes on.
    for k in range(2, 12):
        assert await db.write_statement(insert_k, {"k": k}) == 1
    assert await db.write_statement(text("DELETE FROM probe_ws WHERE k > 5")) == 6
    assert await db.write_statement(text("DELETE FROM probe_ws WHERE k > 5")) == 0
    async with db.connect() as conn:
        found = (await conn.execute(text("SELECT k FROM probe_ws ORDER BY k"))).scalars()
        assert list(found) == [1, 2, 3, 4, 5]


@pytest.mark.requires("server")
async def test_write_statements_run_in_autocommit_at_read_committed(db: DatabaseManager) -> None:
    # Each statement is a transaction of the session's level, not the engine's (which
    # autocommit replaces): it must be READ COMMITTED like write_transaction()'s.
    level = {
        "postgresql": "current_setting('transaction_isolation')",
        "mysql": "@@session.tx_isolation",
    }[db.backend.name]
    async with db.transaction() as conn:
        await conn.execute(text("CREATE TABLE IF NOT EXISTS probe_iso (v VARCHAR(40))"))
        await conn.execute(text("DELETE FROM probe_iso"))
    # Several, so more than one pooled connection answers.
    await asyncio.gather(
        *(db.write_statement(text(f"INSERT INTO probe_iso (v) SELECT {level}")) for _ in range(8))
    )
    async with db.connect() as conn:
        levels = set((await conn.execute(text("SELECT v FROM probe_iso"))).scalars())
    assert {value.replace("-", " ").lower() for value in levels} == {"read committed"}
