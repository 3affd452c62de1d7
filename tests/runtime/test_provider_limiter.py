"""The provider limiter, in memory and in Redis: fair shares, no over-admission, shared pauses.

The limiter is driven directly by many asyncio tasks (and, on Redis, several processes): the
shares of two tenants under contention stay within 10 % of their weights, no window of the
grants holds more than the rate allows plus the stated burst, a pause set by one process holds
another's calls, and a real 429 of an OpenAI-compatible endpoint pauses the model.
"""

import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from moorline.dispatch.budgets import BudgetStore, Spend
from moorline.llm import Message, complete
from moorline.llm.governance import Caller, governing
from moorline.llm.limiter import (
    CapacityWait,
    LimiterBackend,
    MemoryLimiter,
    ModelLimits,
    ProviderLimiter,
    RedisLimiter,
    estimate_tokens,
)
from moorline.llm.openai_compat import DEFAULT_RETRY_AFTER_S, OpenAICompatibleLLM, retry_after_s
from moorline.plans import Plan
from moorline.runtime.keys import RedisKeys
from moorline.types import TenantId
from moorline.worker.governor import Governor
from tests.examples.openai_server import Answer, OpenAIServer
from tests.helpers import FULL_SIZE
from tests.runtime.conftest import delete_keys, keys_without_ttl
from tests.servers import REDIS_TEST_URL, require_server, unique_name

SECONDS = 8.0 if FULL_SIZE else 4.0
WARMUP_S = 1.0
RPM = 3000  # 50 a second
BURST_S = 0.2  # 10 requests
WAITERS_PER_TENANT = 12
SLACK = 3
"""Grants a window may hold beyond rate and burst: a grant's time is read by its caller after
the reply, so on a loaded machine one read late counts in the next window (and the window's
closed ends hold one more)."""


def redis_limiter(prefix: str) -> RedisLimiter:
    client = Redis.from_url(REDIS_TEST_URL, decode_responses=True)
    return RedisLimiter(client, RedisKeys(prefix).limiter)


@pytest.fixture(params=["memory", "redis"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[LimiterBackend]:
    if request.param == "memory":
        yield MemoryLimiter()
        return
    require_server("redis")
    prefix = unique_name("mo_limiter")
    made = redis_limiter(prefix)
    client = Redis.from_url(REDIS_TEST_URL, decode_responses=True)
    try:
        yield made
        assert await keys_without_ttl(client, prefix) == []
    finally:
        await made.close()
        await delete_keys(client, prefix)
        await client.aclose()


async def contend(
    limiter: ProviderLimiter,
    limits: ModelLimits,
    weights: dict[str, int],
    *,
    seconds: float,
    tokens: int = 100,
) -> list[tuple[float, str, int]]:
    """Many waiters per tenant asking without pause; every grant's (time, tenant, tokens)."""
    grants: list[tuple[float, str, int]] = []
    stop = time.monotonic() + seconds

    async def ask(tenant: str) -> None:
        while time.monotonic() < stop:
            await limiter.acquire(
                "model-x", limits, tenant=tenant, weight=weights[tenant], tokens=tokens
            )
            grants.append((time.monotonic(), tenant, tokens))

    await asyncio.gather(*(ask(tenant) for tenant in weights for _ in range(WAITERS_PER_TENANT)))
    return grants


class LoopStalls:
    """Times this process's event loop could not run: a loaded machine (CI, 2 cores) can stall
    it for a second, and no limiter serves a waiter that cannot ask. Each stall is (when it
    ended, seconds lost)."""

    TICK_S = 0.01
    NOTICED_S = 0.05

    def __init__(self) -> None:
        self.stalls: list[tuple[float, float]] = []

    async def watch(self, seconds: float) -> None:
        stop = time.monotonic() + seconds
        while (before := time.monotonic()) < stop:
            await asyncio.sleep(self.TICK_S)
            late = time.monotonic() - before - self.TICK_S
            if late > self.NOTICED_S:
                self.stalls.append((time.monotonic(), late))

    def lost_since(self, since: float) -> float:
        return sum(late for ended, late in self.stalls if ended >= since)


def shares(grants: Sequence[tuple[float, str, int]], since: float) -> dict[str, float]:
    counted = Counter(tenant for at, tenant, _ in grants if at >= since)
    total = sum(counted.values())
    return {tenant: count / total for tenant, count in counted.items()}


def most_in_any_window(times: Sequence[float], window_s: float) -> int:
    ordered = sorted(times)
    most, start = 0, 0
    for end, at in enumerate(ordered):
        while at - ordered[start] > window_s:
            start += 1
        most = max(most, end - start + 1)
    return most


async def test_contending_tenants_get_shares_within_10_percent_of_their_weights(
    backend: LimiterBackend,
) -> None:
    limiter = ProviderLimiter(backend)
    limits = ModelLimits(rpm=RPM, burst_s=BURST_S)
    started = time.monotonic()
    loop = LoopStalls()
    grants, _ = await asyncio.gather(
        contend(limiter, limits, {"paying": 100, "free": 50}, seconds=SECONDS),
        loop.watch(SECONDS),
    )
    got = shares(grants, since=started + WARMUP_S)
    assert abs(got["paying"] - 2 / 3) <= 0.1 * 2 / 3, got
    assert abs(got["free"] - 1 / 3) <= 0.1 * 1 / 3, got
    # Contended, the capacity is used: at least 90 % of the rate after the warm-up, in the
    # time the waiters could ask (a stall of this process's loop is not the limiter's).
    steady = [at for at, _, _ in grants if at >= started + WARMUP_S]
    could_ask_s = SECONDS - WARMUP_S - loop.lost_since(started + WARMUP_S)
    assert len(steady) >= 0.9 * RPM / 60 * could_ask_s, (len(steady), loop.stalls)


async def test_no_window_holds_more_than_the_rate_and_the_stated_burst(
    backend: LimiterBackend,
) -> None:
    limiter = ProviderLimiter(backend)
    # Both limits bind: 50 requests/s of 100 tokens = 5000 tokens/s, TPM allows 4000/s.
    limits = ModelLimits(rpm=RPM, tpm=240_000, burst_s=BURST_S)
    grants = await contend(limiter, limits, {"a": 10, "b": 10, "c": 10}, seconds=SECONDS / 2)
    times = [at for at, _, _ in grants]
    for window_s in (0.5, 1.0):
        # Tokens bind at 40 calls/s; the burst is 0.2 s of tokens: 8 calls, plus SLACK.
        allowed = 40 * window_s + 40 * BURST_S + SLACK
        assert most_in_any_window(times, window_s) <= allowed, window_s


async def test_real_usage_corrects_the_reservation(backend: LimiterBackend) -> None:
    limiter = ProviderLimiter(backend)
    limits = ModelLimits(tpm=60_000, burst_s=1.0)  # 1000 tokens a second, 1000 in the bucket
    assert estimate_tokens(400, 900) == 1000
    await limiter.acquire("model-y", limits, tenant="t", weight=1, tokens=1000)
    # Its reply used 100 of the 1000 reserved: 900 are given back at once.
    await limiter.settle("model-y", reserved=1000, used=100)
    started = time.monotonic()
    await limiter.acquire("model-y", limits, tenant="t", weight=1, tokens=800)
    assert time.monotonic() - started < 0.5


async def test_a_cancelled_waiter_leaves_the_queue(backend: LimiterBackend) -> None:
    limiter = ProviderLimiter(backend)
    limits = ModelLimits(rpm=60, burst_s=1.0)  # one request, then one a second
    await limiter.acquire("model-z", limits, tenant="t", weight=1, tokens=1)
    waiting = asyncio.create_task(
        limiter.acquire("model-z", limits, tenant="t", weight=1, tokens=1)
    )
    await asyncio.sleep(0.05)  # let it queue (nothing to poll for: it sleeps in the limiter)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    # Had it stayed at the head, this one (another tenant) would wait behind it for 2 s.
    started = time.monotonic()
    await limiter.acquire("model-z", limits, tenant="u", weight=1, tokens=1)
    assert time.monotonic() - started < 1.5


async def test_a_wait_longer_than_park_after_is_raised_not_slept(
    backend: LimiterBackend,
) -> None:
    limiter = ProviderLimiter(backend)
    limits = ModelLimits(rpm=600, burst_s=1.0)
    await limiter.pause("model-p", 30.0)
    started = time.monotonic()
    with pytest.raises(CapacityWait) as raised:
        await limiter.acquire("model-p", limits, tenant="t", weight=1, tokens=1, park_after_s=2)
    # The whole wait is answered (not the 2 s cap of one sleep), and at once.
    assert 25.0 < raised.value.wait_s <= 30.0
    assert time.monotonic() - started < 1.0


PAUSE_SCRIPT = """
import asyncio, sys
from redis.asyncio import Redis
from moorline.llm.limiter import ProviderLimiter, RedisLimiter
from moorline.runtime.keys import RedisKeys

async def main() -> None:
    client = Redis.from_url(sys.argv[1], decode_responses=True)
    limiter = ProviderLimiter(RedisLimiter(client, RedisKeys(sys.argv[2]).limiter))
    await limiter.pause("model-p", float(sys.argv[3]))
    print("paused", flush=True)
    await limiter.close()

asyncio.run(main())
"""


def in_process(script: str, *args: str) -> "subprocess.Popen[str]":
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


async def test_a_pause_set_by_another_process_holds_this_ones_calls(redis_prefix: str) -> None:
    limiter = ProviderLimiter(redis_limiter(redis_prefix))
    limits = ModelLimits(rpm=6000)
    try:
        await limiter.acquire("model-p", limits, tenant="t", weight=1, tokens=1)  # not paused
        other = in_process(PAUSE_SCRIPT, REDIS_TEST_URL, redis_prefix, "2.0")
        assert other.stdout is not None
        assert await asyncio.to_thread(other.stdout.readline) == "paused\n"
        started = time.monotonic()
        await limiter.acquire("model-p", limits, tenant="t", weight=1, tokens=1)
        waited = time.monotonic() - started
        await asyncio.to_thread(other.communicate, timeout=60)
    finally:
        await limiter.close()
    assert other.returncode == 0
    # The other process paused the model for 2 s just before it said so; the call starts
    # after it, not a retry interval later (a loaded CI machine's timers and the retry's
    # round trip added 0.2006 s once).
    assert 1.0 < waited <= 2.5


CONTEND_SCRIPT = """
import asyncio, json, sys, time
from redis.asyncio import Redis
from moorline.llm.limiter import ModelLimits, ProviderLimiter, RedisLimiter
from moorline.runtime.keys import RedisKeys

async def main() -> None:
    client = Redis.from_url(sys.argv[1], decode_responses=True)
    limiter = ProviderLimiter(RedisLimiter(client, RedisKeys(sys.argv[2]).limiter))
    limits = ModelLimits(rpm=int(sys.argv[3]), burst_s=float(sys.argv[4]))
    print("ready", flush=True)  # imported and connected: the test sends the start and stop
    start_at, stop_at = map(float, sys.stdin.readline().split())
    grants = []
    await asyncio.sleep(max(0.0, start_at - time.time()))

    async def ask(tenant: str, weight: int) -> None:
        while time.time() < stop_at:
            await limiter.acquire("model-m", limits, tenant=tenant, weight=weight, tokens=50)
            grants.append((time.time(), tenant))

    await asyncio.gather(*(ask(t, w) for t, w in (("paying", 100), ("free", 50)) for _ in range(6)))
    await limiter.close()
    print(json.dumps(grants))

asyncio.run(main())
"""


async def test_three_processes_share_one_model_fairly(redis_prefix: str) -> None:
    processes = [
        in_process(CONTEND_SCRIPT, REDIS_TEST_URL, redis_prefix, str(RPM), str(BURST_S))
        for _ in range(3)
    ]
    for process in processes:  # however loaded the machine, they start together
        assert process.stdout is not None
        assert await asyncio.to_thread(process.stdout.readline) == "ready\n"
    start_at = time.time() + 0.2
    stop_at = start_at + SECONDS
    for process in processes:
        assert process.stdin is not None
        process.stdin.write(f"{start_at} {stop_at}\n")
        process.stdin.flush()
    outputs = [await asyncio.to_thread(process.communicate, timeout=60) for process in processes]
    assert all(process.returncode == 0 for process in processes)
    grants = [(at, tenant, 50) for out, _ in outputs for at, tenant in json.loads(out)]
    got = shares(grants, since=start_at + WARMUP_S)
    assert abs(got["paying"] - 2 / 3) <= 0.1 * 2 / 3, got
    times = [at for at, _, _ in grants]
    assert most_in_any_window(times, 1.0) <= RPM / 60 * (1.0 + BURST_S) + SLACK
    steady = [at for at in times if at >= start_at + WARMUP_S]
    assert len(steady) >= 0.9 * RPM / 60 * (SECONDS - WARMUP_S)


class SpendInMemory(BudgetStore):
    """A budget store for a test without a database (nothing is budgeted there)."""

    def __init__(self) -> None:
        self.spend = Spend()

    async def spent(self, tenant_id: TenantId, day: str) -> Spend:
        return self.spend

    async def charge(self, tenant_id: TenantId, day: str, tokens: int, cost_micros: int) -> Spend:
        self.spend = Spend(self.spend.tokens + tokens, self.spend.cost_micros + cost_micros)
        return self.spend

    async def close(self) -> None:
        return None


class RecordedPauses(MemoryLimiter):
    def __init__(self) -> None:
        super().__init__()
        self.pauses: list[tuple[str, float]] = []

    async def pause(self, model: str, seconds: float) -> None:
        self.pauses.append((model, seconds))
        await super().pause(model, seconds)


async def declared(model: str) -> ModelLimits | None:
    return ModelLimits(rpm=600) if model == "m" else None


async def test_an_endpoints_429_pauses_the_model_for_every_caller() -> None:
    backend = RecordedPauses()

    async def plan_of(_tenant: TenantId) -> Plan | None:
        return None

    governor = Governor(
        budgets=SpendInMemory(),
        plan_of=plan_of,
        limiter=ProviderLimiter(backend),
        limits=declared,
    )
    async with OpenAIServer() as server:
        llm = OpenAICompatibleLLM(base_url=server.base_url, model="m", max_retries=2)
        try:
            server.script.extend([Answer(status=429), Answer(chunks=["after ", "the pause"])])
            with governing(governor, Caller(tenant_id="t", weight=10)):
                reply = await complete(llm, [Message.user("hi")])
        finally:
            await llm.close()
    assert reply.text == "after the pause"
    assert backend.pauses == [("m", 0.01)]  # the server's retry-after-ms: 10
    # A governed call asks for the usage in the stream's last chunk.
    assert server.requests[-1]["stream_options"] == {"include_usage": True}


async def test_an_unreachable_redis_lets_calls_through() -> None:
    # Nothing listens on port 1: the limiter fails open (the provider's 429s still hold).
    limiter = ProviderLimiter(
        RedisLimiter(
            Redis.from_url("redis://127.0.0.1:1/0", decode_responses=True),
            RedisKeys("unreachable").limiter,
        )
    )
    try:
        limits = ModelLimits(rpm=1, burst_s=1.0)
        for _ in range(3):  # one request a minute, yet three go through at once
            assert (
                await asyncio.wait_for(
                    limiter.acquire("m", limits, tenant="t", weight=1, tokens=1), 5
                )
                < 1.0
            )
        await limiter.pause("m", 30)
        await limiter.settle("m", reserved=10, used=5)
    finally:
        await limiter.close()


def test_a_429s_pause_is_read_from_its_headers() -> None:
    assert retry_after_s(httpx.Headers({"retry-after-ms": "250", "retry-after": "9"})) == 0.25
    assert retry_after_s(httpx.Headers({"retry-after": "7"})) == 7.0
    # An HTTP date, or nothing: the default pause.
    when = "Wed, 21 Oct 2026 07:28:00 GMT"
    assert retry_after_s(httpx.Headers({"retry-after": when})) == DEFAULT_RETRY_AFTER_S
    assert retry_after_s(httpx.Headers({})) == DEFAULT_RETRY_AFTER_S
