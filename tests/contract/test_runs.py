"""The runs repository on every backend: insert, enqueue, finish under fences, events.

Runs are written through :class:`RunsRepo` and claimed through :class:`QueueRepo`, so these
tests also pin the hand-over between the two: what ``submit_many`` stores is what
``claim_batch`` takes, and the events of both sides form one ``seq`` series per run.
"""

import hashlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import func, select

from moorline.db.manager import DatabaseManager
from moorline.db.repos.events import EventsRepo, _appended_from_rows, append_events_txn
from moorline.db.repos.handoffs import HandoffsRepo
from moorline.db.repos.queue import Claim, ClaimRequest, QueueRepo
from moorline.db.repos.records import Event
from moorline.db.repos.runs import (
    Failed,
    NewRun,
    Outcome,
    RunsRepo,
    Stopped,
    Succeeded,
    hash_input,
)
from moorline.db.schema import events, runs
from moorline.errors import Conflict, IdempotencyConflict, InvalidInput, NotFound
from moorline.types import Attempt, JSONObject, RunId, RunStatus, TenantId
from tests.contract.queue_helpers import NO_CAP, Tenants, set_lease_expiry, unique
from tests.contract.statements import data_statements
from tests.helpers import wait_for

TTL_S = 30.0


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


def new_run(tenant: TenantId, lane: str, **changes: Any) -> NewRun:
    base = NewRun(tenant_id=tenant, workflow="noop", input={"n": 1}, lane=lane)
    return replace(base, **changes)


async def claim(queue: QueueRepo, lane: str, owner: str = "worker", limit: int = 10) -> list[Claim]:
    return await queue.claim_batch(lane, owner, limit=limit, lease_ttl_s=TTL_S, tenant_caps=NO_CAP)


async def database_now(db: DatabaseManager) -> datetime:
    async with db.connect() as conn:
        now: datetime = (await conn.execute(select(db.backend.now()))).scalar_one()
    return now


async def event_rows(db: DatabaseManager, run_id: str) -> list[tuple[int, str, int]]:
    return [(e.seq, e.type, e.attempt) for e in await EventsRepo(db).list(RunId(run_id))]


async def tenant_run_count(db: DatabaseManager, tenant: TenantId) -> int:
    async with db.connect() as conn:
        count: int = (
            await conn.execute(select(func.count()).where(runs.c.tenant_id == tenant))
        ).scalar_one()
    return count


async def event_count(db: DatabaseManager, run_ids: list[RunId]) -> int:
    async with db.connect() as conn:
        count: int = (
            await conn.execute(select(func.count()).where(events.c.run_id.in_(run_ids)))
        ).scalar_one()
    return count


# --- insert and enqueue ---------------------------------------------------------------------


async def test_submitted_runs_are_claimed_in_priority_order(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo, queue = RunsRepo(db), QueueRepo(db)
    tenant = await tenants.new()
    lane = unique("lane")
    before = await database_now(db)
    stored = await repo.submit_many(
        [new_run(tenant, lane, priority=p, input={"p": p}) for p in (10, 100, 50)]
    )
    after = await database_now(db)
    assert [run.priority for run in stored] == [10, 100, 50]
    for run in stored:
        assert (run.status, run.attempt, run.lane, run.tenant_id) == (
            RunStatus.QUEUED,
            0,
            lane,
            tenant,
        )
        assert run.lease_owner is None and run.started_at is None and run.finished_at is None
        assert before <= run.created_at <= after and run.not_before == run.created_at
        assert run.input == {"p": run.priority}
        assert run.input_hash == hash_input(run.input)
        assert await event_rows(db, run.run_id) == [(1, "queued", 0)]
    assert await repo.get_many([run.run_id for run in stored]) == {r.run_id: r for r in stored}
    claimed = await claim(queue, lane)
    assert [c.run.priority for c in claimed] == [100, 50, 10]


async def test_a_delay_counts_from_the_time_a_run_was_stored(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = RunsRepo(db)
    tenant = await tenants.new()
    lane = unique("lane")
    delay = timedelta(seconds=1.2345678)  # what timedelta keeps: whole microseconds
    # A batch, one run alone (PostgreSQL writes both with one statement), and a batch that
    # checks a conversation first (a transaction everywhere).
    stored = await repo.submit_many(
        [new_run(tenant, lane, delay_s=1.2345678), new_run(tenant, lane)]
    )
    stored += await repo.submit_many([new_run(tenant, lane, delay_s=1.2345678)])
    stored += await repo.submit_many(
        [new_run(tenant, lane, delay_s=1.2345678, conversation_id=unique("chat"))]
    )
    assert [run.not_before - run.created_at for run in stored] == [
        delay,
        timedelta(0),
        delay,
        delay,
    ]
    assert await repo.get_many([run.run_id for run in stored]) == {r.run_id: r for r in stored}


async def test_a_batch_with_nothing_to_check_is_one_statement_where_the_database_dates_it(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = RunsRepo(db)
    tenant = await tenants.new()
    lane = unique("lane")
    batch = [
        new_run(
            tenant,
            lane,
            input={"n": n, "text": "ü\"'\\", "list": [1, 2.5, None, True]},
            priority=n,
            delay_s=0.25 * n,
            idempotency_key=f"batch-{n}" if n % 2 else None,
            timeout_s=12.5 if n % 2 else None,
            max_attempts=n + 1,
        )
        for n in range(5)
    ]
    with data_statements(db, None) as sent:
        stored = await repo.submit_many(batch)
    # PostgreSQL: the runs and their events in one statement, committed alone, dated by the
    # database (no SELECT of the time). MariaDB: the runs' INSERT dates them and returns the
    # time, the events copy it. Elsewhere: the time, the runs, the events.
    if db.backend.capabilities.one_statement_submit:
        expected = 1
    elif db.backend.stamped_runs_insert(db.engine.sync_engine.dialect) is not None:
        expected = 2
    else:
        expected = 3
    assert len(sent) == expected, sent
    assert [run.input for run in stored] == [item.input for item in batch]
    assert [(run.idempotency_key, run.timeout_s) for run in stored] == [
        (item.idempotency_key, item.timeout_s) for item in batch
    ]
    assert len({run.created_at for run in stored}) == 1
    assert await repo.get_many([run.run_id for run in stored]) == {r.run_id: r for r in stored}
    for run in stored:
        assert await event_rows(db, run.run_id) == [(1, "queued", 0)]


async def test_a_batch_retried_after_a_lost_commit_acknowledgement_returns_its_runs(
    db: DatabaseManager, tenants: Tenants, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = RunsRepo(db)
    tenant = await tenants.new()
    lane = unique("lane")
    first: list[Any] = []

    async def committed_then_retried(fn: Callable[[], Awaitable[Any]]) -> Any:
        # The first try commits, but its caller never hears of it; the retry runs again.
        first.append(await fn())
        return await fn()

    monkeypatch.setattr(db, "with_retry", committed_then_retried)
    batch = [new_run(tenant, lane, input={"n": n}, idempotency_key=f"lost-{n}") for n in range(3)]
    stored = await repo.submit_many(batch)
    monkeypatch.undo()
    assert stored == first[0]
    assert await repo.get_many([run.run_id for run in stored]) == {r.run_id: r for r in stored}
    for run in stored:
        assert await event_rows(db, run.run_id) == [(1, "queued", 0)]
    assert await tenant_run_count(db, tenant) == 3


async def test_run_ids_are_uuid7_and_sort_as_the_runs_were_made(
    db: DatabaseManager, tenants: Tenants
) -> None:
    # Time-ordered ids put new runs at the end of the indexes keyed by them (new_run_id).
    repo = RunsRepo(db)
    tenant = await tenants.new()
    lane = unique("lane")
    first = await repo.submit_many([new_run(tenant, lane, input={"n": n}) for n in range(50)])
    second = await repo.submit_many([new_run(tenant, lane, input={"n": n}) for n in range(5)])
    made = [run.run_id for run in [*first, *second]]
    assert {uuid.UUID(run_id).version for run_id in made} == {7}
    assert sorted(made) == made
    async with db.connect() as conn:
        query = select(runs.c.id).where(runs.c.tenant_id == tenant).order_by(runs.c.id)
        assert list((await conn.execute(query)).scalars()) == made


async def test_input_hash_is_sha256_of_canonical_json() -> None:
    value: JSONObject = {"b": [1, 2.5, "ü"], "a": {"y": None, "x": True}}
    canonical = '{"a":{"x":true,"y":null},"b":[1,2.5,"ü"]}'
    assert hash_input(value) == hashlib.sha256(canonical.encode()).hexdigest()
    assert hash_input(json.loads(json.dumps(value, indent=2))) == hash_input(value)
    with pytest.raises(InvalidInput):
        hash_input({"x": float("nan")})


async def test_pending_runs_wait_for_enqueue(db: DatabaseManager, tenants: Tenants) -> None:
    repo, queue = RunsRepo(db), QueueRepo(db)
    tenant = await tenants.new()
    lane = unique("lane")
    given = RunId(str(uuid.uuid4()))
    first, second, refused, later = await repo.insert_pending(
        [
            new_run(
                tenant,
                lane,
                run_id=given,
                input={"nested": {"list": [1, 2.5, "ü", None, True]}},
                conversation_id="conversation-1",
                timeout_s=12.5,
                max_attempts=5,
                idempotency_key="key-1",
            ),
            new_run(tenant, lane),
            new_run(tenant, lane),
            new_run(tenant, lane, delay_s=3600),
        ]
    )
    assert first.run_id == given
    # The runs returned are the runs as stored, column for column.
    assert await repo.get_many([first.run_id, later.run_id]) == {
        first.run_id: first,
        later.run_id: later,
    }
    assert {run.status for run in (first, second, refused, later)} == {RunStatus.PENDING}
    assert timedelta(seconds=3599) <= later.not_before - later.created_at <= timedelta(hours=1)
    assert await claim(queue, lane) == []
    assert await event_count(db, [first.run_id, second.run_id]) == 0

    # Refused by admission: terminal at once, and only a pending run can be refused.
    error: JSONObject = {"code": "quota_exceeded", "message": "daily quota used up"}
    assert await repo.mark_rate_limited(refused.run_id, error)
    assert not await repo.mark_rate_limited(refused.run_id, error)
    gone = await repo.get(refused.run_id)
    assert gone is not None
    assert (gone.status, gone.error) == (RunStatus.RATE_LIMITED, error)
    assert gone.finished_at is not None

    unknown = RunId(str(uuid.uuid4()))
    moved = await repo.enqueue([second.run_id, unknown, refused.run_id, first.run_id, later.run_id])
    assert moved == [second.run_id, first.run_id, later.run_id]
    assert await repo.enqueue([first.run_id]) == []  # moved once only
    assert not await repo.mark_rate_limited(first.run_id, error)
    assert await event_rows(db, first.run_id) == [(1, "queued", 0)]
    assert await event_rows(db, refused.run_id) == []
    # The delayed run keeps the not_before fixed at insert.
    assert {c.run.run_id for c in await claim(queue, lane)} == {first.run_id, second.run_id}
    queued_later = await repo.get(later.run_id)
    assert queued_later is not None
    assert (queued_later.status, queued_later.not_before) == (RunStatus.QUEUED, later.not_before)


async def test_reads_of_unknown_runs(db: DatabaseManager, tenants: Tenants) -> None:
    repo = RunsRepo(db)
    unknown = RunId(str(uuid.uuid4()))
    assert await repo.get(unknown) is None
    assert await repo.get_many([]) == {}
    assert await repo.get_many([unknown]) == {}
    assert await repo.find_by_idempotency_key(await tenants.new(), "nope") is None
    assert await EventsRepo(db).list(unknown) == []
    assert await repo.submit_many([]) == [] and await repo.enqueue([]) == []
    assert await repo.finish_many([]) == []


# --- idempotency and bad batches ------------------------------------------------------------


async def test_idempotency_conflict_leaves_nothing_written(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = RunsRepo(db)
    tenant, other = await tenants.new(), await tenants.new()
    lane = unique("lane")
    [original] = await repo.submit_many([new_run(tenant, lane, idempotency_key="k1")])
    assert await repo.find_by_idempotency_key(tenant, "k1") == original
    assert await repo.find_by_idempotency_key(other, "k1") is None

    innocent = RunId(str(uuid.uuid4()))
    batch = [
        new_run(tenant, lane, run_id=innocent, idempotency_key="k2"),
        new_run(tenant, lane, idempotency_key="k1", input={"n": 2}),
    ]
    for write in (repo.submit_many, repo.insert_pending):
        with pytest.raises(IdempotencyConflict, match="'k1'"):
            await write(batch)
    # A key given twice within one batch is refused before anything is written.
    with pytest.raises(IdempotencyConflict, match="'k3'"):
        await repo.submit_many(
            [
                new_run(tenant, lane, idempotency_key="k3"),
                new_run(tenant, lane, idempotency_key="k3"),
            ]
        )
    assert await repo.get(innocent) is None
    assert await event_count(db, [innocent]) == 0
    assert await tenant_run_count(db, tenant) == 1
    assert await repo.find_by_idempotency_key(tenant, "k2") is None

    # Keys are per tenant; runs without a key never conflict.
    [elsewhere] = await repo.submit_many([new_run(other, lane, idempotency_key="k1")])
    assert elsewhere.idempotency_key == "k1"
    assert len(await repo.submit_many([new_run(tenant, lane), new_run(tenant, lane)])) == 2


async def test_other_bad_batches_leave_nothing_written(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = RunsRepo(db)
    tenant = await tenants.new()
    lane = unique("lane")
    [existing] = await repo.submit_many([new_run(tenant, lane)])
    innocent = RunId(str(uuid.uuid4()))
    ok = new_run(tenant, lane, run_id=innocent)
    no_tenant = TenantId(str(uuid.uuid4()))
    with pytest.raises(NotFound, match=no_tenant):
        await repo.submit_many([ok, new_run(no_tenant, lane)])
    with pytest.raises(Conflict, match=existing.run_id):
        await repo.submit_many([ok, new_run(tenant, lane, run_id=existing.run_id)])
    with pytest.raises(Conflict):
        await repo.submit_many([ok, ok])
    with pytest.raises(InvalidInput):
        await repo.submit_many([ok, new_run(tenant, lane, input={"x": float("inf")})])
    assert await repo.get(innocent) is None
    assert await tenant_run_count(db, tenant) == 1
    with pytest.raises(ValueError):
        new_run(tenant, lane, delay_s=-1)
    with pytest.raises(ValueError):
        new_run(tenant, lane, max_attempts=0)


# --- finish ---------------------------------------------------------------------------------


async def test_success_records_output_and_events_in_order(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo, queue = RunsRepo(db), QueueRepo(db)
    lane = unique("lane")
    [run] = await repo.submit_many([new_run(await tenants.new(), lane)])
    [claimed] = await claim(queue, lane)
    assert await repo.finish_many([Succeeded(fence=claimed.fence, output={"answer": 42})]) == [True]
    done = await repo.get(run.run_id)
    assert done is not None
    assert (done.status, done.output, done.error, done.attempt) == (
        RunStatus.SUCCEEDED,
        {"answer": 42},
        None,
        1,
    )
    assert (done.lease_owner, done.lease_expires_at) == (None, None)
    assert done.started_at is not None and done.finished_at is not None
    assert done.elapsed_time is not None
    expected = (done.finished_at - done.started_at).total_seconds()
    assert done.elapsed_time == pytest.approx(expected, abs=1e-3)
    listed = await EventsRepo(db).list(run.run_id)
    assert [(e.seq, e.type, e.attempt) for e in listed] == [
        (1, "queued", 0),
        (2, "started", 1),
        (3, "succeeded", 1),
    ]
    assert all(isinstance(e, Event) and e.run_id == run.run_id for e in listed)
    assert [e.created_at for e in listed] == sorted(e.created_at for e in listed)
    assert listed[2].created_at == done.finished_at
    # Paging: after a seq, and a limit.
    assert [e.seq for e in await EventsRepo(db).list(run.run_id, after_seq=1)] == [2, 3]
    assert [e.seq for e in await EventsRepo(db).list(run.run_id, after_seq=1, limit=1)] == [2]
    assert await EventsRepo(db).list(run.run_id, limit=0) == []


async def test_a_success_writes_its_last_events_before_its_own_in_its_transaction(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo, queue = RunsRepo(db), QueueRepo(db)
    lane = unique("lane")
    await repo.submit_many([new_run(await tenants.new(), lane) for _ in range(3)])
    first, second, reaped = await claim(queue, lane)
    await set_lease_expiry(db, [reaped.run.run_id], -5)
    await queue.reap_expired()
    started: JSONObject = {"key": "a", "try": 1}
    last = [("step_started", started), ("step_finished", started)]
    batch: list[Outcome] = [
        Succeeded(fence=first.fence, output=1, events=last),
        Succeeded(fence=second.fence, output=2),
        Succeeded(fence=reaped.fence, output=3, events=last),  # its fence is gone
    ]
    assert await repo.finish_many(batch) == [True, True, False]
    listed = await EventsRepo(db).list(first.run.run_id)
    assert [(e.seq, e.type, e.data) for e in listed[1:]] == [
        (2, "started", {}),
        (3, "step_started", {"key": "a", "try": 1}),
        (4, "step_finished", {"key": "a", "try": 1}),
        (5, "succeeded", {}),
    ]
    assert all(e.attempt == 1 for e in listed[1:])
    assert listed[2].created_at == listed[3].created_at == listed[4].created_at
    assert [e.type for e in await EventsRepo(db).list(second.run.run_id)] == [
        "queued",
        "started",
        "succeeded",
    ]
    assert "step_started" not in [e.type for e in await EventsRepo(db).list(reaped.run.run_id)]


async def test_events_of_several_runs_take_each_runs_next_seqs_in_one_statement_where_rows_bind(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo, queue = RunsRepo(db), QueueRepo(db)
    lane = unique("lane")
    await repo.submit_many([new_run(await tenants.new(), lane) for _ in range(2)])
    first, second = await claim(queue, lane)  # each has "queued" and "started" (seq 1, 2)
    one, two = first.run.run_id, second.run.run_id
    items: list[tuple[RunId, Attempt, str, JSONObject]] = [
        (one, Attempt(1), "step_started", {"key": "a"}),
        (two, Attempt(1), "step_started", {"key": "b", "nested": [1, {"x": None}]}),
        (one, Attempt(1), "step_finished", {"key": "a"}),
        (one, Attempt(1), "message_received", {}),
    ]
    with data_statements(db, "events") as sent:
        async with db.write_transaction() as conn:
            seqs = await append_events_txn(conn, db.backend.name, items)
    assert seqs == [3, 3, 4, 5]
    # A backend that binds rows as one parameter reads the last seqs in the INSERT itself.
    bound_as_rows = db.backend.rows_parameter("rows", {}) is not None
    assert len(sent) == (1 if bound_as_rows else 2), sent
    stored = await EventsRepo(db).list(one)
    assert [(e.seq, e.type, e.data) for e in stored[2:]] == [
        (3, "step_started", {"key": "a"}),
        (4, "step_finished", {"key": "a"}),
        (5, "message_received", {}),
    ]
    [only] = await EventsRepo(db).list(two, after_seq=2)
    assert (only.seq, only.data, only.attempt) == (3, {"key": "b", "nested": [1, {"x": None}]}, 1)


async def test_a_runs_batch_of_events_reads_its_last_seq_once_not_per_event(
    db: DatabaseManager, tenants: Tenants
) -> None:
    # Read per event, the last seq's index scan steps over every entry the statement has
    # inserted for the run so far: a batch of streamed deltas would cost its size squared.
    if db.backend.rows_parameter("rows", {}) is None:
        pytest.skip(f"{db.backend.name} appends events with a read and an executemany")
    repo, queue = RunsRepo(db), QueueRepo(db)
    lane = unique("lane")
    await repo.submit_many([new_run(await tenants.new(), lane) for _ in range(2)])
    first, second = await claim(queue, lane)
    rows = [
        {"run_id": run.run.run_id, "nth": nth, "type": "delta", "attempt": 1, "data": {}}
        for run in (first, second)
        for nth in range(1, 301)
    ]
    statement = _appended_from_rows(db.backend.name, at_db_now=False, new_runs=False)
    assert statement is not None
    compiled = statement.compile(dialect=db.engine.dialect)
    values = {**compiled.params, "events": json.dumps(rows), "created_at": datetime.now(UTC)}
    assert compiled.positiontup is not None
    arguments = [values[name] for name in compiled.positiontup]
    async with db.write_transaction() as conn:
        raw = await conn.get_raw_connection()
        plan = await raw.driver_connection.fetchval(  # type: ignore[union-attr]
            f"EXPLAIN (ANALYZE, FORMAT JSON) {compiled}", *arguments
        )
        await conn.rollback()
    document = plan if isinstance(plan, list) else json.loads(plan)  # the driver's JSON codec
    loops = [
        node["Actual Loops"]
        for node in _plan_nodes(document[0]["Plan"])
        if node.get("Alias") == "prior"
    ]
    assert loops == [2], loops  # one read per run, before the 600 rows went in


def _plan_nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node, *(child for sub in node.get("Plans", []) for child in _plan_nodes(sub))]


async def test_a_claim_and_a_finish_write_their_events_with_their_transition_where_they_can(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo, queue = RunsRepo(db), QueueRepo(db)
    lane = unique("lane")
    await repo.submit_many([new_run(await tenants.new(), lane) for _ in range(3)])
    with data_statements(db, "events") as claiming:
        claimed = await claim(queue, lane)
    error: JSONObject = {"type": "ValueError", "message": "bad", "reason": "non-retryable"}
    with data_statements(db, "events") as finishing:
        applied = await repo.finish_many(
            [
                Succeeded(fence=claimed[0].fence, output=1),
                Succeeded(fence=claimed[1].fence, output=2),
                Failed(fence=claimed[2].fence, error=error, retry_delay_s=None),
            ]
        )
    assert applied == [True, True, True]
    # One statement names the events per transition: with the UPDATE itself (a CTE) where the
    # database has data-modifying CTEs, else an INSERT … SELECT after it.
    merged = db.backend.capabilities.dml_in_cte
    for sent in (claiming, finishing[:1], finishing[1:]):
        assert len(sent) == 1, sent
        assert sent[0].lstrip().upper().startswith("WITH" if merged else "INSERT"), sent
    for run in claimed:
        types = [e.type for e in await EventsRepo(db).list(run.run.run_id)]
        assert types[1:] == ["started", "succeeded" if run is not claimed[2] else "failed"]
    [failed] = await EventsRepo(db).list(claimed[2].run.run_id, after_seq=2)
    assert failed.data == error


async def test_an_attempts_last_events_go_in_its_outcomes_statement_where_rows_bind(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo, queue = RunsRepo(db), QueueRepo(db)
    lane = unique("lane")
    await repo.submit_many([new_run(await tenants.new(), lane) for _ in range(3)])
    done, retried, stale = await claim(queue, lane)  # each has "queued" and "started"
    error: JSONObject = {"type": "ValueError", "message": "bad", "reason": "retry"}
    step: JSONObject = {"key": "a", "try": 1}
    outcomes: list[Outcome] = [
        Succeeded(
            fence=done.fence,
            output=None,
            events=[("step_started", step), ("step_finished", {**step, "status": "succeeded"})],
        ),
        Failed(fence=retried.fence, error=error, retry_delay_s=5, events=[("step_started", step)]),
        Succeeded(
            fence=replace(stale.fence, owner="intruder"), output=1, events=[("step_started", step)]
        ),
    ]
    with data_statements(db, "events") as sent:
        assert await repo.finish_many(outcomes) == [True, True, False]
    # One statement per kind of outcome ends its runs and writes all their events, where the
    # database binds rows as one parameter; elsewhere the attempts' events go first, alone.
    in_one = db.backend.rows_parameter("rows", {}) is not None
    assert (len(sent) == 2) if in_one else (len(sent) > 2), sent
    ended = await EventsRepo(db).list(done.run.run_id, after_seq=2)
    assert [(e.seq, e.type, e.data, e.attempt) for e in ended] == [
        (3, "step_started", step, 1),
        (4, "step_finished", {**step, "status": "succeeded"}, 1),
        (5, "succeeded", {}, 1),
    ]
    finished = await repo.get(done.run.run_id)
    assert finished is not None and finished.status == RunStatus.SUCCEEDED
    # Dated with the finish, by its one reading of the database's time.
    assert {e.created_at for e in ended} == {finished.finished_at}
    again = await EventsRepo(db).list(retried.run.run_id, after_seq=2)
    assert [(e.seq, e.type, e.data) for e in again] == [
        (3, "step_started", step),
        (4, "retrying", {"delay_s": 5.0, "error": error}),
    ]
    assert await EventsRepo(db).list(stale.run.run_id, after_seq=2) == []


async def test_outcomes_and_the_next_claim_commit_together_and_the_cap_counts_them_ended(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo, queue, handoffs = RunsRepo(db), QueueRepo(db), HandoffsRepo(db)
    lane = unique("lane")
    tenant = await tenants.new("capped")
    await repo.submit_many([new_run(tenant, lane) for _ in range(6)])
    caps = {"capped": 2}
    first = await queue.claim_batch(lane, "w", limit=5, lease_ttl_s=TTL_S, tenant_caps=caps)
    assert len(first) == 2  # the cap
    stale = Succeeded(fence=replace(first[1].fence, owner="intruder"), output="late")
    outcomes: list[Outcome] = [Succeeded(fence=first[0].fence, output="done"), stale]
    request = ClaimRequest(lane=lane, owner="w", limit=5, lease_ttl_s=TTL_S, tenant_caps=caps)
    applied, batch = await handoffs.finish_and_claim(outcomes, request)
    # The run it ended no longer counts: one slot of the cap is free, and only one.
    assert applied == [True, False]
    assert len(batch.claims) == 1 and batch.is_capped
    async with db.connect() as conn:
        running = select(func.count()).where(runs.c.tenant_id == tenant, runs.c.status == "running")
        assert (await conn.execute(running)).scalar_one() == 2
    ended = await repo.get(first[0].run.run_id)
    assert ended is not None and ended.status == RunStatus.SUCCEEDED
    assert [e.type for e in await EventsRepo(db).list(batch.claims[0].run.run_id)] == [
        "queued",
        "started",
    ]


async def test_stale_fences_change_nothing_while_the_rest_of_the_batch_applies(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo, queue = RunsRepo(db), QueueRepo(db)
    lane = unique("lane")
    await repo.submit_many([new_run(await tenants.new(), lane) for _ in range(5)])
    good, old_attempt, wrong_owner, reaped, failing = await claim(queue, lane)
    await set_lease_expiry(db, [reaped.run.run_id], -5)
    assert [r.run_id for r in await queue.reap_expired()] == [reaped.run.run_id]
    stale = [old_attempt.run.run_id, wrong_owner.run.run_id, reaped.run.run_id]
    before = await repo.get_many(stale)
    events_before = {run_id: await event_rows(db, run_id) for run_id in stale}

    error: JSONObject = {"type": "ValueError", "message": "bad", "reason": "non-retryable"}
    batch: list[Outcome] = [
        Succeeded(fence=good.fence, output="ok"),
        Succeeded(fence=replace(old_attempt.fence, attempt=Attempt(0)), output="late"),
        Failed(fence=replace(wrong_owner.fence, owner="intruder"), error=error, retry_delay_s=None),
        Succeeded(fence=reaped.fence, output="after the reap"),
        Failed(fence=failing.fence, error=error, retry_delay_s=None),
    ]
    assert await repo.finish_many(batch) == [True, False, False, False, True]
    assert await repo.get_many(stale) == before  # not a column changed
    assert {run_id: await event_rows(db, run_id) for run_id in stale} == events_before
    after = await repo.get_many([good.run.run_id, failing.run.run_id])
    assert after[good.run.run_id].status == RunStatus.SUCCEEDED
    assert after[failing.run.run_id].status == RunStatus.FAILED
    # The stale attempts' owners are still fenced out, the live ones finish normally.
    assert await repo.finish_many([Succeeded(fence=old_attempt.fence, output="mine")]) == [True]
    assert await repo.finish_many([Succeeded(fence=wrong_owner.fence, output="mine")]) == [True]


async def test_retry_requeues_after_a_delay_by_database_time(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo, queue = RunsRepo(db), QueueRepo(db)
    lane = unique("lane")
    [run] = await repo.submit_many([new_run(await tenants.new(), lane)])
    [first] = await claim(queue, lane)
    error: JSONObject = {"type": "TimeoutError", "message": "slow", "reason": "retry"}
    assert await repo.finish_many([Failed(fence=first.fence, error=error, retry_delay_s=60)]) == [
        True
    ]
    now = await database_now(db)
    waiting = await repo.get(run.run_id)
    assert waiting is not None
    assert (waiting.status, waiting.error, waiting.attempt) == (RunStatus.QUEUED, error, 1)
    assert (waiting.lease_owner, waiting.lease_expires_at, waiting.finished_at) == (None,) * 3
    assert timedelta(seconds=55) < waiting.not_before - now <= timedelta(seconds=60)
    assert await claim(queue, lane) == []
    [*_, retrying] = await EventsRepo(db).list(run.run_id)
    assert (retrying.type, retrying.attempt, retrying.data) == (
        "retrying",
        1,
        {"delay_s": 60, "error": error},
    )
    # The old attempt cannot finish the requeued run.
    assert await repo.finish_many([Succeeded(fence=first.fence, output=None)]) == [False]

    # A short delay: not claimable at once, claimable once database time passes not_before.
    [quick] = await repo.submit_many([new_run(await tenants.new(), lane)])
    [attempt] = [c for c in await claim(queue, lane) if c.run.run_id == quick.run_id]
    assert await repo.finish_many([Failed(fence=attempt.fence, error=error, retry_delay_s=0.3)])
    assert await claim(queue, lane) == []
    [again] = await wait_for(lambda: claim(queue, lane), timeout_s=10, message="the retry")
    requeued = await repo.get(quick.run_id)
    assert requeued is not None and again.run.run_id == quick.run_id
    assert again.run.attempt == 2 and again.run.error == error  # error kept until it ends
    assert await database_now(db) >= requeued.not_before


async def test_failed_is_terminal(db: DatabaseManager, tenants: Tenants) -> None:
    repo, queue = RunsRepo(db), QueueRepo(db)
    lane = unique("lane")
    [run] = await repo.submit_many([new_run(await tenants.new(), lane, max_attempts=1)])
    [claimed] = await claim(queue, lane)
    error: JSONObject = {"type": "ValueError", "message": "no", "reason": "max attempts"}
    failed = Failed(fence=claimed.fence, error=error, retry_delay_s=None)
    assert await repo.finish_many([failed]) == [True]
    done = await repo.get(run.run_id)
    assert done is not None
    assert (done.status, done.error, done.output) == (RunStatus.FAILED, error, None)
    assert done.finished_at is not None and done.elapsed_time is not None
    assert done.lease_owner is None
    # Terminal: no second finish of any kind, and no claim.
    again: list[Outcome] = [failed, Succeeded(fence=claimed.fence, output=1)]
    assert await repo.finish_many(again) == [False, False]
    retry = Failed(fence=claimed.fence, error=error, retry_delay_s=0)
    assert await repo.finish_many([retry]) == [False]
    assert await claim(queue, lane) == []
    assert await repo.get(run.run_id) == done
    events_ = await EventsRepo(db).list(run.run_id)
    assert [(e.type, e.data) for e in events_][-1] == ("failed", error)
    assert [e.type for e in events_] == ["queued", "started", "failed"]


async def test_one_batch_finishes_the_same_run_once(db: DatabaseManager, tenants: Tenants) -> None:
    repo, queue = RunsRepo(db), QueueRepo(db)
    lane = unique("lane")
    await repo.submit_many([new_run(await tenants.new(), lane)])
    [claimed] = await claim(queue, lane)
    twice: list[Outcome] = [
        Succeeded(fence=claimed.fence, output=1),
        Succeeded(fence=claimed.fence, output=2),
    ]
    assert await repo.finish_many(twice) == [True, False]
    done = await repo.get(claimed.run.run_id)
    assert done is not None and done.output == 1
    assert [t for _, t, _ in await event_rows(db, claimed.run.run_id)].count("succeeded") == 1


async def test_a_large_batch_ends_each_run_its_own_way_with_its_event(
    db: DatabaseManager, tenants: Tenants
) -> None:
    # More outcomes of one kind than one finish statement takes, every other kind beside
    # them, distinct values per run (each must land on its own run), and a recorded cancel
    # that turns a retry into a cancel (a success would stand: the workflow returned).
    repo, queue = RunsRepo(db), QueueRepo(db)
    lane = unique("lane")
    tenant = await tenants.new()
    await repo.submit_many([new_run(tenant, lane) for _ in range(400)])
    claims = await claim(queue, lane, limit=400)
    assert len(claims) == 400
    cancelled = claims[2].run.run_id  # index 2: a retry below
    await repo.request_cancel(tenant, cancelled)

    def error(index: int) -> JSONObject:
        return {"type": "ValueError", "message": f"run {index}", "reason": "retry"}

    outcomes: list[Outcome] = []
    expected: dict[RunId, tuple[RunStatus, Any, Any, str, Any]] = {}
    for index, claimed in enumerate(claims):
        fence, run_id, kind = claimed.fence, claimed.run.run_id, index % 20
        if kind == 1:
            outcomes.append(Failed(fence=fence, error=error(index), retry_delay_s=None))
            expected[run_id] = (RunStatus.FAILED, None, error(index), "failed", error(index))
        elif kind == 2:
            outcomes.append(Failed(fence=fence, error=error(index), retry_delay_s=index))
            data = {"delay_s": index, "error": error(index)}
            expected[run_id] = (RunStatus.QUEUED, None, error(index), "retrying", data)
        elif kind == 3:
            outcomes.append(Stopped(fence=fence, status=RunStatus.CANCELLED))
            data = {"reason": "cancelled"}
            expected[run_id] = (RunStatus.CANCELLED, None, None, "cancelled", data)
        elif kind == 4:
            stop: JSONObject = {"reason": "timeout", "run": index}
            outcomes.append(Stopped(fence=fence, status=RunStatus.TIMED_OUT, error=stop))
            expected[run_id] = (RunStatus.TIMED_OUT, None, stop, "timed_out", stop)
        else:
            outcomes.append(Succeeded(fence=fence, output={"run": index}))
            expected[run_id] = (RunStatus.SUCCEEDED, {"run": index}, None, "succeeded", {})
    expected[cancelled] = (RunStatus.CANCELLED, None, None, "cancelled", {"reason": "cancelled"})
    assert await repo.finish_many(outcomes) == [True] * 400

    now = await database_now(db)
    done = await repo.get_many(list(expected))
    async with db.connect() as conn:
        rows = await conn.execute(
            select(events).where(events.c.run_id.in_(list(expected))).order_by(events.c.seq)
        )
        last = {row.run_id: row for row in rows}
    for index, claimed in enumerate(claims):
        run_id = claimed.run.run_id
        status, output, error_, event_type, data = expected[run_id]
        run = done[run_id]
        assert (run.status, run.output, run.error, run.attempt) == (status, output, error_, 1)
        assert (run.lease_owner, run.lease_expires_at) == (None, None)
        event = last[run_id]
        assert (event.seq, event.type, event.attempt, event.data) == (3, event_type, 1, data)
        assert event.created_at == run.updated_at
        if status is RunStatus.QUEUED:
            assert run.finished_at is None
            assert run.not_before - run.updated_at == timedelta(seconds=index)
        else:
            assert run.finished_at == run.updated_at <= now
            assert run.started_at is not None and run.elapsed_time is not None
            elapsed_s = (run.finished_at - run.started_at).total_seconds()
            assert run.elapsed_time == pytest.approx(elapsed_s, abs=1e-3)
    assert done[cancelled].cancel_requested_at is not None
    assert all(
        done[c.run.run_id].cancel_requested_at == done[c.run.run_id].finished_at
        for index, c in enumerate(claims)
        if index % 20 == 3
    )
