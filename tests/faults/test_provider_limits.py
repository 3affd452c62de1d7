"""Issue 18's acceptance for provider limits: three processes, four tenants, one limited model.

A test double of an OpenAI-compatible endpoint (:class:`MinuteLimitedServer`, the scripted
server of ``tests/examples`` plus limits it enforces itself: 600 requests and 60,000 tokens in
any 60 s) is called by three processes through the product's client, each governed by a
:class:`~moorline.worker.governor.Governor` over one Redis limiter. Four tenants on two plans
(priorities 100 and 50) call as fast as they are let. Checked: the server answers no 429 for
its limits (the declared limits plus the stated burst stay under them), the throughput is at
least 90 % of the limit, each tenant's share is within 10 % of its weight's, and a 429 the
server sends with ``Retry-After`` holds every process's calls.

At the issue's size (``MOORLINE_FULL=1``) the run lasts 60 s at 600 RPM; CI size is 20 s at
1,800 RPM (the same windows, scaled).
"""

import asyncio
import math
import os
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tests.examples.openai_server import Answer, OpenAIServer
from tests.helpers import FULL_SIZE
from tests.runtime.conftest import delete_keys, keys_without_ttl
from tests.servers import REDIS_TEST_URL, require_server, unique_name

SECONDS = 60.0 if FULL_SIZE else 20.0
WINDOW_S = 60.0 if FULL_SIZE else 20.0
SERVER_RPM = 600  # per WINDOW_S
SERVER_TPM = 60_000
BURST_S = 3.0 * WINDOW_S / 60  # 5 % of the window
DECLARED = 0.93
"""The declared limits, as a share of the server's: with the 5 % burst, 98 % of them, and the
rest covers the calls' way to the server (a call granted at t arrives a little later, so a
window of the server's can hold a few calls granted before it began)."""
MAX_TOKENS = 90
PROMPT_CHARS = 40  # 10 tokens: a call reserves 100, so 600 calls are 60,000 tokens
TENANTS = {"pro-a": 100, "pro-b": 100, "team-c": 50, "team-d": 50}
PROCESSES = 3
TASKS_PER_TENANT = 8  # per process: each tenant always has calls queued, however slow a call
PAUSE_S = 3
WARMUP_S = 2.0
ROOT = str(Path(__file__).resolve().parents[2])


class MinuteLimitedServer(OpenAIServer):
    """The scripted endpoint, refusing (429) what passes its limits in any window.

    Tokens are counted as the endpoint would bill them: prompt characters / 4, plus the reply's
    chunks. ``force_429`` makes the next request a 429 with ``Retry-After: PAUSE_S``.
    """

    def __init__(self) -> None:
        super().__init__(default=Answer(chunks=["fine ", "thanks"]))
        self.granted: list[tuple[float, str, int]] = []
        self.over_limit = 0
        self.force_429 = False
        self.forced_at: float | None = None

    async def _complete(self, request: Request) -> Response:
        body = await request.json()
        now = time.monotonic()
        if self.force_429:
            self.force_429, self.forced_at = False, now
            error = {"error": {"message": "slow down", "type": "rate_limit"}}
            return JSONResponse(error, status_code=429, headers={"retry-after": str(PAUSE_S)})
        prompt = str(body["messages"][-1]["content"])
        tokens = math.ceil(len(prompt) / 4) + 2
        recent = [(at, t) for at, _, t in self.granted if at > now - WINDOW_S]
        if len(recent) + 1 > SERVER_RPM or sum(t for _, t in recent) + tokens > SERVER_TPM:
            self.over_limit += 1
            error = {"error": {"message": "over the limit", "type": "rate_limit"}}
            return JSONResponse(error, status_code=429, headers={"retry-after": "1"})
        self.granted.append((now, prompt.split()[0], tokens))
        return await super()._complete(request)


CALLER = f"""
import asyncio, sys, time
from redis.asyncio import Redis
from moorline.llm import Message, complete
from moorline.llm.governance import Caller, governing
from moorline.llm.limiter import ModelLimits, ProviderLimiter, RedisLimiter
from moorline.llm.openai_compat import OpenAICompatibleLLM
from moorline.runtime.keys import RedisKeys
from moorline.worker.governor import Governor
from moorline.dispatch.budgets import Spend


class NoBudgets:
    async def spent(self, tenant_id, day):
        return Spend()

    async def charge(self, tenant_id, day, tokens, cost_micros):
        return Spend()

    async def close(self):
        return None

TENANTS = {TENANTS!r}
LIMITS = ModelLimits(
    rpm=int({SERVER_RPM} * {DECLARED} * 60 / {WINDOW_S}),
    tpm=int({SERVER_TPM} * {DECLARED} * 60 / {WINDOW_S}),
    burst_s={BURST_S},
)

async def limits(model):
    return LIMITS

async def plan_of(tenant_id):
    return None

async def main() -> None:
    base_url, prefix = sys.argv[1], sys.argv[2]
    client = Redis.from_url("{REDIS_TEST_URL}", decode_responses=True)
    limiter = ProviderLimiter(RedisLimiter(client, RedisKeys(prefix).limiter))
    governor = Governor(budgets=NoBudgets(), plan_of=plan_of, limiter=limiter, limits=limits)
    llm = OpenAICompatibleLLM(base_url=base_url, model="limited", max_tokens={MAX_TOKENS})
    print("ready", flush=True)
    stop_at = time.time() + float(sys.stdin.readline())

    async def calls(tenant: str) -> None:
        prompt = (tenant + " " + "x" * {PROMPT_CHARS})[:{PROMPT_CHARS}]
        with governing(governor, Caller(tenant_id=tenant, weight=TENANTS[tenant])):
            while time.time() < stop_at:
                await complete(llm, [Message.user(prompt)])

    await asyncio.gather(*(calls(t) for t in TENANTS for _ in range({TASKS_PER_TENANT})))
    await llm.close()
    await governor.close()

asyncio.run(main())
"""


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    require_server("redis")
    from redis.asyncio import Redis

    client = Redis.from_url(REDIS_TEST_URL, decode_responses=True)
    made = unique_name("mo_provider")
    try:
        yield made
        assert await keys_without_ttl(client, made) == []
    finally:
        await delete_keys(client, made)
        await client.aclose()


@pytest.mark.skipif(
    not FULL_SIZE, reason="shares within 10 % need the full minute; a loaded CI run misses it"
)
async def test_three_processes_keep_to_the_limits_share_by_weight_and_pause_together(
    prefix: str,
) -> None:
    env = {**os.environ, "PYTHONPATH": ROOT}
    server = MinuteLimitedServer()
    async with server:
        processes = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                CALLER,
                server.base_url,
                prefix,
                env=env,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            for _ in range(PROCESSES)
        ]
        try:
            for process in processes:
                assert process.stdout is not None
                assert await process.stdout.readline() == b"ready\n"
            started = time.monotonic()
            for process in processes:
                assert process.stdin is not None
                process.stdin.write(f"{SECONDS}\n".encode())
                await process.stdin.drain()
            await asyncio.sleep(SECONDS / 2)  # the test's clock, not a synchronisation
            server.force_429 = True
            codes = await asyncio.wait_for(
                asyncio.gather(*(process.wait() for process in processes)), SECONDS + 60
            )
        finally:
            for process in processes:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
    assert codes == [0] * PROCESSES
    assert server.over_limit == 0  # the limits were never passed
    # Throughput: at least 90 % of the server's limit, the pause's seconds excepted.
    served = len(server.granted)
    limit = SERVER_RPM * (SECONDS - PAUSE_S) / WINDOW_S
    assert served >= 0.9 * limit, (served, limit)
    # Shares by weight, once every waiter is queued (the first burst goes in arrival order):
    # 1/3 for each priority-100 tenant, 1/6 for each priority-50 one.
    counts = Counter(tenant for at, tenant, _ in server.granted if at > started + WARMUP_S)
    total_weight = sum(TENANTS.values())
    shares = {tenant: round(counts[tenant] / counts.total(), 3) for tenant in TENANTS}
    print(f"served {served} of {limit:.0f} ({served / limit:.1%}), 429s over the limits: "
          f"{server.over_limit}, shares {shares}")  # fmt: skip
    for tenant, weight in TENANTS.items():
        share, expected = counts[tenant] / counts.total(), weight / total_weight
        assert abs(share - expected) <= 0.1 * expected, (tenant, share, expected)
    # The 429's Retry-After held every process: nothing new started during the pause but what
    # had taken its capacity already (at most one call per process).
    assert server.forced_at is not None
    during = [at for at, _, _ in server.granted if 0.2 < at - server.forced_at < PAUSE_S - 0.5]
    assert len(during) <= PROCESSES, len(during)
