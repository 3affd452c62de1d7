"""The Worker in-process on every backend: draining, retries, slots, lost leases, shutdown."""

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import pytest
from sqlalchemy import event, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from moorline.db.manager import DatabaseManager
from moorline.db.repos.handoffs import HandoffsRepo
from moorline.db.repos.queue import QueueRepo, Renewal
from moorline.db.repos.records import Fence
from moorline.db.schema import runs
from moorline.dispatch.retry import RetryPolicy
from moorline.dispatch.wakeups import LocalWakeups
from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.engine.runner import WorkflowRunner
from moorline.observability.metrics import Metrics
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.settings import Settings
from moorline.worker.completions import Completer
from moorline.worker.handoffs import Handoffs
from moorline.worker.lanes import Waiter
from moorline.worker.process import with_worker_pool
from moorline.worker.worker import Worker, WorkerCrashed
from tests.contract.queue_helpers import (
    Tenants,
    add_runs,
    event_counts,
    event_types,
    no_caps,
    set_lease_expiry,
    statuses,
    unique,
)
from tests.helpers import sampled, wait_for
from tests.servers import run_sql

NO_BACKOFF = RetryPolicy(base_s=0.0, cap_s=0.0)


class Probe:
    """What the test workflows saw: concurrency, cancellations, a gate to hold them."""

    def __init__(self) -> None:
        self.active = 0
        self.most_active = 0
        self.cancelled = 0
        self.gate = asyncio.Event()
        self.entered = 0
        self.held: dict[str, asyncio.Event] = {}
        """Each ``held`` run's own gate, by run id, in the order they started."""

    async def has_held(self, count: int) -> bool:
        """Whether ``count`` runs of the ``held`` workflow have started."""
        return len(self.held) == count


async def _one() -> int:
    return 1


def make_app(probe: Probe) -> Moorline:
    app = Moorline()

    @app.workflow("noop")
    async def noop(ctx: Context) -> dict[str, Any]:
        return {"attempt": ctx.attempt}

    @app.workflow("stepped")
    async def stepped(ctx: Context) -> None:
        await ctx.step("one", _one)

    @app.workflow("counted")
    async def counted(ctx: Context) -> None:
        probe.active += 1
        probe.most_active = max(probe.most_active, probe.active)
        try:
            await asyncio.sleep(0.005)  # long enough for the other slots' runs to overlap
        finally:
            probe.active -= 1

    @app.workflow("held")
    async def held(ctx: Context) -> None:
        await probe.held.setdefault(ctx.run_id, asyncio.Event()).wait()

    @app.workflow("boom")
    async def boom(ctx: Context) -> None:
        raise ValueError(f"boom on attempt {ctx.attempt}")

    @app.workflow("misused")
    async def misused(ctx: Context) -> None:
        raise TypeError("a bug no retry cures")

    @app.workflow("gated")
    async def gated(ctx: Context) -> str:
        probe.active += 1
        probe.entered += 1
        probe.most_active = max(probe.most_active, probe.active)
        try:
            await probe.gate.wait()
        except asyncio.CancelledError:
            probe.cancelled += 1
            raise
        finally:
            probe.active -= 1
        return "opened"

    return app


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


async def set_workflow(db: DatabaseManager, run_ids: Sequence[str], workflow: str) -> None:
    async with db.transaction() as conn:
        await conn.execute(runs.update().where(runs.c.id.in_(run_ids)).values(workflow=workflow))


class Running:
    """A Worker running in a task of this event loop, stopped and awaited on exit."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> "Running":
        self.task = asyncio.create_task(self.worker.run(self.stop))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        assert self.task is not None
        await asyncio.wait_for(self.task, 30)


def make_runner(db: DatabaseManager, probe: Probe) -> WorkflowRunner:
    return WorkflowRunner(make_app(probe), db=db, store=InMemoryRuntimeStore(), settings=Settings())


def make_worker(
    db: DatabaseManager,
    probe: Probe,
    lanes: Mapping[str, int],
    *,
    lease_ttl_s: float = 30.0,
    grace_s: float = 5.0,
    metrics: Metrics | None = None,
) -> Worker:
    return Worker(
        db,
        make_runner(db, probe),
        lanes=lanes,
        lease_ttl_s=lease_ttl_s,
        tenant_caps=no_caps,
        retry_policy=NO_BACKOFF,
        poll_interval_s=0.05,
        grace_s=grace_s,
        metrics=metrics,
    )


async def all_in(db: DatabaseManager, run_ids: Sequence[str], status: str) -> bool:
    return all(s == status for s, _ in (await statuses(db, run_ids)).values())


async def test_a_worker_drains_its_lane_and_each_run_succeeds_once(
    db: DatabaseManager, tenants: Tenants
) -> None:
    lane = unique("lane")
    run_ids = await add_runs(db, await tenants.new(), lane, 120)
    async with Running(make_worker(db, Probe(), {lane: 8})):
        await wait_for(lambda: all_in(db, run_ids, "succeeded"), message="all runs succeeded")
    assert set((await event_counts(db, run_ids, "succeeded")).values()) == {1}
    assert await event_types(db, run_ids[0]) == ["started", "succeeded"]
    async with db.connect() as conn:
        outputs = (await conn.execute(select(runs.c.output).where(runs.c.id == run_ids[0]))).one()
    assert outputs.output == {"attempt": 1}


async def test_a_worker_process_keeps_its_connections_through_a_drain(
    settings: Settings, db: DatabaseManager, tenants: Tenants
) -> None:
    # Eight slots over the default pool (5 kept, 10 more at peaks) used to open and close a
    # connection every few runs of a checkpointed step: the slots are steady demand, not a peak.
    # Then a heartbeat or presence beat that came while every slot held a connection opened
    # one more (seen once in CI): the short lease brings heartbeats (every second) into the
    # drain. Not shorter: no reaper runs here, so a run self-fenced by a stall of the loaded
    # machine (renewals late by 1.25 s, with a lease of 1.5 s, in CI) never ended. Then, with a
    # loaded machine stretching runs past the event writer's flush timer, every run's progress
    # events were written beside its step's checkpoint: two connections a slot (seen in CI).
    if db.backend.name == "sqlite":
        pytest.skip("SQLite has one connection and no pool")
    lane = unique("lane")
    pooled = with_worker_pool(settings, {lane: 8})
    worker_db = DatabaseManager(pooled)
    opened: Counter[int] = Counter()
    for index, engine in enumerate(worker_db.engines):  # MariaDB's autocommit pool too
        event.listen(engine.sync_engine, "connect", lambda *_, i=index: opened.update([i]))
    run_ids = await add_runs(db, await tenants.new(), lane, 600, workflow="stepped")
    try:
        async with Running(make_worker(worker_db, Probe(), {lane: 8}, lease_ttl_s=3.0)):
            # 600 runs of a step: seconds on a quiet machine, more with CI loading MariaDB.
            await wait_for(
                lambda: all_in(db, run_ids, "succeeded"),
                timeout_s=60.0,
                message="all runs succeeded",
            )
    finally:
        await worker_db.dispose()
    assert opened and max(opened.values()) <= pooled.db_pool_size, (opened, pooled.db_pool_size)


async def test_a_failing_run_is_retried_then_fails_with_its_last_error(
    db: DatabaseManager, tenants: Tenants
) -> None:
    lane = unique("lane")
    [run_id] = await add_runs(db, await tenants.new(), lane, 1, max_attempts=3)
    await set_workflow(db, [run_id], "boom")
    metrics = Metrics()
    async with Running(make_worker(db, Probe(), {lane: 2}, metrics=metrics)):
        await wait_for(lambda: all_in(db, [run_id], "failed"), message="run failed")
    assert (await statuses(db, [run_id]))[run_id] == ("failed", 3)
    assert sampled(metrics.retries, "moorline_retries_total", lane=lane) == 2
    durations = "moorline_run_duration_seconds_count"
    assert sampled(metrics.run_duration_s, durations, lane=lane, outcome="retried") == 2
    assert sampled(metrics.run_duration_s, durations, lane=lane, outcome="failed") == 1
    latencies = "moorline_dispatch_latency_seconds_count"
    assert sampled(metrics.dispatch_latency_s, latencies, lane=lane) == 3
    assert await event_types(db, run_id) == [
        "started",
        "retrying",
        "started",
        "retrying",
        "started",
        "failed",
    ]
    async with db.connect() as conn:
        error = (await conn.execute(select(runs.c.error).where(runs.c.id == run_id))).scalar_one()
    assert error["message"] == "boom on attempt 3"
    assert error["reason"] == "max attempts"


async def test_a_non_retryable_error_fails_the_run_at_once(
    db: DatabaseManager, tenants: Tenants
) -> None:
    lane = unique("lane")
    [run_id] = await add_runs(db, await tenants.new(), lane, 1, max_attempts=5)
    await set_workflow(db, [run_id], "misused")
    async with Running(make_worker(db, Probe(), {lane: 2})):
        await wait_for(lambda: all_in(db, [run_id], "failed"), message="run failed")
    assert (await statuses(db, [run_id]))[run_id] == ("failed", 1)


async def test_a_lane_never_runs_more_than_its_slots(db: DatabaseManager, tenants: Tenants) -> None:
    probe = Probe()
    lane, other = unique("lane"), unique("lane")
    tenant = await tenants.new()
    run_ids = await add_runs(db, tenant, lane, 10)
    other_ids = await add_runs(db, tenant, other, 3)
    await set_workflow(db, run_ids + other_ids, "gated")
    async with Running(make_worker(db, probe, {lane: 2, other: 3})):
        # Both lanes fill their own slots; the flooded lane never borrows the other's.
        await wait_for(lambda: _entered(probe, 5), message="five gated runs entered")
        counts = await statuses(db, run_ids)
        assert sum(1 for s, _ in counts.values() if s == "running") == 2
        probe.gate.set()
        await wait_for(lambda: all_in(db, run_ids + other_ids, "succeeded"), message="drained")
    assert probe.most_active == 5


async def _entered(probe: Probe, count: int) -> bool:
    return probe.entered >= count


async def test_a_reclaimed_run_is_stopped_within_a_heartbeat_and_writes_nothing(
    db: DatabaseManager, tenants: Tenants
) -> None:
    probe = Probe()
    lane = unique("lane")
    [run_id] = await add_runs(db, await tenants.new(), lane, 1)
    await set_workflow(db, [run_id], "gated")
    metrics = Metrics()
    worker = make_worker(db, probe, {lane: 1}, lease_ttl_s=0.9, metrics=metrics)
    async with Running(worker):
        await wait_for(lambda: _entered(probe, 1), message="run started")
        # The reaper takes the run back (as if this worker had been paused past its lease);
        # hold the slot busy so the worker does not simply claim it again.
        await set_lease_expiry(db, [run_id], -1.0)
        [reaped] = await QueueRepo(db).reap_expired()
        assert reaped.run_id == run_id
        await set_workflow(db, [run_id], "unknown-to-this-worker")
        await wait_for(
            lambda: _cancelled(probe), timeout_s=worker.heartbeat_interval_s + 1.0, message="stop"
        )
    assert "succeeded" not in await event_types(db, run_id)
    assert sampled(metrics.lease_losses, "moorline_lease_losses_total", lane=lane) == 1


async def _cancelled(probe: Probe) -> bool:
    return probe.cancelled >= 1


async def test_stop_releases_runs_that_outlive_the_grace_period(
    db: DatabaseManager, tenants: Tenants
) -> None:
    probe = Probe()
    lane = unique("lane")
    run_ids = await add_runs(db, await tenants.new(), lane, 2)
    await set_workflow(db, run_ids, "gated")
    async with Running(make_worker(db, probe, {lane: 2}, grace_s=0.1)):
        await wait_for(lambda: _entered(probe, 2), message="both runs started")
    # Back in the queue at once, lease cleared, the old attempt fenced out by the next claim.
    assert await statuses(db, run_ids) == {run_id: ("queued", 1) for run_id in run_ids}
    assert await event_types(db, run_ids[0]) == ["started", "released"]
    assert probe.cancelled == 2


async def test_a_dying_loop_crashes_the_worker_instead_of_limping_on(
    db: DatabaseManager, tenants: Tenants
) -> None:
    lane = unique("lane")
    await add_runs(db, await tenants.new(), lane, 1)

    async def broken_caps() -> dict[str, int]:
        raise RuntimeError("plans unreadable")

    worker = Worker(
        db,
        make_runner(db, Probe()),
        lanes={lane: 1},
        lease_ttl_s=30.0,
        tenant_caps=broken_caps,
    )
    with pytest.raises(WorkerCrashed, match="plans unreadable"):
        await asyncio.wait_for(worker.run(asyncio.Event()), 10)


@pytest.mark.requires("terminate_backend")
async def test_a_worker_outlives_a_database_that_drops_and_refuses_its_connections(
    db: DatabaseManager, tenants: Tenants, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The fault the chaos soak found: pg_terminate_backend under a claim crashed the worker.
    # Here every connection is cut and new ones are refused for a while, so claims fail for
    # certain; the worker must keep trying and drain the lane once the database is back.
    lane = unique("lane")
    name = make_url(database_url).database
    tenant = await tenants.new()
    running = Running(make_worker(db, Probe(), {lane: 4}))
    with caplog.at_level(logging.WARNING, logger="moorline.worker.worker"):
        async with running:
            run_sql("postgresql", f"ALTER DATABASE {name} ALLOW_CONNECTIONS false")
            try:
                run_sql(
                    "postgresql",
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    f"WHERE datname = '{name}' AND pid <> pg_backend_pid()",
                )

                async def claims_failed() -> bool:
                    return any("claim in lane" in r.getMessage() for r in caplog.records)

                await wait_for(claims_failed, message="a claim to fail")
                assert running.task is not None and not running.task.done()
            finally:
                run_sql("postgresql", f"ALTER DATABASE {name} ALLOW_CONNECTIONS true")
            run_ids = await add_runs(db, tenant, lane, 20)
            await wait_for(lambda: all_in(db, run_ids, "succeeded"), message="the lane drained")


def slow_polling_worker(
    db: DatabaseManager,
    lanes: Mapping[str, int],
    *,
    caps: Mapping[str, int] | None = None,
    retry_policy: RetryPolicy = NO_BACKOFF,
    waiter: Waiter | None = None,
    probe: Probe | None = None,
) -> Worker:
    """A worker whose slow poll never comes within a test: only local reasons (and the
    ``waiter``'s wake-ups) make it claim."""

    async def tenant_caps() -> Mapping[str, int]:
        return caps if caps is not None else await no_caps()

    return Worker(
        db,
        make_runner(db, probe or Probe()),
        lanes=lanes,
        lease_ttl_s=30.0,
        tenant_caps=tenant_caps,
        retry_policy=retry_policy,
        waiter=waiter,
        poll_interval_s=60.0,
    )


async def test_a_slot_freed_under_a_tenant_cap_is_used_at_once(
    db: DatabaseManager, tenants: Tenants
) -> None:
    # The tenant may run one run at a time, so every claim leaves runs behind; each finished
    # run must make the worker claim the next without waiting for the (minute-long) poll.
    lane = unique("lane")
    run_ids = await add_runs(db, await tenants.new("one_at_a_time"), lane, 4)
    async with Running(slow_polling_worker(db, {lane: 4}, caps={"one_at_a_time": 1})):
        await wait_for(lambda: all_in(db, run_ids, "succeeded"), message="the capped runs")


async def test_runs_ending_under_a_cap_hand_their_slots_to_the_next_claim(
    db: DatabaseManager, tenants: Tenants
) -> None:
    # Three slots, a tenant cap of two: every claim leaves runs behind, so the loop waits for
    # freed slots and each ending run's outcome is written with the next claim. The cap must
    # hold all the same: the claim counts the runs it just ended as ended, no more.
    probe = Probe()
    lane = unique("lane")
    run_ids = await add_runs(db, await tenants.new("two_at_a_time"), lane, 40)
    await set_workflow(db, run_ids, "counted")
    worker = slow_polling_worker(db, {lane: 3}, caps={"two_at_a_time": 2}, probe=probe)
    async with Running(worker):
        await wait_for(lambda: all_in(db, run_ids, "succeeded"), message="the capped runs")
    assert probe.most_active == 2
    # How many outcomes wait for a claim rather than the group commit is the machine's timing
    # (a loaded run hands fewer); without the handoff it is none.
    assert worker.handed_off >= 10, worker.handed_off
    assert set((await event_counts(db, run_ids, "succeeded")).values()) == {1}
    assert set((await event_counts(db, run_ids, "started")).values()) == {1}


class HeldClaim:
    """The lane's first claim that writes handed outcomes, held open until ``may_go``.

    With ``fails``, that claim then fails as a dropped connection would. Records where every
    outcome went: ``handed`` to the claim loop, or ``grouped`` through the group commit (run
    ids, in order).
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, fails: bool = False) -> None:
        self.entered, self.may_go = asyncio.Event(), asyncio.Event()
        self.handed: list[str] = []
        self.grouped: list[str] = []
        finish_and_claim = HandoffsRepo.finish_and_claim
        hand, complete = Handoffs.hand, Completer.complete

        async def held_first(repo: HandoffsRepo, outcomes: Any, request: Any) -> Any:
            if not self.entered.is_set():
                self.entered.set()
                await self.may_go.wait()
                if fails:
                    dropped = ConnectionResetError("the connection dropped")
                    raise OperationalError("SELECT 1", {}, dropped)
            return await finish_and_claim(repo, outcomes, request)

        def counted_hand(handoffs: Handoffs[Any], lane: str, execution: Any, outcome: Any) -> Any:
            self.handed.append(outcome.fence.run_id)
            return hand(handoffs, lane, execution, outcome)

        async def counted_complete(completer: Completer, outcome: Any) -> bool:
            self.grouped.append(outcome.fence.run_id)
            return await complete(completer, outcome)

        monkeypatch.setattr(HandoffsRepo, "finish_and_claim", held_first)
        monkeypatch.setattr(Handoffs, "hand", counted_hand)
        monkeypatch.setattr(Completer, "complete", counted_complete)


async def test_a_run_that_ends_during_a_claim_hands_its_outcome_to_the_next(
    db: DatabaseManager, tenants: Tenants, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Three slots, a tenant cap of two: the loop always wants a slot. The first run's outcome
    # goes with a claim that is held open; the second run ends meanwhile, and its outcome must
    # wait for the claim after it, not become a group commit of its own.
    probe = Probe()
    lane = unique("lane")
    run_ids = await add_runs(db, await tenants.new("two_at_a_time"), lane, 4)
    await set_workflow(db, run_ids, "held")
    claim = HeldClaim(monkeypatch)
    worker = slow_polling_worker(db, {lane: 3}, caps={"two_at_a_time": 2}, probe=probe)

    async def both_outcomes_given() -> bool:
        return len(claim.handed) + len(claim.grouped) == 2

    async with Running(worker):
        await wait_for(lambda: probe.has_held(2), message="two runs started")
        first, second = probe.held.values()
        first.set()
        await claim.entered.wait()
        second.set()
        await wait_for(both_outcomes_given, message="the second outcome")
        claim.may_go.set()
        await wait_for(lambda: probe.has_held(4), message="the other two started")
        for gate in probe.held.values():
            gate.set()
        await wait_for(lambda: all_in(db, run_ids, "succeeded"), message="the runs")
    assert len(claim.handed) >= 2 and claim.grouped == [], claim.grouped
    assert set((await event_counts(db, run_ids, "succeeded")).values()) == {1}


async def test_outcomes_handed_during_a_claim_that_fails_go_to_the_group_commit(
    db: DatabaseManager, tenants: Tenants, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As above, but the held claim fails: the loop pauses before it claims again, and the
    # outcome handed meanwhile must not wait out that pause.
    probe = Probe()
    lane = unique("lane")
    run_ids = await add_runs(db, await tenants.new("two_at_a_time"), lane, 2)
    await set_workflow(db, run_ids, "held")
    claim = HeldClaim(monkeypatch, fails=True)
    worker = slow_polling_worker(db, {lane: 3}, caps={"two_at_a_time": 2}, probe=probe)

    async def second_handed() -> bool:
        return second in claim.handed

    async with Running(worker):
        await wait_for(lambda: probe.has_held(2), message="two runs started")
        (first, first_gate), (second, second_gate) = probe.held.items()
        first_gate.set()
        await claim.entered.wait()
        second_gate.set()
        await wait_for(second_handed, message="the second outcome handed during the claim")
        claim.may_go.set()
        await wait_for(lambda: all_in(db, run_ids, "succeeded"), message="the runs")
    # Both through the group commit: the first from the failed claim, the second handed
    # during it and passed on at the failure.
    assert sorted(claim.grouped) == sorted([first, second])
    assert set((await event_counts(db, run_ids, "succeeded")).values()) == {1}


async def test_a_failed_handoff_writes_its_outcomes_through_the_group_commit(
    db: DatabaseManager, tenants: Tenants, monkeypatch: pytest.MonkeyPatch
) -> None:
    lane = unique("lane")
    run_ids = await add_runs(db, await tenants.new("one_at_a_time"), lane, 6)
    failed: list[int] = []
    finish_and_claim = HandoffsRepo.finish_and_claim

    async def failing_once(self: HandoffsRepo, *args: Any, **kwargs: Any) -> Any:
        if not failed:
            failed.append(1)
            raise OperationalError("SELECT 1", {}, ConnectionResetError("the connection dropped"))
        return await finish_and_claim(self, *args, **kwargs)

    monkeypatch.setattr(HandoffsRepo, "finish_and_claim", failing_once)
    worker = slow_polling_worker(db, {lane: 2}, caps={"one_at_a_time": 1})
    async with Running(worker):
        await wait_for(lambda: all_in(db, run_ids, "succeeded"), message="the capped runs")
    assert failed and worker.handed_off >= 1
    assert set((await event_counts(db, run_ids, "succeeded")).values()) == {1}


async def test_a_slot_its_stopped_execution_freed_is_not_freed_again_by_the_handoff(
    db: DatabaseManager, tenants: Tenants, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One slot and no cap. The first run hands its outcome over; before the handoff commits,
    # its execution is stopped (as its self-fence would stop it) and frees its slot as it ends.
    # The handoff must not free that slot a second time, or the lane claims past its slot.
    probe = Probe()
    lane = unique("lane")
    run_ids = await add_runs(db, await tenants.new(), lane, 6)
    await set_workflow(db, run_ids, "counted")
    stopped: list[str] = []
    finish_and_claim = HandoffsRepo.finish_and_claim

    async def stopping_the_first(self: HandoffsRepo, outcomes: Any, request: Any) -> Any:
        if not stopped:
            fence = outcomes[0].fence
            [task] = [
                t
                for t in asyncio.all_tasks()
                if t.get_name() == f"run:{fence.run_id}:{fence.attempt}"
            ]
            task.cancel()
            await asyncio.wait([task])
            stopped.append(fence.run_id)
        return await finish_and_claim(self, outcomes, request)

    monkeypatch.setattr(HandoffsRepo, "finish_and_claim", stopping_the_first)
    worker = slow_polling_worker(db, {lane: 1}, probe=probe)
    async with Running(worker):
        await wait_for(lambda: all_in(db, run_ids, "succeeded"), message="the runs")
    assert stopped and probe.most_active == 1
    assert worker.in_flight == 0


async def test_a_retry_is_claimed_once_its_delay_has_passed(
    db: DatabaseManager, tenants: Tenants
) -> None:
    # Nothing announces a retry becoming due; the worker that wrote it looks again then.
    lane = unique("lane")
    [run_id] = await add_runs(db, await tenants.new(), lane, 1, max_attempts=3)
    await set_workflow(db, [run_id], "boom")
    short_backoff = RetryPolicy(base_s=0.2, cap_s=0.2)
    async with Running(slow_polling_worker(db, {lane: 2}, retry_policy=short_backoff)):
        await wait_for(lambda: all_in(db, [run_id], "failed"), message="three attempts")
    assert (await statuses(db, [run_id]))[run_id] == ("failed", 3)


async def test_a_run_that_ends_during_a_heartbeat_has_not_lost_its_lease(
    db: DatabaseManager, tenants: Tenants, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The heartbeat's renewal runs while the run ends: the renewal misses the finished run,
    # which must not count as a lost lease (nor re-arm a self-fence that fires later).
    probe = Probe()
    lane = unique("lane")
    [run_id] = await add_runs(db, await tenants.new(), lane, 1)
    await set_workflow(db, [run_id], "gated")
    metrics = Metrics()
    worker = make_worker(db, probe, {lane: 1}, lease_ttl_s=0.6, metrics=metrics)
    renew = QueueRepo.renew_leases
    raced = asyncio.Event()

    async def renew_as_the_run_ends(
        self: QueueRepo, fences: Sequence[Fence], lease_ttl_s: float
    ) -> Renewal:
        if raced.is_set():
            return await renew(self, fences, lease_ttl_s)
        probe.gate.set()

        async def ended() -> bool:
            return worker.finished >= 1

        await wait_for(ended, message="the run to end")
        raced.set()
        return Renewal(renewed=frozenset(), cancel_requested=frozenset())

    monkeypatch.setattr(QueueRepo, "renew_leases", renew_as_the_run_ends)
    async with Running(worker):
        await wait_for(lambda: _entered(probe, 1), message="run started")
        await asyncio.wait_for(raced.wait(), 10)
    assert (await statuses(db, [run_id]))[run_id] == ("succeeded", 1)
    assert sampled(metrics.lease_losses, "moorline_lease_losses_total", lane=lane) == 0


async def test_runs_whose_leases_cannot_be_renewed_stop_at_their_self_fence(
    db: DatabaseManager, tenants: Tenants, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every run of the claimed batch shares one self-fence deadline; when no heartbeat gets
    # through, each of them is stopped by it and writes nothing more.
    probe = Probe()
    lane = unique("lane")
    run_ids = await add_runs(db, await tenants.new(), lane, 3)
    await set_workflow(db, run_ids, "gated")
    metrics = Metrics()
    worker = make_worker(db, probe, {lane: 3}, lease_ttl_s=0.9, metrics=metrics)

    async def unreachable(self: QueueRepo, fences: Sequence[Fence], lease_ttl_s: float) -> Renewal:
        raise ConnectionError("database unreachable")

    monkeypatch.setattr(QueueRepo, "renew_leases", unreachable)
    async with Running(worker):
        await wait_for(lambda: _entered(probe, 3), message="the batch started")
        await wait_for(lambda: _all_cancelled(probe, 3), timeout_s=5.0, message="self-fenced")
        await wait_for(lambda: _none_in_flight(worker), message="the executions ended")
    assert await statuses(db, run_ids) == {run_id: ("running", 1) for run_id in run_ids}
    assert sampled(metrics.lease_losses, "moorline_lease_losses_total", lane=lane) == 3


async def _none_in_flight(worker: Worker) -> bool:
    return worker.in_flight == 0


async def _all_cancelled(probe: Probe, count: int) -> bool:
    return probe.cancelled >= count


async def test_a_wake_up_makes_a_waiting_worker_claim_at_once(
    db: DatabaseManager, tenants: Tenants
) -> None:
    lane = unique("lane")
    tenant = await tenants.new()
    wakeups = LocalWakeups()
    worker = slow_polling_worker(db, {lane: 2}, waiter=wakeups)
    async with Running(worker):
        # The lane is empty: the worker's first claim finds nothing and it waits.
        await wait_for(lambda: _waiting(worker), message="the worker waits")
        run_ids = await add_runs(db, tenant, lane, 1)
        await wakeups.notify({lane})
        await wait_for(lambda: all_in(db, run_ids, "succeeded"), message="the woken claim")


async def _waiting(worker: Worker) -> bool:
    return worker.claim_transactions >= 1


async def test_a_broken_waiter_crashes_the_worker_instead_of_spinning(
    db: DatabaseManager, tenants: Tenants
) -> None:
    lane = unique("lane")

    class Broken:
        async def wait(
            self, lane: str, timeout_s: float, *, seen_before: float | None = None
        ) -> bool:
            raise RuntimeError("listener died")

    worker = slow_polling_worker(db, {lane: 1}, waiter=Broken())
    with pytest.raises(WorkerCrashed, match="listener died"):
        await asyncio.wait_for(worker.run(asyncio.Event()), 10)
