"""Retention on every backend: what is deleted, with which rows, what is kept, in batches.

Runs are written straight into the schema with the ``finished_at`` a test needs (days in the
past), with a step, two events, an interrupt and a message each, so "deleted with all their
rows" is checked table by table.
"""

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import insert, update

from moorline.api.app import create_app
from moorline.db.manager import DatabaseManager
from moorline.db.repos.gauges import Gauges
from moorline.db.repos.queue import QueueRepo
from moorline.db.repos.retention import RUN_TABLES, Cursor, RetentionPolicy, RetentionRepo
from moorline.db.schema import bulk_job_runs, bulk_jobs, metadata, runs, schedules
from moorline.dispatch import retention
from moorline.dispatch.leader import LeaderElector
from moorline.dispatch.retention import LEADER_LEASE, RetentionCleaner
from moorline.settings import Settings
from moorline.types import RunId, RunStatus
from tests.contract.queue_helpers import Tenants, unique
from tests.contract.retention_helpers import KEEP_30, LANE, add_runs, clean_all, rows_of
from tests.helpers import wait_for


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


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
    per_run = {
        "runs": 1,
        "steps": 1,
        "events": 2,
        "interrupts": 1,
        "messages": 1,
        "bulk_job_runs": 0,
    }
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


async def test_runs_a_bulk_job_or_a_schedule_still_refers_to_stay(
    db: DatabaseManager, tenants: Tenants
) -> None:
    tenant = await tenants.new()
    awaited, acted_on, last_fired, plain = await add_runs(db, tenant, 4)
    now = datetime.now(UTC)
    async with db.transaction() as conn:
        job = {"scope": tenant, "action": "retry", "filters": {}, "state": "running", "total": 2}
        await conn.execute(
            insert(bulk_jobs).values(id="job-1", **job, created_at=now, updated_at=now)
        )
        await conn.execute(
            insert(bulk_job_runs),
            [
                {"job_id": "job-1", "run_id": awaited, "outcome": None},
                {"job_id": "job-1", "run_id": acted_on, "outcome": "done"},
            ],
        )
        await conn.execute(
            insert(schedules).values(
                id="schedule-1",
                tenant_id=tenant,
                workflow="w",
                input={},
                every_s=60,
                timezone="UTC",
                catch_up="skip",
                next_at=now,
                last_run_id=last_fired,
                created_at=now,
                updated_at=now,
            )
        )
    await clean_all(db)
    kept = [awaited, last_fired]
    assert (await rows_of(db, kept))["runs"] == 2
    gone = [acted_on, plain]
    assert (await rows_of(db, gone))["runs"] == 0


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
    per_run = {
        "runs": 1,
        "steps": 1,
        "events": 2,
        "interrupts": 1,
        "messages": 1,
        "bulk_job_runs": 0,
    }
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
        "bulk_job_runs": 0,
    }


async def test_the_batch_shrinks_while_deletions_take_long(db: DatabaseManager) -> None:
    async def policy() -> RetentionPolicy:
        return KEEP_30

    elector = LeaderElector(QueueRepo(db), name=unique(LEADER_LEASE), holder="a", ttl_s=30.0)
    cleaner = RetentionCleaner(db, elector, policy, interval_s=60.0, batch=500)
    # Too long: cut in proportion to MAX_HOLD_S (5 ms), and at least halved.
    slow, a_little_slow = cleaner._next_limit(500, 0.05), cleaner._next_limit(500, 0.006)
    assert (slow, a_little_slow) == (50, 250)
    assert cleaner._next_limit(100, 0.001) == 200
    assert cleaner._next_limit(500, 0.001) == 500
    assert cleaner._next_limit(25, 1.0) == 20
    assert cleaner._next_limit(300, 0.0) == 300  # nothing deleted: nothing learnt
    # Alone with the database, a transaction may last up to ALONE_MAX_HOLD_S (100 ms).
    assert cleaner._next_limit(500, 0.05, alone=True) == 500
    assert cleaner._next_limit(100, 0.02, alone=True) == 200
    assert cleaner._next_limit(500, 0.2, alone=True) == 250


async def test_the_data_version_moves_with_other_connections_commits(
    db: DatabaseManager, tenants: Tenants, backend: str
) -> None:
    first = await db.data_version()
    if backend != "sqlite":
        assert first is None  # the servers cannot tell: the cleaner keeps its short batches
        return
    assert first is not None
    assert await db.data_version() == first  # nothing written meanwhile
    await tenants.new()
    assert await db.data_version() != first


async def batch_sizes_of_a_pass(
    db: DatabaseManager, monkeypatch: pytest.MonkeyPatch, *, others_write: bool, tenants: Tenants
) -> list[int]:
    """Sizes asked of each batch of one pass over 200 old runs, in batches of 40 at most.

    Every transaction counts as too long for a busy database (MAX_HOLD_S near zero) and none
    as too long for one the cleaner has alone, so only "alone" decides the sizes.
    """
    monkeypatch.setattr(retention, "MAX_HOLD_S", 1e-9)
    monkeypatch.setattr(retention, "ALONE_MAX_HOLD_S", 600.0)
    await clean_all(db)
    tenant = await tenants.new()
    await add_runs(db, tenant, 200)
    [young] = await add_runs(db, tenant, 1, finished_days_ago=1)
    sizes: list[int] = []
    repo_batch = RetentionRepo.delete_batch

    async def recorded(self: RetentionRepo, policy: RetentionPolicy, **kwargs: Any) -> Any:
        sizes.append(kwargs["limit"])
        return await repo_batch(self, policy, **kwargs)

    monkeypatch.setattr(RetentionRepo, "delete_batch", recorded)

    async def policy() -> RetentionPolicy:
        return KEEP_30

    elector = LeaderElector(QueueRepo(db), name=unique(LEADER_LEASE), holder="a", ttl_s=30.0)
    cleaner = RetentionCleaner(db, elector, policy, interval_s=60.0, batch=40, pause_s=0.05)
    stop_writing = asyncio.Event()

    async def write_meanwhile() -> None:
        for priority in itertools.count():
            if stop_writing.is_set():
                return
            async with db.write_transaction() as conn:
                await conn.execute(update(runs).where(runs.c.id == young).values(priority=priority))
            await asyncio.sleep(0.002)

    writer = asyncio.create_task(write_meanwhile()) if others_write else None
    try:
        await cleaner.tick()
    finally:
        stop_writing.set()
        if writer is not None:
            await writer
    return sizes


async def test_batches_stay_large_while_the_database_is_the_cleaners_alone(
    db: DatabaseManager, tenants: Tenants, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes = await batch_sizes_of_a_pass(db, monkeypatch, others_write=False, tenants=tenants)
    if backend == "sqlite":
        assert sizes[:5] == [40] * 5, sizes  # nothing else wrote: no cut
    else:
        assert sizes[1:4] == [20] * 3, sizes  # cannot tell: every batch is cut to MIN_BATCH


async def test_batches_are_cut_while_another_connection_writes(
    db: DatabaseManager, tenants: Tenants, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes = await batch_sizes_of_a_pass(db, monkeypatch, others_write=True, tenants=tenants)
    assert sizes[1:4] == [20] * 3, sizes
