"""Injected messages across worker kills, with real worker processes (docs/reliability.md D4).

Concurrent clients post messages into running conversations (one client per conversation,
each posting in its own order and retrying while the run is between attempts) while worker
processes are killed with SIGKILL twice. Every message must reach its conversation's workflow
exactly once and in the order posted, across every replay.

CI runs a small version; ``MOORLINE_FULL=1`` runs the issue's size: 1,000 messages into 20
conversations.
"""

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select

from moorline.db.manager import DatabaseManager
from moorline.db.repos.messages import DRAIN_STEP_PREFIX
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.db.schema import events, messages, runs, steps
from moorline.engine.inbox import Inbox
from moorline.errors import RunNotInteractive
from moorline.runtime.redis import RedisRuntimeStore
from moorline.types import RunId, RunStatus, TenantId
from tests.contract.queue_helpers import Tenants, statuses
from tests.faults.harness import LANE, PLAN, RECOVERY_BOUND_S, Workers, owner_pattern
from tests.helpers import wait_for
from tests.runtime.conftest import make_redis_store
from tests.servers import REDIS_TEST_URL

pytestmark = pytest.mark.faults

FULL = os.environ.get("MOORLINE_FULL") == "1"
CONVERSATIONS = 20 if FULL else 4
MESSAGES = 1000 if FULL else 120
KILLS = 2
RETRY_PAUSE_S = 0.02
"""A client's pause before posting again to a run that is between attempts."""


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


@pytest.fixture
def workers(database_url: str, tmp_path: Path, redis_prefix: str) -> Iterator[Workers]:
    made = Workers(database_url, tmp_path, redis_url=REDIS_TEST_URL, redis_prefix=redis_prefix)
    yield made
    made.kill_all()


@pytest.fixture
async def api_store(redis_prefix: str) -> AsyncIterator[RedisRuntimeStore]:
    """The API process's view of the runtime store the workers share."""
    store = make_redis_store(redis_prefix)
    yield store
    await store.close()


class Clients:
    """One client per conversation, posting its messages in order while runs come and go."""

    def __init__(self, inbox: Inbox, tenant: TenantId, run_ids: list[RunId], per_run: int):
        self.inbox = inbox
        self.tenant = tenant
        self.per_run = per_run
        self.sent: dict[RunId, list[str]] = {run_id: [] for run_id in run_ids}
        self.refusals = 0
        self.progress = asyncio.Condition()

    @property
    def posted(self) -> int:
        return sum(len(texts) for texts in self.sent.values())

    async def post_all(self, run_id: RunId, deadline: float) -> None:
        for index in range(self.per_run):
            text = f"{run_id[-8:]}:{index}"
            while True:
                try:
                    await self.inbox.post_message(self.tenant, run_id, text)
                    break
                except RunNotInteractive:
                    # Between attempts (a worker died): a chat client tries again.
                    self.refusals += 1
                    assert time.monotonic() < deadline, f"run {run_id} never took message {index}"
                    await asyncio.sleep(RETRY_PAUSE_S)
            self.sent[run_id].append(text)
            async with self.progress:
                self.progress.notify_all()

    async def until_posted(self, count: int) -> None:
        async with self.progress:
            await self.progress.wait_for(lambda: self.posted >= count)


async def holding(db: DatabaseManager, pattern: str) -> list[str]:
    """The runs running under a lease owner matching ``pattern``."""
    async with db.connect() as conn:
        rows = await conn.execute(
            select(runs.c.id).where(
                runs.c.status == RunStatus.RUNNING.value, runs.c.lease_owner.like(pattern)
            )
        )
        return list(rows.scalars())


async def drained_seqs(db: DatabaseManager, run_id: RunId) -> list[int]:
    """The seqs every recorded drain of the run took, in drain order."""
    async with db.connect() as conn:
        rows = await conn.execute(
            select(steps.c.key, steps.c.output).where(
                steps.c.run_id == run_id, steps.c.key.like(f"{DRAIN_STEP_PREFIX}%")
            )
        )
        drains = sorted(rows, key=lambda row: int(row.key.removeprefix(DRAIN_STEP_PREFIX)))
    return [seq for row in drains for seq in row.output["seqs"]]


async def undelivered(db: DatabaseManager, run_ids: list[RunId]) -> int:
    async with db.connect() as conn:
        count: int = (
            await conn.execute(
                select(func.count()).where(
                    messages.c.run_id.in_(run_ids), messages.c.delivered_attempt.is_(None)
                )
            )
        ).scalar_one()
    return count


async def received_events(db: DatabaseManager, run_id: RunId) -> list[int]:
    async with db.connect() as conn:
        rows = await conn.execute(
            select(events.c.data)
            .where(events.c.run_id == run_id, events.c.type == "message_received")
            .order_by(events.c.seq)
        )
        return [row.data["seq"] for row in rows]


async def test_messages_survive_worker_kills_exactly_once_and_in_order(
    db: DatabaseManager, tenants: Tenants, workers: Workers, api_store: RedisRuntimeStore
) -> None:
    workers.measured = False  # killed at random: see Workers.measured
    per_run = MESSAGES // CONVERSATIONS
    tenant = await tenants.new(PLAN)
    stored = await RunsRepo(db).submit_many(
        [
            NewRun(
                tenant_id=tenant,
                workflow="chat",
                input={"expected": per_run},
                lane=LANE,
                max_attempts=50,
                conversation_id=f"conversation-{index}",
            )
            for index in range(CONVERSATIONS)
        ]
    )
    run_ids = [run.run_id for run in stored]
    procs = [workers.start(), workers.start()]
    clients = Clients(Inbox(db, api_store), tenant, run_ids, per_run)
    deadline = time.monotonic() + 60 + KILLS * RECOVERY_BOUND_S * 2
    posting = [asyncio.create_task(clients.post_all(run_id, deadline)) for run_id in run_ids]
    try:
        for kill in range(KILLS):
            await asyncio.wait_for(clients.until_posted(MESSAGES * (kill + 1) // (KILLS + 1)), 60)
            # The worker holding the most conversations dies, in the middle of them.
            held = [len(await holding(db, owner_pattern(proc))) for proc in procs]
            victim = procs[held.index(max(held))]
            victim.kill()
            victim.wait()
            procs[procs.index(victim)] = workers.start()
        await asyncio.wait_for(asyncio.gather(*posting), deadline - time.monotonic())
    finally:
        for task in posting:
            task.cancel()

    async def all_succeeded() -> bool:
        found = await statuses(db, run_ids)
        return all(status == RunStatus.SUCCEEDED.value for status, _ in found.values())

    await wait_for(all_succeeded, timeout_s=KILLS * RECOVERY_BOUND_S + 30, message="every run")

    workers.terminate_all()

    attempts = {run_id: attempt for run_id, (_, attempt) in (await statuses(db, run_ids)).items()}
    assert max(attempts.values()) > 1, "no kill interrupted a conversation: the test did not test"
    assert clients.posted == MESSAGES
    assert await undelivered(db, run_ids) == 0
    runs = RunsRepo(db)
    for run_id in run_ids:
        run = await runs.get(run_id)
        assert run is not None and isinstance(run.output, dict)
        # The workflow's own view, across its replays: each message once, in the order posted.
        assert run.output["received"] == clients.sent[run_id], f"run {run_id}"
        expected_seqs = list(range(1, per_run + 1))
        assert await drained_seqs(db, run_id) == expected_seqs, f"drains of run {run_id}"
        assert await received_events(db, run_id) == expected_seqs, f"events of run {run_id}"
