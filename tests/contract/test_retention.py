"""Retention on every backend: what is deleted, with which rows, what is kept, in batches.

Runs are written straight into the schema with the ``finished_at`` a test needs (days in the
past), with a step, two events, an interrupt and a message each, so "deleted with all their
rows" is checked table by table.
"""

import asyncio
import os
import sqlite3
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, insert, select, update
from sqlalchemy.engine import make_url

from moorline.api.app import create_app
from moorline.db.manager import DatabaseManager
from moorline.db.repos.gauges import Gauges
from moorline.db.repos.queue import QueueRepo
from moorline.db.repos.retention import RUN_TABLES, Cursor, RetentionPolicy, RetentionRepo
from moorline.db.schema import events, interrupts, messages, metadata, runs, steps
from moorline.dispatch.leader import LeaderElector
from moorline.dispatch.retention import LEADER_LEASE, RetentionCleaner
from moorline.settings import Settings
from moorline.types import RunId, RunStatus, TenantId
from tests.contract.queue_helpers import Tenants, unique
from tests.helpers import wait_for

KEEP_30 = RetentionPolicy(default_days=30.0)
LANE = "workflow"


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


def _run_row(
    tenant: TenantId,
    *,
    status: RunStatus,
    finished_days_ago: float | None,
    parent: RunId | None = None,
) -> dict[str, Any]:
    now = datetime.now(UTC)
    finished = None if finished_days_ago is None else now - timedelta(days=finished_days_ago)
    created = (finished or now) - timedelta(seconds=5)
    return {
        "id": str(uuid.uuid4()),
        "tenant_id": tenant,
        "workflow": "noop",
        "status": status.value,
        "lane": LANE,
        "priority": 0,
        "attempt": 1,
        "max_attempts": 3,
        "not_before": created,
        "input_hash": "0" * 64,
        "input": {},
        "created_at": created,
        "updated_at": finished or now,
        "finished_at": finished,
        "parent_run_id": parent,
        "child_key": None if parent is None else unique("key"),
        "depth": 0 if parent is None else 1,
    }


async def add_runs(
    db: DatabaseManager,
    tenant: TenantId,
    count: int,
    *,
    status: RunStatus = RunStatus.SUCCEEDED,
    finished_days_ago: float | None = 40.0,
    parent: RunId | None = None,
) -> list[RunId]:
    """``count`` runs, each with one step, two events, one interrupt and one message."""
    rows = [
        _run_row(tenant, status=status, finished_days_ago=finished_days_ago, parent=parent)
        for _ in range(count)
    ]
    now = datetime.now(UTC)
    ids = [RunId(row["id"]) for row in rows]
    async with db.transaction() as conn:
        await conn.execute(insert(runs), rows)
        await conn.execute(
            insert(steps),
            [
                {
                    "run_id": run_id,
                    "key": "s",
                    "status": "succeeded",
                    "attempt": 1,
                    "function": "f",
                    "call_hash": "0" * 64,
                    "output": {"x": 1},
                    "started_at": now,
                    "finished_at": now,
                    "seq": 1,
                }
                for run_id in ids
            ],
        )
        await conn.execute(
            insert(events),
            [
                {
                    "run_id": run_id,
                    "seq": seq,
                    "type": "t",
                    "attempt": 1,
                    "data": {},
                    "created_at": now,
                }
                for run_id in ids
                for seq in (1, 2)
            ],
        )
        await conn.execute(
            insert(interrupts),
            [
                {
                    "id": str(uuid.uuid4()),
                    "run_id": run_id,
                    "key": "i",
                    "action": "a",
                    "data": {},
                    "status": "approved",
                    "attempt": 1,
                    "created_at": now,
                    "expires_at": now,
                }
                for run_id in ids
            ],
        )
        await conn.execute(
            insert(messages),
            [{"run_id": run_id, "seq": 1, "content": "hi", "created_at": now} for run_id in ids],
        )
    return ids


async def rows_of(db: DatabaseManager, run_ids: Sequence[str]) -> dict[str, int]:
    """Table name → rows of ``run_ids`` left in it."""
    found = {}
    async with db.connect() as conn:
        count = select(func.count()).where(runs.c.id.in_(list(run_ids)))
        found["runs"] = (await conn.execute(count)).scalar_one()
        for table in RUN_TABLES:
            stmt = select(func.count()).where(table.c.run_id.in_(list(run_ids)))
            found[table.name] = (await conn.execute(stmt)).scalar_one()
    return found


async def clean_all(
    db: DatabaseManager, policy: RetentionPolicy = KEEP_30, limit: int = 500
) -> list[int]:
    """Batches until the end of the old runs; the runs each deleted."""
    repo, after, deleted = RetentionRepo(db), None, []
    while True:
        batch = await repo.delete_batch(policy, after=after, limit=limit)
        deleted.append(batch.runs)
        if batch.next is None:
            return deleted
        after = batch.next


def test_every_table_keyed_by_run_id_is_cleaned() -> None:
    keyed = {t.name for t in metadata.tables.values() if "run_id" in t.c}
    assert keyed == {t.name for t in RUN_TABLES}
    for table in RUN_TABLES:  # their rows go with the run by the cascade
        [key] = [fk for fk in table.foreign_keys if fk.parent.name == "run_id"]
        assert (key.column.table.name, key.column.name, key.ondelete) == ("runs", "id", "CASCADE")


async def test_old_finished_runs_go_with_all_their_rows(
    db: DatabaseManager, tenants: Tenants
) -> None:
    tenant = await tenants.new()
    old: list[RunId] = []
    for status in (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED):
        old += await add_runs(db, tenant, 3, status=status)
    old += await add_runs(db, tenant, 1, status=RunStatus.TIMED_OUT, finished_days_ago=31)
    before = await Gauges(db).deleted()
    await clean_all(db)
    assert await rows_of(db, old) == dict.fromkeys(["runs", *(t.name for t in RUN_TABLES)], 0)
    after = await Gauges(db).deleted()
    assert after.rows.get("runs", 0) - before.rows.get("runs", 0) >= 10
    assert after.rows["events"] - before.rows.get("events", 0) >= 20
    gone = after.runs[(LANE, "failed")] - before.runs.get((LANE, "failed"), 0)
    assert gone >= 3


async def test_young_and_unfinished_runs_are_untouched(
    db: DatabaseManager, tenants: Tenants
) -> None:
    tenant = await tenants.new()
    young = await add_runs(db, tenant, 3, finished_days_ago=29)
    live: list[RunId] = []
    for status in (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.WAITING, RunStatus.PENDING):
        live += await add_runs(db, tenant, 2, status=status, finished_days_ago=None)
    # Not a state the code writes, but the status decides: a live run is never deleted.
    live += await add_runs(db, tenant, 2, status=RunStatus.RUNNING, finished_days_ago=90)
    await clean_all(db)
    assert (await rows_of(db, young))["runs"] == 3
    per_run = {"runs": 1, "steps": 1, "events": 2, "interrupts": 1, "messages": 1}
    assert await rows_of(db, live) == {table: 10 * n for table, n in per_run.items()}
    assert (await rows_of(db, young))["events"] == 6


async def test_children_of_a_live_parent_stay_and_a_parent_goes_after_its_children(
    db: DatabaseManager, tenants: Tenants
) -> None:
    tenant = await tenants.new()
    [live_parent] = await add_runs(db, tenant, 1, status=RunStatus.WAITING, finished_days_ago=None)
    kept = await add_runs(db, tenant, 2, parent=live_parent)
    # An old parent whose (detached) child ended recently: the parent waits for the child.
    [old_parent] = await add_runs(db, tenant, 1, finished_days_ago=60)
    [young_child] = await add_runs(db, tenant, 1, finished_days_ago=1, parent=old_parent)
    # An old parent with old children: the children go first, then (a batch later) it.
    [done_parent] = await add_runs(db, tenant, 1, finished_days_ago=35)
    done_children = await add_runs(db, tenant, 3, finished_days_ago=50, parent=done_parent)
    await clean_all(db)
    assert (await rows_of(db, kept))["runs"] == 2
    assert (await rows_of(db, [old_parent, young_child]))["runs"] == 2
    assert (await rows_of(db, done_children))["runs"] == 0
    # Checked in the batch that deleted its children, the parent still had them; the next
    # pass finds it childless.
    await clean_all(db)
    assert (await rows_of(db, [done_parent]))["runs"] == 0
    assert (await rows_of(db, [*kept, old_parent, young_child]))["runs"] == 4


async def test_batches_examine_at_most_their_limit_and_resume_after_it(
    db: DatabaseManager, tenants: Tenants
) -> None:
    await clean_all(db)  # what earlier tests left
    tenant = await tenants.new()
    old = await add_runs(db, tenant, 25)
    await add_runs(db, tenant, 5, finished_days_ago=1)
    repo = RetentionRepo(db)
    first = await repo.delete_batch(KEEP_30, limit=10)
    assert (first.examined, first.runs) == (10, 10)
    assert isinstance(first.next, Cursor)
    assert first.deleted["steps"] == 10 and first.deleted["events"] == 20
    assert (await rows_of(db, old))["runs"] == 15
    rest = await clean_all(db, limit=10)
    assert rest == [10, 5]  # the young runs lie beyond the range the pass walks
    assert (await rows_of(db, old))["runs"] == 0


async def test_a_plans_retention_overrides_the_default(
    db: DatabaseManager, tenants: Tenants
) -> None:
    short, forever, default = (
        await tenants.new("short"),
        await tenants.new("forever"),
        await tenants.new(),
    )
    policy = RetentionPolicy(default_days=30.0, plan_days={"short": 2.0, "forever": 0.0})
    three_days = [await add_runs(db, t, 2, finished_days_ago=3) for t in (short, default)]
    ancient = await add_runs(db, forever, 2, finished_days_ago=400)
    await clean_all(db, policy)
    assert (await rows_of(db, three_days[0]))["runs"] == 0
    assert (await rows_of(db, three_days[1]))["runs"] == 2
    assert (await rows_of(db, ancient))["runs"] == 2
    assert await clean_all(db, RetentionPolicy(default_days=0.0)) == [0]


async def test_oldest_finished_age_follows_deletion(db: DatabaseManager, tenants: Tenants) -> None:
    await clean_all(db)
    tenant = await tenants.new("forever")
    await add_runs(db, tenant, 1, finished_days_ago=45)
    age = await Gauges(db).oldest_finished_age_s()
    assert age is not None and age >= 45 * 86400 - 60
    await clean_all(db, RetentionPolicy(default_days=30.0, plan_days={"forever": 40.0}))
    after = await Gauges(db).oldest_finished_age_s()
    assert after is None or after < 40 * 86400


async def test_the_cleaner_acts_only_while_it_leads(db: DatabaseManager, tenants: Tenants) -> None:
    tenant = await tenants.new()
    old = await add_runs(db, tenant, 12)
    lease = unique(LEADER_LEASE)

    async def policy() -> RetentionPolicy:
        return KEEP_30

    def cleaner(holder: str) -> RetentionCleaner:
        elector = LeaderElector(QueueRepo(db), name=lease, holder=holder, ttl_s=30.0)
        return RetentionCleaner(db, elector, policy, interval_s=60.0, batch=5, pause_s=0.001)

    leader, follower = cleaner("a"), cleaner("b")
    assert await leader.elector.tick()
    assert await follower.tick() == {}
    assert (await rows_of(db, old))["runs"] == 12
    deleted = await leader.tick()
    assert deleted["runs"] >= 12 and deleted["messages"] >= 12
    assert (await rows_of(db, old))["runs"] == 0


async def test_the_loop_stops_between_batches(db: DatabaseManager, tenants: Tenants) -> None:
    await clean_all(db)
    tenant = await tenants.new()
    old = await add_runs(db, tenant, 20)

    async def policy() -> RetentionPolicy:
        return KEEP_30

    elector = LeaderElector(QueueRepo(db), name=unique(LEADER_LEASE), holder="a", ttl_s=30.0)
    cleaner = RetentionCleaner(db, elector, policy, interval_s=60.0, batch=5, pause_s=30.0)
    stop = asyncio.Event()
    task = asyncio.create_task(cleaner.run(stop))

    async def first_batch_done() -> bool:
        return (await rows_of(db, old))["runs"] == 15

    await wait_for(first_batch_done, message="the first batch")
    stop.set()
    await asyncio.wait_for(task, 5.0)  # the 30 s pause was cut short
    assert (await rows_of(db, old))["runs"] == 15


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


async def test_metrics_serve_what_was_deleted(
    db: DatabaseManager, settings: Settings, tenants: Tenants
) -> None:
    tenant = await tenants.new()
    app = create_app(settings, db)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:

        async def scrape() -> dict[tuple[str, str], float]:
            response = await client.get("/metrics")
            assert response.status_code == 200
            return {
                (sample.name, sample.labels.get("table", sample.labels.get("status", ""))): (
                    sample.value
                )
                for family in text_string_to_metric_families(response.text)
                for sample in family.samples
                if sample.labels.get("lane", LANE) == LANE
            }

        await add_runs(db, tenant, 4, status=RunStatus.FAILED)
        before = await scrape()
        assert before[("moorline_oldest_finished_run_age_seconds", "")] >= 40 * 86400 - 60
        await clean_all(db)
        after = await scrape()
    runs_total = ("moorline_runs_total", "failed")
    assert after[runs_total] == before[runs_total]  # deleted, still counted
    deleted = ("moorline_retention_deleted_total", "runs")
    assert after[deleted] - before.get(deleted, 0) >= 4
    assert after[("moorline_oldest_finished_run_age_seconds", "")] < 30 * 86400


async def test_cleaners_that_all_lead_delete_and_count_each_run_once(
    db: DatabaseManager, tenants: Tenants
) -> None:
    await clean_all(db)
    tenant = await tenants.new()
    old = await add_runs(db, tenant, 300)
    before = await Gauges(db).deleted()

    async def policy() -> RetentionPolicy:
        return KEEP_30

    # Each holds a leader lease of its own name: the worst case of "two processes both
    # believe they lead".
    cleaners = [
        RetentionCleaner(
            db,
            LeaderElector(QueueRepo(db), name=unique(LEADER_LEASE), holder=str(n), ttl_s=30.0),
            policy,
            interval_s=60.0,
            batch=40,
            pause_s=0.0,
        )
        for n in range(3)
    ]
    passes = await asyncio.gather(*(cleaner.tick() for cleaner in cleaners))
    assert sum(deleted["runs"] for deleted in passes) == 300
    assert sum(deleted["events"] for deleted in passes) == 600
    after = await Gauges(db).deleted()
    assert after.rows["runs"] - before.rows.get("runs", 0) == 300
    assert after.rows["events"] - before.rows.get("events", 0) == 600
    assert (await rows_of(db, old))["runs"] == 0


async def test_a_failed_batch_leaves_every_run_whole(
    db: DatabaseManager, tenants: Tenants, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant = await tenants.new()
    old = await add_runs(db, tenant, 5)

    def fail(*_args: object, **_kwargs: object) -> None:
        raise ConnectionResetError("the connection dropped before the commit")

    # The failure comes after the DELETE, inside the transaction, before the tallies.
    monkeypatch.setattr(type(db.backend), "add_to_counters", fail)
    with pytest.raises(ConnectionResetError):
        await clean_all(db)
    per_run = {"runs": 1, "steps": 1, "events": 2, "interrupts": 1, "messages": 1}
    assert await rows_of(db, old) == {table: 5 * n for table, n in per_run.items()}


async def test_a_run_that_changes_after_the_read_is_left_alone(
    db: DatabaseManager, tenants: Tenants, monkeypatch: pytest.MonkeyPatch
) -> None:
    await clean_all(db)
    tenant = await tenants.new()
    retried, *others = await add_runs(db, tenant, 4)
    read_chunk = RetentionRepo._read_chunk

    async def read_then_retry(self: RetentionRepo, *args: Any) -> Sequence[Any]:
        chunk = await read_chunk(self, *args)
        # What a retry of the failed run would do between the read and the delete.
        async with db.transaction() as conn:
            await conn.execute(
                update(runs)
                .where(runs.c.id == retried)
                .values(status=RunStatus.QUEUED.value, finished_at=None)
            )
        return chunk

    monkeypatch.setattr(RetentionRepo, "_read_chunk", read_then_retry)
    await clean_all(db)
    assert (await rows_of(db, others))["runs"] == 0
    assert await rows_of(db, [retried]) == {
        "runs": 1,
        "steps": 1,
        "events": 2,
        "interrupts": 1,
        "messages": 1,
    }


async def test_the_batch_shrinks_only_under_one_write_lock(db: DatabaseManager) -> None:
    async def policy() -> RetentionPolicy:
        return KEEP_30

    elector = LeaderElector(QueueRepo(db), name=unique(LEADER_LEASE), holder="a", ttl_s=30.0)
    cleaner = RetentionCleaner(db, elector, policy, interval_s=60.0, batch=500)
    slow, quick = cleaner._next_limit(500, 0.2), cleaner._next_limit(100, 0.001)
    if db.backend.capabilities.row_locks:
        assert (slow, quick) == (500, 100)  # nothing waits for a deletion
    else:
        assert (slow, quick) == (250, 200)
        assert cleaner._next_limit(500, 0.001) == 500
        assert cleaner._next_limit(25, 1.0) == 20
