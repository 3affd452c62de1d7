"""DatabaseManager on every backend: it connects, writes, and reports database time."""

from datetime import UTC, datetime, timedelta

from sqlalchemy import select, text

from moorline.db.dialects import db_now
from moorline.db.manager import DatabaseManager


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
            await conn.execute(select(db_now(db.dialect), db_now(db.dialect, plus_s=90.5)))
        ).one()
    assert now.tzinfo is not None
    assert abs(now - datetime.now(UTC)) < timedelta(seconds=5)
    assert timedelta(seconds=90) < later - now < timedelta(seconds=91)
