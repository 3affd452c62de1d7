"""Retention on SQLite: the file shrinks, and an old file without incremental vacuum is told."""

import asyncio
import os
import sqlite3
from collections.abc import AsyncIterator
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import insert
from sqlalchemy.engine import make_url

from moorline.db.manager import DatabaseManager
from moorline.db.repos.queue import QueueRepo
from moorline.db.repos.retention import RetentionPolicy
from moorline.db.schema import events
from moorline.dispatch.leader import LeaderElector
from moorline.dispatch.retention import LEADER_LEASE, RetentionCleaner
from moorline.settings import Settings
from tests.contract.queue_helpers import Tenants, unique
from tests.contract.retention_helpers import KEEP_30, add_runs, rows_of
from tests.helpers import wait_for


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


def _sqlite_file(db: DatabaseManager) -> str:
    path = make_url(db.urls[0]).database
    assert path is not None
    return path


def _checkpoint_and_measure(path: str) -> tuple[int, int, int] | None:
    """(file bytes, page count, free pages) once the whole log is copied back; else None."""
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        busy, logged, copied = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if busy or logged != copied:
            return None  # the backend's own checkpointer or a reader was in the way
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        free = conn.execute("PRAGMA freelist_count").fetchone()[0]
    return os.path.getsize(path), pages, free


async def measured(db: DatabaseManager) -> tuple[int, int, int]:
    path = _sqlite_file(db)

    async def measure() -> tuple[int, int, int] | None:
        return await asyncio.to_thread(_checkpoint_and_measure, path)

    found = await wait_for(measure, message="a checkpoint of the whole log")
    assert found is not None
    return found


@pytest.mark.requires("embedded")
async def test_the_sqlite_file_shrinks(db: DatabaseManager, tenants: Tenants) -> None:
    tenant = await tenants.new()
    old = await add_runs(db, tenant, 1500)
    async with db.transaction() as conn:  # bulk: what outputs and event data weigh
        await conn.execute(
            insert(events),
            [
                {
                    "run_id": r,
                    "seq": 3,
                    "type": "t",
                    "attempt": 1,
                    "data": {"x": "y" * 2000},
                    "created_at": datetime.now(UTC),
                }
                for r in old
            ],
        )
    size, pages, _ = await measured(db)
    elector = LeaderElector(QueueRepo(db), name=unique(LEADER_LEASE), holder="a", ttl_s=30.0)

    async def policy() -> RetentionPolicy:
        return KEEP_30

    await RetentionCleaner(db, elector, policy, interval_s=60.0, pause_s=0.0).tick()
    assert (await rows_of(db, old))["runs"] == 0
    after_size, after_pages, free = await measured(db)
    # 1,500 runs with ~3 KB each: about a thousand pages of 4 KiB given back.
    assert after_pages < pages - 800, (pages, after_pages)
    assert after_size < size - 800 * 4096
    assert free < 50


@pytest.mark.requires("embedded")
async def test_a_file_made_without_incremental_vacuum_is_reported_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "old.db"
    with closing(sqlite3.connect(path)) as conn:  # as an older version made it
        conn.execute("CREATE TABLE made_before (x)")
    db = DatabaseManager(Settings(database_url=f"sqlite+aiosqlite:///{path}"))
    try:
        await db.initialize()
        assert await db.reclaim_space(100) == 0
        assert await db.reclaim_space(100) == 0
    finally:
        await db.dispose()
    warned = [r for r in caplog.records if "auto_vacuum" in r.getMessage()]
    assert len(warned) == 1 and "VACUUM" in warned[0].getMessage()
