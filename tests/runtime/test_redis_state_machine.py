"""Model-based test of the Redis lease and message queue (Hypothesis ``RuleBasedStateMachine``).

Rules acquire, renew, release and expire leases, and push (also push again, as a retry after
a lost reply does) and drain messages, against a plain dict model. After every step: each
conversation has at most one holder and it is the model's; a renewal or release by a
non-holder changed nothing (not even the TTL); every key under the test prefix has a TTL.
"""

import asyncio
from collections import deque
from collections.abc import Coroutine
from typing import Any, TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from moorline.runtime.base import QueuedMessage
from moorline.runtime.redis import RedisRuntimeStore
from moorline.runtime.redis_client import RedisClient
from moorline.types import RunId
from tests.runtime.conftest import delete_keys, keys_without_ttl, make_redis_store
from tests.servers import require_server, unique_name

T = TypeVar("T")

CONVERSATIONS = st.sampled_from(["c0", "c1"])
HOLDERS = st.sampled_from(["h0", "h1", "h2"])
RUNS = st.sampled_from([RunId("r0"), RunId("r1")])
TTL_S = 30.0


class LeaseMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.runner = asyncio.Runner()
        self.prefix = unique_name("mo_test")
        self.store: RedisRuntimeStore = self.sync(self._make_store())
        self.client: RedisClient = self.store.client
        self.holders: dict[str, str] = {}
        self.messages: dict[RunId, deque[QueuedMessage]] = {}
        self.sent = 0

    async def _make_store(self) -> RedisRuntimeStore:
        return make_redis_store(self.prefix)

    def sync(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.runner.run(coroutine)

    def teardown(self) -> None:
        try:
            self.sync(delete_keys(self.client, self.prefix))
            self.sync(self.store.close())
        finally:
            self.runner.close()

    async def _pttl(self, conversation: str) -> int:
        return await self.client.pttl(self.store.keys.lease(conversation))

    @rule(conversation=CONVERSATIONS, holder=HOLDERS)
    def acquire(self, conversation: str, holder: str) -> None:
        result = self.sync(self.store.acquire_lease(conversation, holder, TTL_S))
        current = self.holders.get(conversation)
        if current is None or current == holder:
            assert result == (True, holder)
            self.holders[conversation] = holder
        else:
            assert result == (False, current)

    @rule(conversation=CONVERSATIONS, holder=HOLDERS)
    def renew(self, conversation: str, holder: str) -> None:
        before = self.sync(self._pttl(conversation))
        renewed = self.sync(self.store.renew_lease(conversation, holder, TTL_S * 2))
        assert renewed == (self.holders.get(conversation) == holder)
        if not renewed:
            assert self.sync(self._pttl(conversation)) <= before, "a failed renewal extended it"

    @rule(conversation=CONVERSATIONS, holder=HOLDERS)
    def release(self, conversation: str, holder: str) -> None:
        released = self.sync(self.store.release_lease(conversation, holder))
        assert released == (self.holders.get(conversation) == holder)
        if released:
            del self.holders[conversation]

    @rule(conversation=CONVERSATIONS)
    def expire(self, conversation: str) -> None:
        """The holder stopped renewing: its lease runs out (forced to 1 ms)."""
        self.sync(self._expire(self.store.keys.lease(conversation)))
        self.holders.pop(conversation, None)

    async def _expire(self, key: str) -> None:
        await self.client.pexpire(key, 1)
        for _ in range(1000):
            if not await self.client.exists(key):
                return
            await asyncio.sleep(0.001)
        raise AssertionError(f"{key} did not expire")

    @rule(run=RUNS)
    def push(self, run: RunId) -> None:
        self.sent += 1
        message = QueuedMessage(self.sent, f"m{self.sent}")
        self.sync(self.store.push_message(run, message.seq, message.text))
        self.messages.setdefault(run, deque()).append(message)

    @rule(run=RUNS)
    def push_again(self, run: RunId) -> None:
        """A retried push of the run's latest queued message: the model does not change."""
        queued = self.messages.get(run)
        if queued:
            self.sync(self.store.push_message(run, queued[-1].seq, queued[-1].text))

    @rule(run=RUNS)
    def drain(self, run: RunId) -> None:
        drained = self.sync(self.store.drain_messages(run))
        assert drained == list(self.messages.pop(run, deque()))

    @invariant()
    def one_holder_per_conversation_as_modelled(self) -> None:
        for conversation in ("c0", "c1"):
            holder = self.sync(self.store.get_lease_holder(conversation))
            assert holder == self.holders.get(conversation)

    @invariant()
    def every_key_expires(self) -> None:
        assert self.sync(keys_without_ttl(self.client, self.prefix)) == []


def test_lease_state_machine() -> None:
    require_server("redis")
    run_state_machine_as_test(
        LeaseMachine,
        settings=settings(
            max_examples=50,
            stateful_step_count=25,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
