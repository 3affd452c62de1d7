"""Child runs across real faults, with real worker processes (issue 17).

Worker processes (``moorline worker``) run ``tests/faults/children_app.py``: ``fan`` parents
start ``leaf`` children and join them. The tests kill -9 a parent's worker between a child's
start and the parent's next checkpoint, kill the workers running children mid-fan-out, cancel
a parent during its fan-out, and SIGSTOP a parent's worker past its lease while its children
finish. Each checks: every run ended exactly once, exactly one child per ``(parent, key)``,
the parent joined every child's result once, and (cancel) every descendant ended
``cancelled`` with no step started after its cancel was recorded.

SQLite workers each have their own in-memory RuntimeStore (a cancel reaches them through their
heartbeat); on the servers they share Redis with the test. CI runs SQLite and PostgreSQL at
CI size; ``MOORLINE_FULL=1`` every backend, at the issue's size.
"""

import signal
import subprocess
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import pytest
from sqlalchemy import select

from moorline.db.manager import DatabaseManager
from moorline.db.repos.children import ChildrenRepo
from moorline.db.repos.runs import RunsRepo
from moorline.db.schema import events, runs, steps
from moorline.dispatch.cancel import cancel_run
from moorline.types import JSONObject, JSONValue, RunId, RunStatus, TenantId
from tests.conftest import BACKENDS
from tests.contract.queue_helpers import Tenants
from tests.faults.children_app import MAX_ATTEMPTS
from tests.faults.harness import (
    PLAN,
    RECOVERY_BOUND_S,
    Workers,
    owner_pattern,
    pause_between_transactions,
    submit,
)
from tests.faults.suspension import count_by_status, read_effects, running_under
from tests.faults.test_cancel_faults import Runtime, started_after_cancel
from tests.faults.test_cancel_faults import runtime as cancel_runtime
from tests.helpers import FULL_SIZE, wait_for

pytestmark = pytest.mark.faults

CI_BACKENDS = ["sqlite", "postgresql"]
KILLS = 2
SETTLE_S = 60 + KILLS * RECOVERY_BOUND_S
"""Bound on any one phase of a test."""
CANCEL_FAN_OUT = 200 if FULL_SIZE else 50
PARENTS = 6 if FULL_SIZE else 3
CHILDREN = 20 if FULL_SIZE else 10
TERMINAL_EVENTS = ["succeeded", "failed", "cancelled", "timed_out"]
SUCCEEDED = RunStatus.SUCCEEDED.value


@pytest.fixture(scope="module", params=BACKENDS if FULL_SIZE else CI_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


runtime = pytest.fixture(cancel_runtime.__wrapped__, name="runtime")  # type: ignore[attr-defined]
"""The cancel tests' store: in-memory on SQLite, a Redis with its own prefix on servers."""


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


@pytest.fixture
def workers(database_url: str, tmp_path: Path, runtime: Runtime) -> Iterator[Workers]:
    made = Workers(
        database_url,
        tmp_path,
        redis_url=runtime.redis_url,
        redis_prefix=runtime.redis_prefix,
        app="tests.faults.children_app:app",
        extra_env={"MOORLINE_PARK_AFTER": "0.2", "MOORLINE_TIMER_INTERVAL": "0.2"},
        measured=False,  # killed at random: see Workers.measured
    )
    yield made
    made.kill_all()


@pytest.fixture
def effects(tmp_path: Path) -> Path:
    return tmp_path / "effects.jsonl"


async def start_fans(
    db: DatabaseManager, tenant: TenantId, how_many: int, **arguments: JSONValue
) -> list[RunId]:
    base: JSONObject = dict(arguments)
    fans = [base] * how_many
    return await submit(RunsRepo(db), [tenant], "fan", fans, max_attempts=MAX_ATTEMPTS)


async def children_of(db: DatabaseManager, parents: Sequence[str]) -> list[RunId]:
    async with db.connect() as conn:
        rows = await conn.execute(select(runs.c.id).where(runs.c.parent_run_id.in_(list(parents))))
        return [RunId(run_id) for run_id in rows.scalars()]


async def until_all(db: DatabaseManager, run_ids: Sequence[str], status: str, what: str) -> None:
    async def reached() -> bool:
        return (await count_by_status(db, run_ids))[status] == len(run_ids)

    await wait_for(reached, timeout_s=SETTLE_S, interval_s=0.05, message=what)


async def kill_between_start_and_checkpoint(
    db: DatabaseManager, parents: Sequence[str], workers: Workers, proc: subprocess.Popen[bytes]
) -> list[str]:
    """SIGKILL ``proc`` once a parent it runs has a child with no ``mark`` checkpoint yet."""

    async def caught() -> list[str]:
        held = await running_under(db, list(parents), owner_pattern(proc))
        if not held:
            return []
        async with db.connect() as conn:
            kids = Counter(
                (
                    await conn.execute(
                        select(runs.c.parent_run_id).where(runs.c.parent_run_id.in_(held))
                    )
                ).scalars()
            )
            marks = Counter(
                (
                    await conn.execute(
                        select(steps.c.run_id).where(
                            steps.c.run_id.in_(held),
                            steps.c.key.like("mark:%"),
                            steps.c.status == SUCCEEDED,
                        )
                    )
                ).scalars()
            )
        return [parent for parent in held if kids[parent] > marks[parent]]

    try:
        found = await wait_for(caught, timeout_s=SETTLE_S, interval_s=0.005, message="a fan-out")
    except AssertionError as missed:
        # What the runs and the worker were doing, so that a miss explains itself.
        async with db.connect() as conn:
            rows = await conn.execute(
                select(runs.c.id, runs.c.status, runs.c.attempt, runs.c.lease_owner).where(
                    runs.c.id.in_(list(parents))
                )
            )
            seen = [tuple(row) for row in rows]
        alive = "alive" if proc.poll() is None else f"exited {proc.returncode}"
        raise AssertionError(
            f"{missed}; the parents: {seen}; worker {proc.pid} ({alive}), its log's end:\n"
            f"{workers.log(proc)[-6000:]}"
        ) from None
    proc.kill()
    proc.wait()
    return found


async def check_ended_once(db: DatabaseManager, run_ids: Sequence[str]) -> None:
    async with db.connect() as conn:
        ended = Counter(
            (
                await conn.execute(
                    select(events.c.run_id).where(
                        events.c.run_id.in_(list(run_ids)), events.c.type.in_(TERMINAL_EVENTS)
                    )
                )
            ).scalars()
        )
    assert ended == Counter({run_id: 1 for run_id in run_ids}), "a run ended twice or never"


async def check_joined(db: DatabaseManager, parents: Sequence[RunId], count: int) -> list[RunId]:
    """Each parent succeeded with every child's result once, one child per key; the children."""
    await until_all(db, parents, SUCCEEDED, "every parent joined its children")
    kids = await children_of(db, parents)
    await check_ended_once(db, [*parents, *kids])
    async with db.connect() as conn:
        outputs = {
            row.id: row.output
            for row in await conn.execute(
                select(runs.c.id, runs.c.output).where(runs.c.id.in_(parents))
            )
        }
        keys = Counter(
            (row.parent_run_id, row.child_key)
            for row in await conn.execute(
                select(runs.c.parent_run_id, runs.c.child_key).where(runs.c.id.in_(kids))
            )
        )
        started = Counter(
            (
                await conn.execute(
                    select(events.c.run_id).where(
                        events.c.run_id.in_(list(parents)), events.c.type == "child_started"
                    )
                )
            ).scalars()
        )
    expected = [{"index": index} for index in range(count)]
    for parent in parents:
        assert outputs[parent] == expected, (parent, outputs[parent])
    want = Counter({(p, f"leaf:{i}"): 1 for p in parents for i in range(count)})
    assert keys == want, "a key got no child, or two"
    assert started == Counter({p: count for p in parents}), "a child was started twice"
    assert (await count_by_status(db, kids))[SUCCEEDED] == len(kids)
    return kids


async def steps_rerun(db: DatabaseManager, run_ids: Sequence[str], effects: Path) -> list[str]:
    """Steps whose effect came from an attempt later than the one that checkpointed them."""
    async with db.connect() as conn:
        checkpointed = {
            (row.run_id, row.key): row.attempt
            for row in await conn.execute(select(steps).where(steps.c.run_id.in_(list(run_ids))))
        }
    late: list[str] = []
    for (run_id, key), lines in read_effects(effects).items():
        if run_id in run_ids and (run_id, key) in checkpointed:
            attempts = [int(str(line["attempt"])) for line in lines]
            late += [f"{key} of {run_id}" for a in attempts if a > checkpointed[(run_id, key)]]
    return late


async def test_kill_9_of_a_parents_worker_after_start_child_starts_one_child_per_key(
    db: DatabaseManager, tenants: Tenants, workers: Workers, effects: Path
) -> None:
    """Fault: SIGKILL while parents are between a child's start and their next checkpoint."""
    parents = await start_fans(
        db, await tenants.new(PLAN), PARENTS, effects=str(effects), count=CHILDREN, mark_s=0.3
    )
    proc = workers.start()
    interrupted: list[str] = []
    for _ in range(KILLS):
        interrupted += await kill_between_start_and_checkpoint(db, parents, workers, proc)
        proc = workers.start()
    await check_joined(db, parents, CHILDREN)
    workers.terminate_all()
    # The kills landed after a start_child, before its mark checkpoint: that child was
    # started by an attempt that died, its mark written by a later one, and the replay got
    # the child it had started (check_joined: one child and one child_started per key).
    async with db.connect() as conn:
        started = {
            (row.run_id, str(row.data["key"]).replace("leaf:", "mark:")): row.attempt
            for row in await conn.execute(
                select(events.c.run_id, events.c.attempt, events.c.data).where(
                    events.c.run_id.in_(parents), events.c.type == "child_started"
                )
            )
        }
        marked = {
            (row.run_id, row.key): row.attempt
            for row in await conn.execute(select(steps).where(steps.c.run_id.in_(parents)))
        }
    straddled = [key for key, attempt in started.items() if attempt < marked[key]]
    assert straddled, "no kill landed between a start_child and its checkpoint"
    assert await steps_rerun(db, parents, effects) == []


async def test_kill_9_of_the_childrens_workers_mid_fan_out_ends_each_child_once(
    db: DatabaseManager, tenants: Tenants, workers: Workers, effects: Path
) -> None:
    """Fault: SIGKILL of the workers running children while parents wait for them."""
    parents = await start_fans(
        db, await tenants.new(PLAN), PARENTS, effects=str(effects), count=CHILDREN, steps=3
    )
    procs = [workers.start(), workers.start()]
    interrupted: list[str] = []
    for _ in range(KILLS):

        async def a_child_in_flight() -> list[tuple[int, list[str]]]:
            kids = await children_of(db, parents)
            for index, proc in enumerate(procs):
                held = await running_under(db, kids, owner_pattern(proc))
                if held:
                    return [(index, held)]
            if len(kids) == PARENTS * CHILDREN and all(
                RunStatus(status).is_terminal for status in await count_by_status(db, kids)
            ):
                return [(-1, [])]  # every child ended before this kill: nothing left to catch
            return []

        [(index, held)] = await wait_for(
            a_child_in_flight, timeout_s=SETTLE_S, interval_s=0.005, message="a child running"
        )
        if index < 0:
            break
        procs[index].kill()
        procs[index].wait()
        interrupted += held
        procs[index] = workers.start()
    assert interrupted, "no kill caught a child running: the test did not test"
    kids = await check_joined(db, parents, CHILDREN)
    workers.terminate_all()
    assert set(interrupted) <= set(kids)
    assert await steps_rerun(db, kids, effects) == []


async def test_cancelling_a_parent_mid_fan_out_cancels_every_descendant(
    db: DatabaseManager, tenants: Tenants, workers: Workers, effects: Path, runtime: Runtime
) -> None:
    """Fault: the parent is cancelled while it starts children and the first ones run."""
    tenant = await tenants.new(PLAN)
    [parent] = await start_fans(
        db,
        tenant,
        1,
        effects=str(effects),
        count=CANCEL_FAN_OUT,
        steps=200,
        step_s=0.1,
        mark_s=0.02,
    )
    workers.start()
    workers.start()

    async def some_running() -> bool:
        kids = await children_of(db, [parent])
        return (await count_by_status(db, kids))["running"] >= 5

    await wait_for(some_running, timeout_s=SETTLE_S, message="children running")
    repo = ChildrenRepo(db)
    await cancel_run(RunsRepo(db), runtime.store, tenant, parent, repo)
    kids = await children_of(db, [parent])

    async def all_ended() -> bool:
        every = [parent, *await children_of(db, [parent])]
        states = await count_by_status(db, every)
        return sum(n for s, n in states.items() if RunStatus(s).is_terminal) == len(every)

    await wait_for(all_ended, timeout_s=SETTLE_S, interval_s=0.05, message="every run ended")
    workers.terminate_all()
    kids = await children_of(db, [parent])
    assert 0 < len(kids) <= CANCEL_FAN_OUT
    every = [parent, *kids]
    assert await count_by_status(db, every) == Counter({"cancelled": len(every)})
    await check_ended_once(db, every)
    assert await started_after_cancel(db, every) == []


async def test_sigstop_of_a_parents_worker_past_its_lease_resumes_it_elsewhere(
    db: DatabaseManager, tenants: Tenants, workers: Workers, effects: Path
) -> None:
    """Fault: the parent's worker is paused past its lease while the children finish."""
    # The parents wait in memory (no park), so they stay on the paused worker.
    workers.extra_env["MOORLINE_PARK_AFTER"] = "600"
    parents = await start_fans(
        db, await tenants.new(PLAN), 2, effects=str(effects), count=CHILDREN, step_s=1.0
    )
    paused = workers.start()

    async def fanned_out() -> bool:
        held = await running_under(db, parents, owner_pattern(paused))
        return len(held) == len(parents) and len(await children_of(db, parents)) == 2 * CHILDREN

    await wait_for(fanned_out, timeout_s=SETTLE_S, message="both parents fanned out")
    # Between its transactions: the worker runs children too, and one stopped inside a write
    # keeps its row locks, which no lease takes back (see pause_between_transactions).
    await pause_between_transactions(db, paused)
    try:
        workers.start()
        await check_joined(db, parents, CHILDREN)
    finally:
        paused.send_signal(signal.SIGCONT)
    # The paused worker wakes up holding dead leases: it can write nothing, and stops them.
    workers.terminate_all()
    kids = await check_joined(db, parents, CHILDREN)
    async with db.connect() as conn:
        attempts = {
            row.id: row.attempt
            for row in await conn.execute(
                select(runs.c.id, runs.c.attempt).where(runs.c.id.in_(parents))
            )
        }
    assert all(attempt >= 2 for attempt in attempts.values()), attempts
    assert await steps_rerun(db, kids, effects) == []
