"""A submission's wake-up leaves before its callers go on (issue 19, item 5).

``moorline serve`` runs on uvloop, which puts the writes of one turn of the event loop on the
wire only when that turn ends. The Redis wake-up of a written batch is sent from a task of its
own; answered in the turn that task first runs, the callers' continuations (an HTTP answer
each, about a millisecond of work apiece) held the wake-up back until they were done, and the
worker heard of the run that much later. Here the caller's continuation holds the loop for a
long while on purpose, and a subscriber in a thread of its own notes when the wake-up arrives.
"""

import asyncio
import threading
import time
import uuid
from pathlib import Path

import redis
import uvloop

from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.dispatch.redis_wakeups import RedisWakeups, redis_channel
from moorline.dispatch.submit import Submitter
from moorline.dispatch.wakeups import BackgroundNotifier
from moorline.settings import Settings
from tests.contract.queue_helpers import create_tenant
from tests.servers import REDIS_TEST_URL, require_server

HOLD_S = 0.5
"""How long the caller's continuation keeps the loop to itself."""


class Subscriber(threading.Thread):
    """Notes when each message on ``channel`` arrives, on a connection of its own."""

    def __init__(self, channel: str, expected: int) -> None:
        super().__init__(daemon=True)
        self.channel = channel
        self.expected = expected
        self.subscribed = threading.Event()
        self.arrivals: list[float] = []

    def run(self) -> None:
        client = redis.Redis.from_url(REDIS_TEST_URL)
        pubsub = client.pubsub()  # type: ignore[no-untyped-call]  # redis-py leaves it untyped
        deadline = time.monotonic() + 30
        try:
            pubsub.subscribe(self.channel)
            while len(self.arrivals) < self.expected and time.monotonic() < deadline:
                message = pubsub.get_message(timeout=0.05)
                if message is None:
                    continue
                if message["type"] == "subscribe":
                    self.subscribed.set()
                elif message["type"] == "message":
                    self.arrivals.append(time.perf_counter())
        finally:
            pubsub.close()
            client.close()


async def submit_and_hold(tmp_path: Path, prefix: str) -> tuple[float, float]:
    """Submit one run through a Submitter waking over Redis; hold the loop once answered.

    Returns when the caller was answered and when it let go of the loop.
    """
    db = DatabaseManager(Settings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'order.db'}"))
    wakeups = RedisWakeups(REDIS_TEST_URL, prefix=prefix)
    notifier = BackgroundNotifier(wakeups)
    submitter = Submitter(RunsRepo(db), on_enqueued=notifier)
    try:
        await upgrade(db)
        tenant = await create_tenant(db)
        new = NewRun(tenant_id=tenant, workflow="noop", input={}, lane="order")
        await submitter.submit(new)  # connects: the first wake-up opens its connection
        await notifier.close()
        await submitter.submit(new)
        answered = time.perf_counter()
        # The caller's own work, as an HTTP answer's: it keeps the loop, never awaiting.
        time.sleep(HOLD_S)  # noqa: ASYNC251
        let_go = time.perf_counter()
        await notifier.close()
        return answered, let_go
    finally:
        await submitter.close()
        await wakeups.close()
        await db.dispose()


def test_the_wake_up_is_on_the_wire_before_the_caller_goes_on(tmp_path: Path) -> None:
    require_server("redis")
    prefix = f"order-{uuid.uuid4().hex[:8]}"
    subscriber = Subscriber(redis_channel(prefix), expected=2)
    subscriber.start()
    assert subscriber.subscribed.wait(10)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        answered, let_go = runner.run(submit_and_hold(tmp_path, prefix))
    subscriber.join(30)
    assert len(subscriber.arrivals) == 2, subscriber.arrivals
    assert let_go - answered >= HOLD_S
    # The second submission's wake-up, sent in the turn before its caller was answered, came
    # while the caller held the loop; held back behind the caller, it would have come only
    # once the caller let go.
    heard = subscriber.arrivals[1]
    assert heard < answered + HOLD_S / 2, heard - answered
