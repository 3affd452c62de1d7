"""Restart Redis under real worker processes (issue 4, docs/reliability.md E).

Two ``moorline worker`` processes on PostgreSQL share a *private* Redis server (its own port
and folder, so restarting it disturbs no other test). While runs hold leases in their steps,
wait on permission requests and have cancels pending, the test stops Redis (every key, lease,
interrupt flag and cancel flag is gone: it keeps nothing on disk) and starts it again. Then:

- every cancel lands: the ones recorded as Redis died (their store signal never went out, so
  only the database can deliver them) and the ones made after it;
- every interrupt is still resolvable, and the run goes on with the decision taken;
- the runs that were only working finish, and no run is stuck: everything is terminal within
  the recovery bound of the moment Redis came back;
- no key the runtime wrote after the restart lacks a TTL.

And a run that starts while Redis is down (its conversation lease and window refused) takes
messages within a lease TTL of Redis coming back: the worker's heartbeat asks again.
"""

import shutil
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from moorline.db.manager import DatabaseManager
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.records import DecisionReason
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.dispatch.cancel import cancel_run
from moorline.engine.inbox import Inbox
from moorline.errors import RunNotInteractive
from moorline.runtime.redis import RedisRuntimeStore
from moorline.types import JSONObject, RunId, RunStatus, TenantId
from tests.contract.queue_helpers import Tenants, statuses
from tests.faults.harness import LANE, LEASE_TTL_S, PLAN, RECOVERY_BOUND_S, Workers, submit
from tests.faults.test_cancel_faults import started_after_cancel
from tests.helpers import wait_for
from tests.private_redis import PrivateRedis
from tests.runtime.conftest import keys_without_ttl, make_redis_store
from tests.servers import unique_name

pytestmark = pytest.mark.faults

STEP_S = 0.3
"""The cancel targets' step length: each attempt is always just inside or between steps."""
WORKING_S = 4.0
"""The plain runs' length: they hold their leases across the restart."""


@pytest.fixture(scope="module", params=["postgresql"])
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
async def redis_server(tmp_path: Path) -> AsyncIterator[PrivateRedis]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed")
    server = PrivateRedis(tmp_path)
    await server.start()
    yield server
    server.stop()


@pytest.fixture
async def store(redis_server: PrivateRedis) -> AsyncIterator[RedisRuntimeStore]:
    made = make_redis_store(unique_name("mo_restart"), url=redis_server.url)
    yield made
    await made.close()


@pytest.fixture
async def tenant(db: DatabaseManager) -> AsyncIterator[TenantId]:
    made = Tenants(db)
    yield await made.new(PLAN)
    await made.purge()


@pytest.fixture
def workers(
    database_url: str, tmp_path: Path, redis_server: PrivateRedis, store: RedisRuntimeStore
) -> Iterator[Workers]:
    made = Workers(
        database_url, tmp_path, redis_url=redis_server.url, redis_prefix=store.keys.prefix
    )
    yield made
    made.kill_all()


async def test_a_redis_restart_loses_no_cancel_no_decision_and_strands_no_run(
    db: DatabaseManager,
    tenant: TenantId,
    workers: Workers,
    redis_server: PrivateRedis,
    store: RedisRuntimeStore,
) -> None:
    runs = RunsRepo(db)
    permissions = InterruptsRepo(db)
    for _ in range(2):
        workers.start()

    async def all_serving() -> bool:
        return all(workers.is_serving(proc) for proc in workers.procs)

    # Start-up is not the fault under test: on a loaded two-core machine, two interpreters
    # importing at once can take most of the 30 s the runs below are given.
    await wait_for(all_serving, timeout_s=120, message="the workers to serve")
    targets = await submit(runs, [tenant], "cancel_target", [{"step_s": STEP_S}] * 6)
    asking = await submit(runs, [tenant], "approve_then_act", [{}] * 4)
    working = await submit(runs, [tenant], "work", [{"seconds": WORKING_S}] * 4)
    everything = targets + asking + working

    async def all_asking() -> bool:
        return all([await permissions.pending_for_run(run_id) for run_id in asking])

    async def all_running() -> bool:
        found = await statuses(db, targets + working)
        return all(status == RunStatus.RUNNING.value for status, _ in found.values())

    await wait_for(all_asking, timeout_s=30, message="every permission request")
    await wait_for(all_running, timeout_s=30, message="the other runs to be running")

    # Cancels recorded in the database just as Redis dies, before their store signal went out:
    # only the workers' heartbeats can deliver them now.
    before = targets[:3]
    for run_id in before:
        await runs.request_cancel(tenant, run_id)
    await redis_server.restart()
    back_at = time.monotonic()

    after = targets[3:]
    for run_id in after:
        await cancel_run(runs, store, tenant, run_id)
    decisions: dict[RunId, bool] = {run_id: index % 2 == 0 for index, run_id in enumerate(asking)}
    for run_id, approved in decisions.items():
        [pending] = await permissions.pending_for_run(run_id)
        reason = DecisionReason.APPROVED if approved else DecisionReason.DENIED
        await permissions.resolve(
            run_id, pending.interrupt_id, approved=approved, reason=reason, data=None
        )
        decision: JSONObject = {"approved": approved, "reason": reason.value, "data": None}
        await store.resolve_interrupt(run_id, pending.interrupt_id, decision)

    async def all_terminal() -> bool:
        found = await statuses(db, everything)
        return all(RunStatus(status).is_terminal for status, _ in found.values())

    await wait_for(
        all_terminal,
        timeout_s=RECOVERY_BOUND_S + WORKING_S + 10,
        message="every run to end after the restart",
    )
    took_s = time.monotonic() - back_at
    assert took_s <= RECOVERY_BOUND_S + WORKING_S + 10

    found = await statuses(db, everything)
    assert {run_id: found[run_id][0] for run_id in targets} == dict.fromkeys(targets, "cancelled")
    assert await started_after_cancel(db, targets) == []
    assert {run_id: found[run_id][0] for run_id in working} == dict.fromkeys(working, "succeeded")
    for run_id, approved in decisions.items():
        run = await runs.get(run_id)
        assert run is not None and run.status is RunStatus.SUCCEEDED, (run_id, run)
        assert isinstance(run.output, dict)
        assert (run.output["approved"], run.output["acted"]) == (approved, approved)
        assert await permissions.pending_for_run(run_id) == []

    workers.terminate_all()
    assert all(proc.returncode == 0 for proc in workers.procs), [
        workers.log(proc)[-2000:] for proc in workers.procs if proc.returncode != 0
    ]
    assert await keys_without_ttl(store.client, store.keys.prefix) == []


async def test_a_run_started_while_redis_is_down_takes_messages_once_it_is_back(
    db: DatabaseManager,
    tenant: TenantId,
    workers: Workers,
    redis_server: PrivateRedis,
    store: RedisRuntimeStore,
) -> None:
    """Its attempt could take neither lease nor window; the heartbeat takes them (D11)."""
    runs = RunsRepo(db)
    worker = workers.start()

    async def serving() -> bool:
        return workers.is_serving(worker)

    await wait_for(serving, timeout_s=120, message="the worker to serve")
    redis_server.stop()
    chats = await runs.submit_many(
        [
            NewRun(
                tenant_id=tenant,
                workflow="chat",
                input={"expected": 1},
                lane=LANE,
                conversation_id=conversation,
            )
            for conversation in (None, "restart")
        ]
    )
    run_ids = [run.run_id for run in chats]

    async def both_refused() -> bool:
        # Logged when the lease (with a conversation) or the window's open failed.
        log = workers.log(worker)
        return all(f"run {run_id}: runtime store unreachable" in log for run_id in run_ids)

    await wait_for(both_refused, timeout_s=30, message="both chats to start without Redis")
    await redis_server.start()
    back_at = time.monotonic()
    inbox = Inbox(db, store)
    for run_id in run_ids:

        async def accepted(run_id: RunId = run_id) -> bool:
            try:
                await inbox.post_message(tenant, run_id, "hello")
            except RunNotInteractive:
                return False
            return True

        # Never, before D11: the attempt refused messages to its end.
        await wait_for(accepted, timeout_s=LEASE_TTL_S + 5, message=f"{run_id} to take a message")
    assert time.monotonic() - back_at <= LEASE_TTL_S + 5

    async def both_done() -> bool:
        found = await statuses(db, run_ids)
        return all(status == RunStatus.SUCCEEDED.value for status, _ in found.values())

    await wait_for(both_done, timeout_s=30, message="both chats to end with their message")
    for run_id in run_ids:
        run = await runs.get(run_id)
        assert run is not None and run.output == {"received": ["hello"]}, run
    workers.terminate_all()
    assert worker.returncode == 0, workers.log(worker)[-2000:]
