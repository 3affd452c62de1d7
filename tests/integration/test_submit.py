"""``app.submit`` / ``submit_many`` / ``workflow.submit`` admit as the HTTP trigger does.

On every backend, over an app that opens its own connections on first use (as a program that
only enqueues would); the tenants are written through the repository, as the admin route does.
"""

import asyncio
import socket
import threading
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, insert, make_url, select, text
from sqlalchemy.ext.asyncio import create_async_engine

from moorline.db.manager import DatabaseManager
from moorline.db.repos.runs import RunsRepo
from moorline.db.repos.tenants import TenantsRepo
from moorline.db.schema import quota_usage, runs
from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.engine.submitting import Submission, Submitted
from moorline.errors import (
    BackendUnavailable,
    ConversationBusy,
    IdempotencyConflict,
    InvalidInput,
    InvalidRequest,
    QuotaExceeded,
    RateLimited,
    TenantNotFound,
    WorkflowNotFound,
)
from moorline.settings import Settings
from moorline.types import JSONObject, RunId, RunStatus
from tests.helpers import wait_for
from tests.servers import PG_ADMIN_URL, REDIS_TEST_URL


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


PLANS_YAML = """
plans:
  roomy:
    lane: workflow_roomy
    priority: 5
    daily_quota: 100000
    rate_limit: "1000000/second"
    tenant_concurrency: 4
    lane_slots: 4
  tight:
    lane: workflow_tight
    priority: 5
    daily_quota: 2
    rate_limit: "1000000/second"
    tenant_concurrency: 1
    lane_slots: 1
  bounded:
    lane: workflow_bounded
    priority: 5
    daily_quota: 300
    rate_limit: "1000000/second"
    tenant_concurrency: 1
    lane_slots: 1
  slow:
    lane: workflow_slow
    priority: 5
    daily_quota: 1000
    rate_limit: "2/minute"
    tenant_concurrency: 1
    lane_slots: 1
"""


def build_app(settings: Settings) -> Moorline:
    app = Moorline(settings)

    @app.workflow("add")
    async def add(ctx: Context, a: int, b: int) -> JSONObject:
        return {"sum": a + b}

    return app


@pytest.fixture
def plans_file(tmp_path: Path) -> Path:
    path = tmp_path / "plans.yaml"
    path.write_text(PLANS_YAML, encoding="utf-8")
    return path


@pytest.fixture
async def app(db: DatabaseManager, database_url: str, plans_file: Path) -> AsyncIterator[Moorline]:
    built = build_app(Settings(database_url=database_url, plans_file=plans_file))
    async with built:
        yield built


async def new_tenant(db: DatabaseManager, plan: str = "roomy") -> str:
    tenant, _key = await TenantsRepo(db).create(f"submit-{uuid.uuid4().hex[:12]}", plan)
    return tenant.tenant_id


async def count_runs(db: DatabaseManager, tenant: str, status: RunStatus | None = None) -> int:
    stmt = select(func.count()).where(runs.c.tenant_id == tenant)
    if status is not None:
        stmt = stmt.where(runs.c.status == status.value)
    async with db.connect() as conn:
        count: int = (await conn.execute(stmt)).scalar_one()
    return count


async def test_a_submitted_run_is_stored_queued_in_its_plans_lane(
    app: Moorline, db: DatabaseManager
) -> None:
    tenant = await new_tenant(db)
    result = await app.submit("add", {"a": 1, "b": 2}, tenant=tenant, delay=5)
    assert result.created and result.status is RunStatus.QUEUED
    assert result.queue == "workflow_roomy"
    stored = await RunsRepo(db).get(result.run_id)
    assert stored is not None
    assert (stored.tenant_id, stored.workflow, stored.input) == (tenant, "add", {"a": 1, "b": 2})
    assert stored.not_before > stored.created_at  # the delay was applied


async def test_a_repeated_idempotency_key_returns_the_same_run(
    app: Moorline, db: DatabaseManager
) -> None:
    tenant = await new_tenant(db)
    first = await app.submit("add", {"a": 1, "b": 2}, tenant=tenant, idempotency_key="k-1")
    again = await app.submit("add", {"a": 1, "b": 2}, tenant=tenant, idempotency_key="k-1")
    assert again.run_id == first.run_id
    assert (first.created, again.created) == (True, False)
    with pytest.raises(IdempotencyConflict):
        await app.submit("add", {"a": 9, "b": 2}, tenant=tenant, idempotency_key="k-1")
    assert await count_runs(db, tenant) == 1


async def test_refusals_are_the_http_routes_errors_and_store_nothing(
    app: Moorline, db: DatabaseManager
) -> None:
    tenant = await new_tenant(db)
    with pytest.raises(WorkflowNotFound):
        await app.submit("nope", {}, tenant=tenant)
    with pytest.raises(InvalidInput, match="a"):
        await app.submit("add", {"a": "x", "b": 2}, tenant=tenant)
    with pytest.raises(InvalidInput, match="mapping"):
        await app.submit("add", [1, 2], tenant=tenant)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="conversation_id"):
        await app.submit("add", {"a": 1, "b": 2}, tenant=tenant, conversation_id="a:b")
    with pytest.raises(InvalidRequest, match="delay"):
        await app.submit("add", {"a": 1, "b": 2}, tenant=tenant, delay=-1)
    with pytest.raises(TenantNotFound):
        await app.submit("add", {"a": 1, "b": 2}, tenant=str(uuid.uuid4()))
    assert await count_runs(db, tenant) == 0


async def test_over_the_quota_the_run_is_stored_rate_limited(
    app: Moorline, db: DatabaseManager
) -> None:
    tenant = await new_tenant(db, "tight")
    for n in range(2):
        await app.submit("add", {"a": n, "b": 0}, tenant=tenant)
    with pytest.raises(QuotaExceeded) as refused:
        await app.submit("add", {"a": 2, "b": 0}, tenant=tenant)
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s > 0
    stored = await RunsRepo(db).get(RunId(refused.value.run_id))
    assert stored is not None and stored.status is RunStatus.RATE_LIMITED
    assert await count_runs(db, tenant, RunStatus.QUEUED) == 2


async def test_over_the_rate_limit_nothing_is_stored(app: Moorline, db: DatabaseManager) -> None:
    tenant = await new_tenant(db, "slow")
    for n in range(2):
        await app.submit("add", {"a": n, "b": 0}, tenant=tenant)
    with pytest.raises(RateLimited):
        await app.submit("add", {"a": 2, "b": 0}, tenant=tenant)
    assert await count_runs(db, tenant) == 2


async def test_a_busy_conversation_refuses_a_second_run(app: Moorline, db: DatabaseManager) -> None:
    tenant = await new_tenant(db)
    first = await app.submit("add", {"a": 1, "b": 1}, tenant=tenant, conversation_id="chat-1")
    with pytest.raises(ConversationBusy) as busy:
        await app.submit("add", {"a": 2, "b": 2}, tenant=tenant, conversation_id="chat-1")
    assert busy.value.details["run_id"] == first.run_id


async def test_submit_many_answers_each_item_in_order(app: Moorline, db: DatabaseManager) -> None:
    tenant = await new_tenant(db)
    items = [
        Submission(workflow="add", input={"a": 1, "b": 1}, idempotency_key="same"),
        Submission(workflow="add", input={"a": "x", "b": 1}),
        Submission(workflow="add", input={"a": 1, "b": 1}, idempotency_key="same"),
        Submission(workflow="add", input={"a": 3, "b": 3}, conversation_id="c-1"),
        Submission(workflow="add", input={"a": 4, "b": 4}, conversation_id="c-1"),
        Submission(workflow="nope", input={}),
        *(Submission(workflow="add", input={"a": n, "b": n}) for n in range(50)),
    ]
    results = await app.submit_many(items, tenant=tenant)
    assert len(results) == len(items)
    first, bad, repeat, talk, busy, unknown, *rest = results
    assert isinstance(first, Submitted) and first.created
    assert isinstance(bad, InvalidInput)
    assert isinstance(repeat, Submitted) and repeat.run_id == first.run_id and not repeat.created
    assert isinstance(talk, Submitted)
    assert isinstance(busy, ConversationBusy) and busy.details["run_id"] == talk.run_id
    assert isinstance(unknown, WorkflowNotFound)
    assert all(isinstance(r, Submitted) and r.created for r in rest)
    assert await count_runs(db, tenant, RunStatus.QUEUED) == 52


async def test_a_submission_larger_than_a_batch_takes_the_units_in_its_order(
    app: Moorline, db: DatabaseManager
) -> None:
    # 700 runs are decided and written in parts of the Submitter's batch (256): the quota's
    # 300 units still go to the first 300 items, and every answer is at its item's index.
    tenant = await new_tenant(db, "bounded")
    items = [Submission(workflow="add", input={"a": n, "b": 0}) for n in range(700)]
    results = await app.submit_many(items, tenant=tenant)
    assert all(isinstance(r, Submitted) and r.created for r in results[:300])
    assert all(isinstance(r, QuotaExceeded) for r in results[300:])
    stored = await RunsRepo(db).get_many(
        [r.run_id for r in results[:300] if isinstance(r, Submitted)]
    )
    assert [stored[r.run_id].input for r in results[:300] if isinstance(r, Submitted)] == [
        {"a": n, "b": 0} for n in range(300)
    ]
    assert await count_runs(db, tenant, RunStatus.QUEUED) == 300
    assert await count_runs(db, tenant, RunStatus.RATE_LIMITED) == 400


async def test_an_outage_mid_bulk_leaves_every_unit_with_its_run(
    db: DatabaseManager,
    database_url: str,
    plans_file: Path,
    backend: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The fault: while one submit_many of 3,000 (half with an idempotency key) is written, a
    # batch at a time, the database stops accepting connections and every connection to it is
    # terminated, until the batch under way has failed through its retries. Each item must end
    # as a committed run that took its unit, or BackendUnavailable with neither; a client's
    # retry of the failed items then stores each of them once.
    if backend != "postgresql":
        pytest.skip("one server whose backends can be terminated is enough")
    tenant = await new_tenant(db, "roomy")
    settings = Settings(database_url=database_url, plans_file=plans_file, db_retry_base=0.005)
    items = [
        Submission(
            workflow="add", input={"a": n, "b": 0}, idempotency_key=f"k{n}" if n % 2 else None
        )
        for n in range(3000)
    ]
    stored_runs = select(func.count()).where(runs.c.tenant_id == tenant)
    # The outage comes at a known point however loaded the machine: a transaction left open
    # holds the last item's key, so the batch that holds that item waits on its row lock
    # after the batches before it committed. The termination ends both, rolling this one back.
    holder = create_async_engine(database_url)
    admin = create_async_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = make_url(database_url).database
    try:
        async with holder.connect() as holding, admin.connect() as control:
            await holding.begin()
            await holding.execute(insert(runs).values(key_holding_row(tenant, "k2999")))
            holder_pid = (await holding.execute(text("SELECT pg_backend_pid()"))).scalar_one()
            async with build_app(settings) as app:
                await app.submit("add", {"a": -1, "b": 0}, tenant=tenant)  # connections open
                submitting = asyncio.create_task(app.submit_many(items, tenant=tenant))

                async def a_batch_waits_on_the_key() -> bool:
                    waiting = await control.execute(
                        text(
                            "SELECT count(*) FROM pg_stat_activity WHERE datname = :name "
                            "AND wait_event_type = 'Lock'"
                        ),
                        {"name": name},
                    )
                    return bool(waiting.scalar_one())

                await wait_for(a_batch_waits_on_the_key, message="a batch waiting on the key")
                # From another database: PostgreSQL cannot close the one it is connected to.
                await control.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
                try:
                    # The app's backends go first, each waited for until it is gone (the
                    # timeout), then the holder's: ended first, the holder gave the key back
                    # while the waiting batch's own termination was still on its way, and that
                    # batch once committed in between, on a loaded machine.
                    terminate = text(
                        "SELECT count(pg_terminate_backend(pid, 5000)) FROM pg_stat_activity "
                        "WHERE datname = :name AND pid <> :holder"
                    )
                    killed = (
                        await control.execute(terminate, {"name": name, "holder": holder_pid})
                    ).scalar_one()
                    await control.execute(
                        text("SELECT pg_terminate_backend(:holder)"), {"holder": holder_pid}
                    )
                    await holding.invalidate()  # terminated: nothing left to roll back
                    # The outage lasts until the submission has answered: the waiting batch is
                    # its last, so it has then failed through its retries. (A fixed 0.3 s once
                    # ended before the retries did, on a loaded machine.)
                    results = await asyncio.wait_for(submitting, timeout=60)
                finally:
                    await control.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
                assert killed > 0
                failed = [n for n, got in enumerate(results) if not isinstance(got, Submitted)]
                assert failed, "every item was stored: the outage came after the last batch"
                # The batch that waited failed whole, not run by run through the outage; the
                # batches before it were stored.
                assert failed == list(range(failed[0], len(items))), failed
                assert 1 < len(failed) < len(items)
                assert all(isinstance(results[n], BackendUnavailable) for n in failed), [
                    results[n] for n in failed[:1]
                ]
                # Through the outage the batch was retried as one (three retries), not run by
                # run (three each: hundreds against a database that is down).
                retries = [r for r in caplog.records if "transient database error" in r.message]
                assert len(retries) < 20, len(retries)
                stored = [result for result in results if isinstance(result, Submitted)]
                assert all(result.created for result in stored)
                # Nothing doubled, nothing half-written: the runs are those answered, each
                # with a unit.
                found = await RunsRepo(db).get_many([RunId(result.run_id) for result in stored])
                assert len(found) == len(stored)
                async with db.connect() as conn:
                    assert (await conn.execute(stored_runs)).scalar_one() == len(stored) + 1
                assert await count_runs(db, tenant, RunStatus.QUEUED) == len(stored) + 1
                assert await units_taken(db, tenant) == len(stored) + 1
                # The client retries what failed: every item is then stored once.
                retried = await app.submit_many([items[n] for n in failed], tenant=tenant)
    finally:
        await holder.dispose()
        await admin.dispose()
    assert all(isinstance(result, Submitted) and result.created for result in retried)
    assert await count_runs(db, tenant, RunStatus.QUEUED) == 3001
    assert await units_taken(db, tenant) == 3001


def key_holding_row(tenant: str, key: str) -> dict[str, Any]:
    """A ``runs`` row that takes ``key`` of ``tenant``, to insert in a transaction left open."""
    now = datetime.now(UTC)
    return {
        "id": str(uuid.uuid4()),
        "tenant_id": tenant,
        "workflow": "add",
        "status": RunStatus.QUEUED.value,
        "lane": "workflow_roomy",
        "not_before": now,
        "idempotency_key": key,
        "input_hash": "0" * 64,
        "input": {},
        "created_at": now,
        "updated_at": now,
    }


async def units_taken(db: DatabaseManager, tenant: str) -> int:
    """The tenant's quota units taken today (counters in the database)."""
    async with db.connect() as conn:
        used = (
            await conn.execute(
                select(func.sum(quota_usage.c.used)).where(quota_usage.c.tenant_id == tenant)
            )
        ).scalar_one()
    return int(used or 0)


async def test_a_registered_workflow_submits_itself(app: Moorline, db: DatabaseManager) -> None:
    tenant = await new_tenant(db)
    add: Any = app.get("add").fn
    result = await add.submit({"a": 2, "b": 3}, tenant=tenant)
    stored = await RunsRepo(db).get(result.run_id)
    assert stored is not None and stored.workflow == "add"


async def test_sync_code_submits_through_the_apps_own_loop(
    db: DatabaseManager, database_url: str, plans_file: Path
) -> None:
    tenant = await new_tenant(db)
    app = build_app(Settings(database_url=database_url, plans_file=plans_file))
    results: list[Submitted] = []

    def sync_caller() -> None:  # a thread without an event loop, as a Django view
        try:
            results.append(app.submit_sync("add", {"a": 1, "b": 2}, tenant=tenant))
            many = app.submit_many_sync(
                [Submission(workflow="add", input={"a": 5, "b": 5})] * 3, tenant=tenant
            )
            results.extend(r for r in many if isinstance(r, Submitted))
        finally:
            app.close_sync()

    thread = threading.Thread(target=sync_caller)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert len(results) == 4 and len({r.run_id for r in results}) == 4
    assert await count_runs(db, tenant, RunStatus.QUEUED) == 4


async def test_with_redis_counters_the_quota_is_taken_by_the_gate(
    db: DatabaseManager, database_url: str, plans_file: Path, backend: str, redis_prefix: str
) -> None:
    if backend != "sqlite":
        pytest.skip("the gate is the same on every backend; its SQL is the Submitter's")
    prefix = redis_prefix
    settings = Settings(
        database_url=database_url,
        plans_file=plans_file,
        redis_url=REDIS_TEST_URL,
        redis_prefix=prefix,
    )
    tenant = await new_tenant(db, "tight")
    app = build_app(settings)
    async with app:
        results = await app.submit_many(
            [Submission(workflow="add", input={"a": n, "b": 0}) for n in range(3)], tenant=tenant
        )
    assert sum(isinstance(r, Submitted) for r in results) == 2
    assert sum(isinstance(r, QuotaExceeded) for r in results) == 1
    assert await count_runs(db, tenant, RunStatus.RATE_LIMITED) == 1


async def test_an_unreachable_database_is_backend_unavailable_and_the_app_recovers(
    db: DatabaseManager, database_url: str, plans_file: Path, backend: str, tmp_path: Path
) -> None:
    if backend != "postgresql":
        pytest.skip("one server refusing connections is enough: the error is translated alike")
    # A port nobody listens on: every connection is refused, as when the server is down.
    down = database_url.replace(":5432/", f":{free_port()}/")
    app = build_app(Settings(database_url=down, plans_file=plans_file, db_retry_base=0.01))
    for _ in range(2):  # each try fails alike, and leaves nothing open behind it
        with pytest.raises(BackendUnavailable):
            await app.submit("add", {"a": 1, "b": 2}, tenant=str(uuid.uuid4()))
    await app.close()
    # The same app object works once the database answers.
    app._settings = Settings(database_url=database_url, plans_file=plans_file)
    tenant = await new_tenant(db)
    async with app:
        assert (await app.submit("add", {"a": 1, "b": 2}, tenant=tenant)).created


@pytest.mark.parametrize("turns", [1, 2, 4, 6])
async def test_a_caller_that_goes_away_leaves_no_unit_without_its_run(
    app: Moorline, db: DatabaseManager, turns: int
) -> None:
    await app.submit("add", {"a": 0, "b": 0}, tenant=await new_tenant(db))  # connections open
    tenant = await new_tenant(db, "tight")  # daily quota 2
    with pytest.raises(InvalidInput):  # the tenant is read and kept; no unit is taken
        await app.submit("add", {"a": "x", "b": 0}, tenant=tenant)
    items = [Submission(workflow="add", input={"a": n, "b": 0}) for n in range(2)]
    task = asyncio.create_task(app.submit_many(items, tenant=tenant))
    for _ in range(turns):  # the caller goes away at some point of the decisions
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await app.close()  # lets the decisions that took a unit finish
    queued = await count_runs(db, tenant, RunStatus.QUEUED)
    # Every unit taken has its run, and no run is without its unit: the quota has room for
    # exactly the runs not stored, and then no more.
    more = await app.submit_many(
        [Submission(workflow="add", input={"a": n, "b": 9}) for n in range(3)], tenant=tenant
    )
    assert sum(isinstance(r, Submitted) for r in more) == 2 - queued
    assert sum(isinstance(r, QuotaExceeded) for r in more) == 1 + queued
    assert await count_runs(db, tenant, RunStatus.QUEUED) == 2


async def test_with_redis_down_the_quota_fails_closed_and_nothing_is_stored(
    db: DatabaseManager, database_url: str, plans_file: Path, backend: str
) -> None:
    if backend != "sqlite":
        pytest.skip("the counters are Redis's; the database is not the subject")
    down = f"redis://127.0.0.1:{free_port()}/0"  # refuses every connection, as a dead Redis
    tenant = await new_tenant(db)
    app = build_app(Settings(database_url=database_url, plans_file=plans_file, redis_url=down))
    async with app:
        with pytest.raises(BackendUnavailable):
            await app.submit("add", {"a": 1, "b": 2}, tenant=tenant)
        results = await app.submit_many(
            [Submission(workflow="add", input={"a": 1, "b": 2})] * 2, tenant=tenant
        )
    assert all(isinstance(r, BackendUnavailable) for r in results)
    assert await count_runs(db, tenant) == 0
