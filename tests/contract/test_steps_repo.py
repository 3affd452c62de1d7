"""Step checkpoints on every backend: replay, non-determinism, fencing, takeover, races, and the
one-statement starts and finishes the engine uses."""

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from functools import partial
from typing import Any

import pytest
from sqlalchemy import select, update
from sqlalchemy.exc import OperationalError

from moorline.db.manager import DatabaseManager
from moorline.db.repos.fences import fence_by_parameters, fence_parameters
from moorline.db.repos.queue import Claim, QueueRepo
from moorline.db.repos.records import Fence
from moorline.db.repos.steps import (
    CancelRequested,
    LeaseLost,
    StepMismatch,
    StepNotRunning,
    StepsRepo,
    StepStart,
)
from moorline.db.schema import runs, steps
from moorline.types import Attempt, JSONValue, RunId, StepStatus
from tests.contract.queue_helpers import (
    NO_CAP,
    Tenants,
    add_runs,
    finish,
    set_lease_expiry,
    unique,
)
from tests.contract.statements import data_statements
from tests.helpers import wait_for

TTL_S = 30.0
RACERS = 200
"""Concurrent starts of one step from a stale and a live fence, half each."""
RECLAIM_RACERS = 50
"""Starts on each side of a reclaim racing them."""
OUTPUT: JSONValue = {"text": "review ✓", "scores": [1, 2.5, -3], "nested": {"ok": True, "x": None}}


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


async def claim_one(queue: QueueRepo, lane: str, owner: str = "worker") -> Claim:
    [claim] = await queue.claim_batch(lane, owner, limit=1, lease_ttl_s=TTL_S, tenant_caps=NO_CAP)
    return claim


async def new_run(
    db: DatabaseManager, tenants: Tenants, owner: str = "worker"
) -> tuple[str, Fence]:
    """A run claimed by ``owner``; returns its lane and the claim's fence."""
    lane = unique("lane")
    await add_runs(db, await tenants.new(), lane, 1)
    return lane, (await claim_one(QueueRepo(db), lane, owner)).fence


async def reclaim(db: DatabaseManager, lane: str, fence: Fence, owner: str = "next") -> Fence:
    """Expire ``fence``'s lease, reap it and claim the run again: the next attempt's fence."""
    queue = QueueRepo(db)
    await set_lease_expiry(db, [fence.run_id], -1.0)

    async def reap() -> bool:
        try:
            return fence.run_id in [r.run_id for r in await queue.reap_expired(limit=1_000)]
        except OperationalError:
            # MariaDB may pick the reap as a deadlock's victim against the old attempt's
            # in-flight writes (nothing moved); the reaper's loop reaps again, as here.
            return False

    await wait_for(reap, message=f"reap of run {fence.run_id}")

    # A fenced write of the old attempt that is still in flight holds the run's row lock, and
    # the claim skips locked rows: poll until it is free.
    async def claim() -> list[Claim]:
        try:
            return await queue.claim_batch(
                lane, owner, limit=1, lease_ttl_s=TTL_S, tenant_caps=NO_CAP
            )
        except OperationalError:
            # MariaDB may pick the claim as a deadlock's victim against the old attempt's
            # in-flight writes; a worker's claim loop backs off and claims again, as here.
            return []

    [successor] = await wait_for(claim, message=f"claim of run {fence.run_id}")
    assert successor.fence.attempt == fence.attempt + 1
    return successor.fence


async def step_rows(db: DatabaseManager, run_id: str) -> list[dict[str, Any]]:
    async with db.connect() as conn:
        rows = await conn.execute(select(steps).where(steps.c.run_id == run_id))
        return [dict(row) for row in rows.mappings()]


class Counted:
    """A step function that counts its calls."""

    def __init__(self, result: JSONValue) -> None:
        self.result = result
        self.calls = 0

    def __call__(self) -> JSONValue:
        self.calls += 1
        return self.result


async def run_step(
    repo: StepsRepo, fence: Fence, key: str, fn: Callable[[], JSONValue], call_hash: str = "h1"
) -> JSONValue:
    """What ``ctx.step`` does with the repository: replay, or run and checkpoint."""
    started = await repo.start(fence, key, "fn", call_hash)
    if started.replay:
        return started.step.output
    output = fn()
    await repo.succeed(fence, key, output)
    return output


async def test_a_finished_step_replays_its_output_without_running_again(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = StepsRepo(db)
    lane, fence = await new_run(db, tenants)
    fn = Counted(OUTPUT)
    assert await run_step(repo, fence, "llm_review", fn) == OUTPUT
    assert await run_step(repo, fence, "llm_review", fn) == OUTPUT
    # The next attempt (after a crash) replays it too.
    successor = await reclaim(db, lane, fence)
    assert await run_step(repo, successor, "llm_review", fn) == OUTPUT
    assert fn.calls == 1
    step = await repo.get(fence.run_id, "llm_review")
    assert step is not None
    assert (step.status, step.attempt, step.output) == (StepStatus.SUCCEEDED, fence.attempt, OUTPUT)
    assert step.finished_at is not None and step.finished_at >= step.started_at


async def test_a_step_returning_none_replays_none(db: DatabaseManager, tenants: Tenants) -> None:
    repo = StepsRepo(db)
    _, fence = await new_run(db, tenants)
    fn = Counted(None)
    assert await run_step(repo, fence, "side_effect", fn) is None
    assert await run_step(repo, fence, "side_effect", fn) is None
    assert fn.calls == 1


async def test_start_reports_a_new_step_as_running_under_the_attempt(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = StepsRepo(db)
    _, fence = await new_run(db, tenants)
    started = await repo.start(fence, "a", "fn", "h1")
    assert (started.replay, started.repeated) == (False, False)
    assert (started.step.status, started.step.attempt) == (StepStatus.RUNNING, fence.attempt)
    assert (started.step.function, started.step.call_hash) == ("fn", "h1")
    assert started.step.output is None and started.step.finished_at is None


async def test_a_changed_call_is_reported_as_a_mismatch(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = StepsRepo(db)
    lane, fence = await new_run(db, tenants)
    await run_step(repo, fence, "llm:0", Counted(OUTPUT), call_hash="a" * 64)
    before = await step_rows(db, fence.run_id)
    successor = await reclaim(db, lane, fence)
    with pytest.raises(StepMismatch) as caught:
        await repo.start(successor, "llm:0", "fn", "b" * 64)
    message = str(caught.value)
    assert "llm:0" in message and "a" * 64 in message and "b" * 64 in message
    assert caught.value.code == "step_mismatch"
    with pytest.raises(StepMismatch, match="other_fn"):
        await repo.start(successor, "llm:0", "other_fn", "a" * 64)
    assert await step_rows(db, fence.run_id) == before


async def test_keys_differing_only_in_case_are_distinct_or_refused(
    db: DatabaseManager, tenants: Tenants
) -> None:
    # MySQL/MariaDB's default collation compares "Key" and "key" as equal; the repository
    # must then refuse the second instead of replaying the first's output for it.
    repo = StepsRepo(db)
    _, fence = await new_run(db, tenants)
    await run_step(repo, fence, "Key", Counted("upper"))
    try:
        output = await run_step(repo, fence, "key", Counted("lower"))
    except StepMismatch as exc:
        assert "collides" in str(exc)
    else:
        assert output == "lower"
        lower = await repo.get(fence.run_id, "key")
        assert lower is not None and lower.output == "lower"
    upper = await repo.get(fence.run_id, "Key")
    assert upper is not None and upper.output == "upper"


STALENESS = ["other attempt", "other owner", "reaped", "finished"]


async def make_stale(db: DatabaseManager, fence: Fence, how: str) -> Fence:
    """A fence that no longer holds its run, made ``how``."""
    if how == "other attempt":
        return replace(fence, attempt=Attempt(fence.attempt + 1))
    if how == "other owner":
        return replace(fence, owner="impostor")
    if how == "reaped":
        await set_lease_expiry(db, [fence.run_id], -1.0)
        assert fence.run_id in [r.run_id for r in await QueueRepo(db).reap_expired(limit=1_000)]
        return fence
    assert await finish(db, fence)
    return fence


async def test_a_stale_fence_writes_nothing(db: DatabaseManager, tenants: Tenants) -> None:
    repo = StepsRepo(db)
    for how in STALENESS:
        _, fence = await new_run(db, tenants)
        await repo.start(fence, "in_flight", "fn", "h1")
        await run_step(repo, fence, "done", Counted(OUTPUT))
        fence = await make_stale(db, fence, how)
        before = await step_rows(db, fence.run_id)
        writes: list[Callable[[], Awaitable[object]]] = [
            partial(repo.start, fence, "new", "fn", "h1"),
            partial(repo.start, fence, "in_flight", "fn", "h1"),
            partial(repo.start, fence, "done", "fn", "h1"),
            partial(repo.insert_new, fence, "new", "fn", "h1"),
            partial(repo.insert_new, fence, "done", "fn", "h1"),
            partial(repo.succeed, fence, "in_flight", "late"),
            partial(repo.fail, fence, "in_flight", "late"),
        ]
        for write in writes:
            with pytest.raises(LeaseLost) as caught:
                await write()
            assert caught.value.code == "lease_lost"
            assert fence.run_id in str(caught.value), how
        assert await step_rows(db, fence.run_id) == before, how


async def test_a_step_of_a_crashed_attempt_is_taken_over_by_the_next(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = StepsRepo(db)
    lane, zombie = await new_run(db, tenants, "crashed")
    first = await repo.start(zombie, "post_comment", "fn", "h1")
    successor = await reclaim(db, lane, zombie)
    taken = await repo.start(successor, "post_comment", "fn", "h1")
    assert (taken.replay, taken.repeated) == (False, True)
    assert (taken.step.status, taken.step.attempt) == (StepStatus.RUNNING, successor.attempt)
    assert taken.step.started_at >= first.step.started_at
    # The zombie wakes up and tries to checkpoint: refused, and the successor's stands.
    with pytest.raises(LeaseLost):
        await repo.succeed(zombie, "post_comment", "zombie")
    await repo.succeed(successor, "post_comment", "fresh")
    step = await repo.get(successor.run_id, "post_comment")
    assert step is not None
    assert (step.status, step.attempt, step.output) == (
        StepStatus.SUCCEEDED,
        successor.attempt,
        "fresh",
    )


async def test_a_failed_step_is_retried_and_taken_over(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = StepsRepo(db)
    lane, fence = await new_run(db, tenants)
    await repo.start(fence, "flaky", "fn", "h1")
    await repo.fail(fence, "flaky", "ValueError: boom")
    failed = await repo.get(fence.run_id, "flaky")
    assert failed is not None
    assert (failed.status, failed.error, failed.output) == (
        StepStatus.FAILED,
        "ValueError: boom",
        None,
    )
    assert failed.finished_at is not None
    # A per-step retry in the same attempt, then a failure again.
    again = await repo.start(fence, "flaky", "fn", "h1")
    assert (again.repeated, again.step.status, again.step.error) == (True, StepStatus.RUNNING, None)
    assert again.step.finished_at is None
    await repo.fail(fence, "flaky", "ValueError: boom")
    # The next attempt takes the failed step over and succeeds.
    successor = await reclaim(db, lane, fence)
    taken = await repo.start(successor, "flaky", "fn", "h1")
    assert (taken.repeated, taken.step.attempt) == (True, successor.attempt)
    await repo.succeed(successor, "flaky", 42)
    done = await repo.get(fence.run_id, "flaky")
    assert done is not None and (done.status, done.output, done.error) == (
        StepStatus.SUCCEEDED,
        42,
        None,
    )


async def test_a_finished_step_is_never_overwritten(db: DatabaseManager, tenants: Tenants) -> None:
    repo = StepsRepo(db)
    _, fence = await new_run(db, tenants)
    await run_step(repo, fence, "once", Counted(OUTPUT))
    # The same checkpoint again (a retry after a lost commit acknowledgement) is a no-op.
    await repo.succeed(fence, "once", OUTPUT)
    before = await step_rows(db, fence.run_id)
    with pytest.raises(StepNotRunning, match="succeeded"):
        await repo.succeed(fence, "once", "different")
    with pytest.raises(StepNotRunning):
        await repo.fail(fence, "once", "late failure")
    with pytest.raises(StepNotRunning, match="never started"):
        await repo.succeed(fence, "unknown", OUTPUT)
    assert await step_rows(db, fence.run_id) == before


async def test_list_orders_steps_by_start_then_key(db: DatabaseManager, tenants: Tenants) -> None:
    repo = StepsRepo(db)
    _, fence = await new_run(db, tenants)
    for key in ["c", "a", "b"]:
        await run_step(repo, fence, key, Counted(key))
    listed = await repo.list(fence.run_id)
    assert {s.key for s in listed} == {"a", "b", "c"}
    assert listed == sorted(listed, key=lambda s: (s.started_at, s.key))
    assert await repo.list(RunId(unique("no-such-run"))) == []
    assert await repo.get(fence.run_id, "missing") is None


async def test_concurrent_starts_from_two_fences_only_the_live_one_wins(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = StepsRepo(db)
    lane, stale = await new_run(db, tenants, "zombie")
    live = await reclaim(db, lane, stale, "live")
    calls = [repo.start(fence, "shared", "fn", "h1") for fence in [stale, live] * (RACERS // 2)]
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    for fence, outcome in zip([stale, live] * (RACERS // 2), outcomes, strict=True):
        if fence is stale:
            assert isinstance(outcome, LeaseLost), outcome
        else:
            assert not isinstance(outcome, BaseException), outcome
            assert outcome.step.attempt == live.attempt
    [row] = await step_rows(db, live.run_id)
    assert (row["status"], row["attempt"]) == (StepStatus.RUNNING.value, live.attempt)
    await repo.succeed(live, "shared", "won")
    with pytest.raises(LeaseLost):
        await repo.succeed(stale, "shared", "lost")


async def test_starts_racing_a_reclaim_leave_the_step_to_the_new_attempt(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = StepsRepo(db)
    lane, old = await new_run(db, tenants, "old")

    async def take_over() -> Fence:
        new = await reclaim(db, lane, old, "new")
        results = await asyncio.gather(
            *(repo.start(new, "shared", "fn", "h2") for _ in range(RECLAIM_RACERS))
        )
        assert all(r.step.attempt == new.attempt for r in results)
        return new

    outcomes = await asyncio.gather(
        take_over(),
        *(repo.start(old, "shared", "fn", "h1") for _ in range(RECLAIM_RACERS)),
        return_exceptions=True,
    )
    new = outcomes[0]
    assert isinstance(new, Fence), new
    for outcome in outcomes[1:]:
        # The old attempt either got in before the reclaim or was refused; never an error else.
        assert isinstance(outcome, LeaseLost) or (
            isinstance(outcome, StepStart) and outcome.step.attempt == old.attempt
        ), outcome
    [row] = await step_rows(db, new.run_id)
    assert (row["attempt"], row["call_hash"]) == (new.attempt, "h2")
    with pytest.raises(LeaseLost):
        await repo.succeed(old, "shared", "old")
    await repo.succeed(new, "shared", "new")
    step = await repo.get(new.run_id, "shared")
    assert step is not None and step.output == "new"
    assert await QueueRepo(db).renew_lease(new, TTL_S)


async def test_insert_new_starts_a_step_in_one_statement_and_a_finish_takes_one(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = StepsRepo(db)
    _, fence = await new_run(db, tenants)
    with data_statements(db, "steps") as started:
        assert await repo.insert_new(fence, "fast", "fn", "h1") is True
    assert len(started) == 1, started
    step = await repo.get(fence.run_id, "fast")
    assert step is not None
    assert (step.status, step.attempt, step.function, step.call_hash) == (
        StepStatus.RUNNING,
        fence.attempt,
        "fn",
        "h1",
    )
    assert step.output is None and step.finished_at is None
    with data_statements(db, "steps") as finished:
        await repo.succeed(fence, "fast", OUTPUT)
    assert len(finished) == 1, finished
    with data_statements(db, "steps") as failed:
        assert await repo.insert_new(fence, "flaky", "fn", "h1") is True
        await repo.fail(fence, "flaky", "ValueError: boom")
    assert len(failed) == 2, failed
    # What the engine does next: the full start replays the one and takes the other over.
    replayed = await repo.start(fence, "fast", "fn", "h1")
    assert (replayed.replay, replayed.step.output) == (True, OUTPUT)
    retried = await repo.start(fence, "flaky", "fn", "h1")
    assert (retried.replay, retried.repeated) == (False, True)


async def test_insert_new_leaves_an_existing_step_to_start(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = StepsRepo(db)
    _, fence = await new_run(db, tenants)
    await run_step(repo, fence, "done", Counted(OUTPUT))
    await repo.start(fence, "in_flight", "fn", "h1")
    before = await step_rows(db, fence.run_id)
    # Also a different call: insert_new never judges an existing row, start() does.
    for key, call_hash in [("done", "h1"), ("in_flight", "h1"), ("done", "h2")]:
        assert await repo.insert_new(fence, key, "fn", call_hash) is False
    assert await step_rows(db, fence.run_id) == before


async def test_insert_new_of_a_key_equal_to_a_recorded_one_defers_to_start(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = StepsRepo(db)
    _, fence = await new_run(db, tenants)
    assert await repo.insert_new(fence, "Key", "fn", "h1") is True
    await repo.succeed(fence, "Key", "upper")
    if await repo.insert_new(fence, "key", "fn", "h1"):
        await repo.succeed(fence, "key", "lower")
        lower = await repo.get(fence.run_id, "key")
        assert lower is not None and lower.output == "lower"
    else:
        # MySQL/MariaDB's collation: the same row; start() refuses instead of replaying it.
        with pytest.raises(StepMismatch, match="collides"):
            await repo.start(fence, "key", "fn", "h1")
    upper = await repo.get(fence.run_id, "Key")
    assert upper is not None and upper.output == "upper"


async def test_insert_new_refuses_a_run_with_a_recorded_cancel(
    db: DatabaseManager, tenants: Tenants
) -> None:
    repo = StepsRepo(db)
    _, fence = await new_run(db, tenants)
    assert await repo.insert_new(fence, "in_flight", "fn", "h1")
    async with db.transaction() as conn:
        await conn.execute(
            update(runs)
            .where(runs.c.id == fence.run_id)
            .values(cancel_requested_at=db.backend.now())
        )
    with pytest.raises(CancelRequested):
        await repo.insert_new(fence, "next", "fn", "h1")
    await repo.succeed(fence, "in_flight", "kept")
    assert [(row["key"], row["output"]) for row in await step_rows(db, fence.run_id)] == [
        ("in_flight", "kept")
    ]


def taken(change: str, db: DatabaseManager) -> dict[str, Any]:
    """What another writer does to the run while one-statement step writes wait for its lock."""
    if change == "reclaim":
        return {"attempt": runs.c.attempt + 1, "lease_owner": "next"}
    return {"cancel_requested_at": db.backend.now()}


@pytest.mark.parametrize("change", ["reclaim", "cancel"])
async def test_one_statement_writes_waiting_for_the_run_lock_test_the_fence_after_it(
    db: DatabaseManager, tenants: Tenants, change: str
) -> None:
    repo = StepsRepo(db)
    _, fence = await new_run(db, tenants)
    await repo.start(fence, "in_flight", "fn", "h1")
    values = taken(change, db)
    async with db.write_transaction() as conn:
        # The run's row lock, held as a reclaim or RunsRepo.request_cancel holds it.
        await conn.execute(update(runs).where(runs.c.id == fence.run_id).values(**values))
        starting = asyncio.create_task(repo.insert_new(fence, "next", "fn", "h1"))
        finishing = asyncio.create_task(repo.succeed(fence, "in_flight", "late"))
        # Not a synchronisation: were the writes slower to reach the lock than this, they
        # would find the change committed, and the assertions below would hold all the same.
        await asyncio.sleep(0.3)
        assert not starting.done() and not finishing.done()
    if change == "reclaim":
        for write in (starting, finishing):
            with pytest.raises(LeaseLost):
                await write
        [row] = await step_rows(db, fence.run_id)
        assert (row["key"], row["status"]) == ("in_flight", StepStatus.RUNNING.value)
        return
    with pytest.raises(CancelRequested):
        await starting
    await finishing  # a running step still records its result after a cancel
    [row] = await step_rows(db, fence.run_id)
    assert (row["key"], row["status"], row["output"]) == (
        "in_flight",
        StepStatus.SUCCEEDED.value,
        "late",
    )


async def test_the_fence_of_the_statements_built_once_is_the_fence(db: DatabaseManager) -> None:
    fence = Fence(run_id=RunId("run-1"), attempt=Attempt(3), owner="worker-7")
    dialect = db.engine.dialect

    def sql(clause: Any) -> str:
        return str(clause.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))

    built_once = select(runs.c.id).where(fence_by_parameters()).params(fence_parameters(fence))
    assert sql(built_once) == sql(select(runs.c.id).where(fence.clause()))


@pytest.mark.parametrize("path", ["insert_new", "start"])
async def test_steps_are_listed_in_the_order_they_started_even_within_one_instant(
    db: DatabaseManager, tenants: Tenants, path: str
) -> None:
    repo = StepsRepo(db)
    _, fence = await new_run(db, tenants)
    for key in ("outline", "draft", "review", "a_final_check"):
        if path == "insert_new":
            assert await repo.insert_new(fence, key, "fn", "h")
        else:
            assert not (await repo.start(fence, key, "fn", "h")).replay
    # The same instant for all (SQLite keeps milliseconds): only the start order tells them apart.
    async with db.transaction() as conn:
        same = (
            await conn.execute(select(runs.c.created_at).where(runs.c.id == fence.run_id))
        ).scalar_one()
        await conn.execute(
            update(steps).where(steps.c.run_id == fence.run_id).values(started_at=same)
        )
    listed = [step.key for step in await repo.list(fence.run_id)]
    assert listed == ["outline", "draft", "review", "a_final_check"]
