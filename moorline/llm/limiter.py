"""The provider limiter: every worker's model calls share one model's RPM and TPM, fairly.

A models file entry may declare ``rpm`` and ``tpm`` (:class:`ModelLimits`). Before a call, the
caller takes one request and its *estimated* tokens (prompt characters / 4 plus
``max_tokens``, :func:`estimate_tokens`) from the model's two token buckets; afterwards the
estimate is corrected by the real usage (:meth:`ProviderLimiter.settle`: the bucket is charged
the difference, and may go below zero, which later callers wait out).

**Burst.** Each bucket holds ``burst_s`` seconds of its rate (default
:data:`DEFAULT_BURST_S`, at least one request) and starts full, so in any 60 s window the
limiter lets through at most ``limit * (1 + burst_s / 60)`` — 10 % above the declared limit by
default. Declare a limit that far under the provider's if its window is strict.

**Fairness.** Callers short of capacity queue per model in start-time fair order: a call of
tenant *t* is tagged ``max(V, t's last tag) + cost / weight`` (cost: its tokens when ``tpm``
is declared, else 1; weight: the plan's priority, which the run carries; ``V``: the tag served
last, never past the queue's head, so a call served out of order cannot move newcomers ahead of
those it passed). Under contention only the head is served, so contending tenants share the
capacity by weight, and a free tenant's burst queues behind a paying tenant's next call. While
capacity suffices for every waiter ahead and the caller (counted at its size) it is served at
once: without contention nobody waits for the head to poll.

**Waiting** never blocks the loop: a waiter sleeps (``asyncio.sleep``) for the time the
buckets need to refill for it (at most :data:`MAX_WAIT_S`), then asks again; the state is in
one place, so a waiter in another process is served in the same order. A caller that can park
(a run's model call) gives ``park_after_s``: when the limiter's answer is a longer wait (a
provider's ``Retry-After``, a token window spent for a while) it raises
:class:`CapacityWait` instead of sleeping, and the run parks until then, holding no slot. A
waiter that stops asking (its process died) is dropped from the queue after :data:`STALE_S`;
a cancelled one withdraws at once.

**Provider 429.** :meth:`ProviderLimiter.pause` records "paused until" on the model: every
caller of every process waits until then.

Two backends keep the state, one interface (:class:`LimiterBackend`): :class:`MemoryLimiter`
(one process) and :class:`RedisLimiter` (every process of a deployment), whose one Lua script
does what :meth:`MemoryLimiter.try_acquire` does, atomically; its keys expire after
:data:`STATE_TTL_S` without use. The key names come from the caller (``RedisKeys.limiter``).
"""

import asyncio
import logging
import math
import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

logger = logging.getLogger(__name__)

DEFAULT_BURST_S = 6.0
"""Seconds of its rate each bucket holds: the burst above the declared per-minute limit."""

STALE_S = 10.0
"""Seconds after its last ask that a waiter is dropped from the queue (its process died)."""

MAX_WAIT_S = 2.0
"""Longest sleep between two asks: a waiter keeps its place by asking well within STALE_S.
The backends answer the whole wait; the sleep is cut to this."""

MIN_WAIT_S = 0.005
"""Shortest sleep between two asks of a waiter that is not served yet."""

STATE_TTL_S = 600.0
"""Seconds a model's state outlives its last use in Redis."""

DEFAULT_MAX_TOKENS_ESTIMATE = 1024
"""Completion tokens reserved for a call that sets no ``max_tokens``."""


class CapacityWait(Exception):
    """The next capacity for a call is more than the caller's ``park_after_s`` away.

    Raised by :meth:`ProviderLimiter.acquire` instead of sleeping; the caller has left the
    queue and took nothing. The model-call hook parks the run for ``wait_s``.
    """

    def __init__(self, model: str, wait_s: float) -> None:
        super().__init__(f"model {model!r}: no capacity for {wait_s:.1f}s")
        self.model = model
        self.wait_s = wait_s


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelLimits:
    """A model's declared provider limits (a models file entry's ``rpm`` and ``tpm``).

    Attributes:
        rpm: Requests per minute; None: not limited.
        tpm: Tokens (prompt + completion) per minute; None: not limited.
        burst_s: Seconds of each rate a bucket holds (see the module docstring).
    """

    rpm: int | None = None
    tpm: int | None = None
    burst_s: float = DEFAULT_BURST_S

    def __post_init__(self) -> None:
        if (self.rpm is not None and self.rpm < 1) or (self.tpm is not None and self.tpm < 1):
            raise ValueError("rpm and tpm must be at least 1 when declared")
        if self.burst_s <= 0:
            raise ValueError("burst_s must be positive")

    @property
    def declared(self) -> bool:
        """Whether any limit is declared (else the limiter is not used for the model)."""
        return self.rpm is not None or self.tpm is not None

    def args(self) -> list[float]:
        """``[requests/ms, request capacity, tokens/ms, token capacity]``; 0 rate: unlimited."""
        req_rate = (self.rpm or 0) / 60_000.0
        tok_rate = (self.tpm or 0) / 60_000.0
        return [
            req_rate,
            max(1.0, req_rate * self.burst_s * 1000),
            tok_rate,
            max(1.0, tok_rate * self.burst_s * 1000),
        ]


def estimate_tokens(prompt_chars: int, max_tokens: int | None) -> int:
    """A call's reservation: prompt characters / 4 plus its ``max_tokens``."""
    completion = DEFAULT_MAX_TOKENS_ESTIMATE if max_tokens is None else max_tokens
    return max(1, math.ceil(prompt_chars / 4) + completion)


@dataclass(frozen=True, slots=True, kw_only=True)
class Ask:
    """One waiter's ask: who, for what, with which weight."""

    model: str
    waiter: str
    tenant: str
    weight: int
    tokens: int
    limits: ModelLimits


class LimiterBackend(Protocol):
    """Where the buckets, the pause and the fair queue of each model live."""

    async def try_acquire(self, ask: Ask) -> float:
        """Take the capacity ``ask`` needs, or queue it.

        Returns:
            0 when taken (the ask has left the queue); else the seconds until the capacity
            could be there (the ask keeps its place), at least :data:`MIN_WAIT_S`.
        """
        ...

    async def withdraw(self, model: str, waiter: str) -> None:
        """Leave the queue without taking anything (the waiter was cancelled)."""
        ...

    async def adjust(self, model: str, tokens: int) -> None:
        """Charge the token bucket ``tokens`` more (negative: give back)."""
        ...

    async def pause(self, model: str, seconds: float) -> None:
        """Let no call of ``model`` start for ``seconds`` (a later pause never shortens it)."""
        ...

    async def close(self) -> None: ...


@dataclass(slots=True)
class _ModelState:
    req: float = -1.0  # below 0: not started, filled to capacity on first use
    tok: float = -1.0
    ts: float = 0.0
    paused_until: float = 0.0
    vtime: float = 0.0
    queue: dict[str, float] = field(default_factory=dict)  # waiter → tag
    seen: dict[str, float] = field(default_factory=dict)  # waiter → last ask (ms)
    tags: dict[str, float] = field(default_factory=dict)  # tenant → last tag


class MemoryLimiter(LimiterBackend):
    """The limiter's state in this process (deployments without Redis)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._models: dict[str, _ModelState] = {}

    def _now_ms(self) -> float:
        return self._clock() * 1000.0

    async def try_acquire(self, ask: Ask) -> float:
        now = self._now_ms()
        state = self._models.setdefault(ask.model, _ModelState())
        req_rate, req_cap, tok_rate, tok_cap = ask.limits.args()
        for waiter, last in list(state.seen.items()):
            if last < now - STALE_S * 1000:
                state.seen.pop(waiter, None)
                state.queue.pop(waiter, None)
        if ask.waiter not in state.queue:
            cost = ask.tokens if tok_rate > 0 else 1
            tag = max(state.vtime, state.tags.get(ask.tenant, 0.0)) + cost / max(1, ask.weight)
            state.tags[ask.tenant] = tag
            state.queue[ask.waiter] = tag
        state.seen[ask.waiter] = now
        if state.req < 0:
            state.req, state.tok, state.ts = req_cap, tok_cap, now
        elapsed = max(0.0, now - state.ts)
        state.req = min(req_cap, state.req + elapsed * req_rate)
        state.tok = min(tok_cap, state.tok + elapsed * tok_rate)
        state.ts = now
        if state.paused_until > now:
            return (state.paused_until - now) / 1000.0
        my_tag = state.queue[ask.waiter]
        rank = sum(1 for tag in state.queue.values() if tag < my_tag)
        wait_ms = _wait_ms(rank, ask.tokens, state.req, state.tok, req_rate, tok_rate, tok_cap)
        if wait_ms > 0:
            return max(MIN_WAIT_S, wait_ms / 1000.0)
        if req_rate > 0:
            state.req -= 1
        if tok_rate > 0:
            state.tok -= ask.tokens
        del state.queue[ask.waiter]
        del state.seen[ask.waiter]
        # V moves to the tag served, never past the queue's head (see the module docstring).
        state.vtime = max(state.vtime, min(my_tag, min(state.queue.values(), default=my_tag)))
        return 0.0

    async def withdraw(self, model: str, waiter: str) -> None:
        state = self._models.get(model)
        if state is not None:
            state.queue.pop(waiter, None)
            state.seen.pop(waiter, None)

    async def adjust(self, model: str, tokens: int) -> None:
        state = self._models.get(model)
        if state is not None and state.req >= 0:  # a started bucket only, as in Redis
            state.tok -= tokens

    async def pause(self, model: str, seconds: float) -> None:
        state = self._models.setdefault(model, _ModelState())
        state.paused_until = max(state.paused_until, self._now_ms() + seconds * 1000.0)

    async def close(self) -> None:
        self._models.clear()


def _wait_ms(
    rank: int,
    tokens: int,
    req: float,
    tok: float,
    req_rate: float,
    tok_rate: float,
    tok_cap: float,
) -> float:
    """Milliseconds until the buckets hold enough for ``rank`` waiters ahead and this one.

    0: serve it now. The waiters ahead are counted at this one's size. Only the head may take
    a full bucket when it needs more (a call bigger than the bucket, which then goes below
    zero): a waiter behind it waits for more than a bucket holds, so a bucket filled while the
    head was slow to ask never goes to the back of the queue first.
    """
    wait = 0.0
    if req_rate > 0:
        need = rank + 1.0
        if req < need:
            wait = max(wait, (need - req) / req_rate)
    if tok_rate > 0:
        need = min(tok_cap, tokens) if rank == 0 else (rank + 1.0) * tokens
        if tok < need:
            wait = max(wait, (need - tok) / tok_rate)
    return wait


TRY_ACQUIRE = """
-- The provider limiter's ask: MemoryLimiter.try_acquire, atomically.
-- KEYS: state (hash), queue (zset waiter → tag), seen (zset waiter → last ask ms),
--       tags (hash tenant → last tag); one hash tag, one slot.
-- ARGV: waiter, tenant, weight, tokens, req_rate, req_cap, tok_rate, tok_cap (rates per ms),
--       stale ms, state TTL ms, min wait ms.
-- Returns the milliseconds to sleep as a string ("0": taken, the waiter left the queue).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local waiter, tenant = ARGV[1], ARGV[2]
local weight = math.max(1, tonumber(ARGV[3]))
local tokens = tonumber(ARGV[4])
local req_rate, req_cap = tonumber(ARGV[5]), tonumber(ARGV[6])
local tok_rate, tok_cap = tonumber(ARGV[7]), tonumber(ARGV[8])
local ttl = tonumber(ARGV[10])
local min_wait = tonumber(ARGV[11])
local stale = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now - tonumber(ARGV[9]))
for _, gone in ipairs(stale) do
    redis.call('ZREM', KEYS[2], gone)
    redis.call('ZREM', KEYS[3], gone)
end
local s = redis.call('HMGET', KEYS[1], 'req', 'tok', 'ts', 'paused_until', 'vtime')
local req, tok, ts = tonumber(s[1]), tonumber(s[2]), tonumber(s[3])
local paused_until, vtime = tonumber(s[4] or 0), tonumber(s[5] or 0)
if not req then
    req, tok, ts = req_cap, tok_cap, now
end
local elapsed = math.max(0, now - ts)
req = math.min(req_cap, req + elapsed * req_rate)
tok = math.min(tok_cap, tok + elapsed * tok_rate)
local my_tag = tonumber(redis.call('ZSCORE', KEYS[2], waiter))
local fresh = not my_tag
if fresh then
    local cost = 1
    if tok_rate > 0 then cost = tokens end
    local last = tonumber(redis.call('HGET', KEYS[4], tenant) or 0)
    my_tag = math.max(vtime, last) + cost / weight
    redis.call('HSET', KEYS[4], tenant, tostring(my_tag))
end
local result = nil
if fresh and paused_until <= now and redis.call('ZCARD', KEYS[2]) == 0
    and (req_rate == 0 or req >= 1) and (tok_rate == 0 or tok >= math.min(tok_cap, tokens)) then
    -- The fast path: nobody waits and there is room, so the ask never enters the queue.
    if req_rate > 0 then req = req - 1 end
    if tok_rate > 0 then tok = tok - tokens end
    vtime = math.max(vtime, my_tag)
    redis.call('HSET', KEYS[1], 'req', tostring(req), 'tok', tostring(tok), 'ts', tostring(now),
        'vtime', tostring(vtime))
    redis.call('PEXPIRE', KEYS[1], ttl)
    redis.call('PEXPIRE', KEYS[4], ttl)
    return '0'
end
if fresh then
    redis.call('ZADD', KEYS[2], my_tag, waiter)
end
redis.call('ZADD', KEYS[3], now, waiter)
if paused_until > now then
    result = paused_until - now
else
    local rank = redis.call('ZCOUNT', KEYS[2], '-inf', '(' .. my_tag)
    local wait = 0
    if req_rate > 0 then
        local need = rank + 1
        if req < need then wait = math.max(wait, (need - req) / req_rate) end
    end
    if tok_rate > 0 then
        local need = (rank + 1) * tokens
        if rank == 0 then need = math.min(tok_cap, tokens) end
        if tok < need then wait = math.max(wait, (need - tok) / tok_rate) end
    end
    if wait > 0 then
        result = math.max(min_wait, wait)
    else
        if req_rate > 0 then req = req - 1 end
        if tok_rate > 0 then tok = tok - tokens end
        redis.call('ZREM', KEYS[2], waiter)
        redis.call('ZREM', KEYS[3], waiter)
        -- V never passes the queue's head (see MemoryLimiter.try_acquire).
        local head = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
        local bound = my_tag
        if head[2] then bound = math.min(my_tag, tonumber(head[2])) end
        vtime = math.max(vtime, bound)
        result = 0
    end
end
redis.call('HSET', KEYS[1], 'req', tostring(req), 'tok', tostring(tok), 'ts', tostring(now),
    'vtime', tostring(vtime))
for i = 1, 4 do redis.call('PEXPIRE', KEYS[i], ttl) end
return tostring(result)
"""

ADJUST = """
-- Charge a model's token bucket ARGV[1] more (negative: give back); KEYS[1] the state.
-- Only a started bucket: a missing one starts full on the next ask anyway.
if redis.call('HEXISTS', KEYS[1], 'tok') == 1 then
    redis.call('HINCRBYFLOAT', KEYS[1], 'tok', -tonumber(ARGV[1]))
end
return 1
"""

PAUSE = """
-- Pause a model until now + ARGV[1] ms unless already paused longer; KEYS[1] the state,
-- ARGV[2] the state's TTL in ms (kept at least as long as the pause).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local until_ms = now + tonumber(ARGV[1])
local current = tonumber(redis.call('HGET', KEYS[1], 'paused_until') or 0)
if until_ms > current then
    redis.call('HSET', KEYS[1], 'paused_until', tostring(until_ms))
end
redis.call('PEXPIRE', KEYS[1], math.max(tonumber(ARGV[2]), tonumber(ARGV[1]) + 1000))
return 1
"""


class RedisLimiter(LimiterBackend):
    """The limiter's state in Redis, shared by every process; Redis's clock is the clock.

    The limiter protects the provider; it is no account. When Redis does not answer, the call
    goes ahead and a warning is logged (fail open, as the API rate limit does): the provider's
    own 429s, and their pauses once Redis is back, still hold the calls back.

    Args:
        client: An asyncio Redis client (``decode_responses=True``).
        keys: Model → its four keys (``RedisKeys.limiter``), one hash tag.
    """

    def __init__(self, client: Any, keys: Callable[[str], Sequence[str]]) -> None:
        from redis.exceptions import RedisError

        self._client = client
        self._keys = keys
        self._redis_error = RedisError
        self._try = client.register_script(TRY_ACQUIRE)
        self._adjust = client.register_script(ADJUST)
        self._pause = client.register_script(PAUSE)

    async def try_acquire(self, ask: Ask) -> float:
        try:
            return await self._try_acquire(ask)
        except self._redis_error as exc:
            logger.warning("provider limiter unavailable, letting the call through: %s", exc)
            return 0.0

    async def _try_acquire(self, ask: Ask) -> float:
        reply = await self._try(
            keys=list(self._keys(ask.model)),
            args=[
                ask.waiter,
                ask.tenant,
                ask.weight,
                ask.tokens,
                *ask.limits.args(),
                STALE_S * 1000,
                STATE_TTL_S * 1000,
                MIN_WAIT_S * 1000,
            ],
        )
        return float(reply) / 1000.0

    async def withdraw(self, model: str, waiter: str) -> None:
        _, queue, seen, _ = self._keys(model)
        pipeline = self._client.pipeline(transaction=True)
        pipeline.zrem(queue, waiter)
        pipeline.zrem(seen, waiter)
        try:
            await pipeline.execute()
        except self._redis_error as exc:  # the waiter is dropped after STALE_S anyway
            logger.warning("provider limiter: a waiter could not withdraw: %s", exc)

    async def adjust(self, model: str, tokens: int) -> None:
        try:
            await self._adjust(keys=[self._keys(model)[0]], args=[tokens])
        except self._redis_error as exc:
            logger.warning("provider limiter: usage not settled: %s", exc)

    async def pause(self, model: str, seconds: float) -> None:
        try:
            await self._pause(
                keys=[self._keys(model)[0]], args=[math.ceil(seconds * 1000), STATE_TTL_S * 1000]
            )
        except self._redis_error as exc:
            logger.warning("provider limiter: the pause of %s not shared: %s", model, exc)

    async def close(self) -> None:
        await self._client.aclose()


class ProviderLimiter:
    """Takes capacity for model calls from a backend, waiting (fairly) while there is none.

    Args:
        backend: Where the state lives (:class:`MemoryLimiter` or :class:`RedisLimiter`).
        rng: Spreads the sleeps of waiters a little, so they do not ask in lockstep.
    """

    def __init__(self, backend: LimiterBackend, *, rng: random.Random | None = None) -> None:
        self._backend = backend
        self._rng = rng or random.Random()

    async def acquire(
        self,
        model: str,
        limits: ModelLimits,
        *,
        tenant: str,
        weight: int,
        tokens: int,
        park_after_s: float | None = None,
    ) -> float:
        """Wait until ``model`` has a request and ``tokens`` for this call, and take them.

        Args:
            model: The model (or endpoint) the limits are declared for.
            limits: Its declared limits.
            tenant: Whose call it is (fairness is between tenants).
            weight: The tenant's weight (its plan's priority; at least 1).
            tokens: The call's estimated tokens (:func:`estimate_tokens`).
            park_after_s: The longest wait to sleep through; None: any.

        Returns:
            Seconds waited.

        Raises:
            CapacityWait: The limiter answered a wait longer than ``park_after_s``.
        """
        ask = Ask(
            model=model,
            waiter=uuid.uuid4().hex,
            tenant=tenant,
            weight=max(1, weight),
            tokens=max(1, tokens),
            limits=limits,
        )
        started = time.monotonic()
        taken = False
        try:
            while True:
                wait_s = await self._backend.try_acquire(ask)
                if wait_s <= 0:
                    taken = True
                    return time.monotonic() - started
                if park_after_s is not None and wait_s > park_after_s:
                    raise CapacityWait(model, wait_s)
                await asyncio.sleep(min(MAX_WAIT_S, wait_s) * (1.0 + 0.1 * self._rng.random()))
        finally:
            if not taken:
                await asyncio.shield(self._backend.withdraw(model, ask.waiter))

    async def settle(self, model: str, reserved: int, used: int) -> None:
        """Correct a call's reservation by its real usage (``used`` tokens)."""
        if used != reserved:
            await self._backend.adjust(model, used - reserved)

    async def pause(self, model: str, seconds: float) -> None:
        """Hold every call of ``model``, in every process sharing the backend, ``seconds``."""
        if seconds > 0:
            await self._backend.pause(model, seconds)

    async def close(self) -> None:
        await self._backend.close()
