"""API rate limits per credential, through the ``limits`` library.

Each plan names a rate (``"20/second"``); every trigger made with one API key (or delivered to
one webhook) counts against that credential's window. The strategy is the library's *moving
window*: at most ``count`` hits in any span of the period, with no double burst at a window
boundary as a fixed window would allow (docs/reliability.md F3).

Storage follows the deployment. With Redis, each window is the library's Redis moving window,
under its key (``<prefix>:ratelimit:`` (:meth:`RedisKeys.rate_limits`) then the library's
``item.key_for(identity)``) and with its list of hit timestamps, but counted by one Lua script of
ours, :data:`MOVING_WINDOW_HIT`: the library's ``hit`` and ``get_window_stats`` are two scripts,
so two round trips to Redis per trigger where this is one (each round trip cost the API process
about a tenth of a trigger's CPU). The script is the library's two (``acquire_moving_window.lua``
then ``moving_window.lua``) run back to back, so the window and its keys stay the library's: a
process running the library's own calls counts in the same windows. The key gets its expiry in
the same script that writes it. Without Redis, the library's *synchronous* memory
storage keeps the same window in this process's memory (:class:`SweptMemoryStorage`): its
calls never block, whereas its async twin starts, on every hit, an expiry task that hops to a
thread while it holds the key's lock, so every trigger of one API key queued behind a thread
pool round trip. The synchronous storage in turn sweeps expired entries from a
``threading.Timer`` of 10 ms that it starts again on the first call after the last one ended:
under load, a new thread every few triggers, each start costing the event loop more than the
rest of the rate limit (a profile of a loaded server showed it among the largest costs of a
trigger). :class:`SweptMemoryStorage` sweeps from the caller instead, at most once per
:data:`SWEEP_INTERVAL_S`.

A rate limit protects the service; it is not an account of anything. When its storage does not
answer the request is let through and a warning logged (fail open, docs/reliability.md F5),
while the daily quota, which is an account, fails closed.
"""

import logging
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import limits
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter as SyncMovingWindowRateLimiter

from moorline import fastpaths
from moorline.admission.quotas import REDIS_CONNECTIONS
from moorline.errors import RateLimited
from moorline.runtime.keys import RedisKeys
from moorline.settings import Settings

if TYPE_CHECKING:
    from redis.commands.core import AsyncScript

    from moorline.runtime.redis import ScriptCall
    from moorline.runtime.redis_client import RedisClient

logger = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 1.0
"""Seconds between two sweeps of expired entries out of the memory storage. The sweep only bounds
memory: a window's count ignores expired entries whether or not they were swept."""


MOVING_WINDOW_HIT = """
-- Hits on a moving window, then the window's state: the limits library's
-- acquire_moving_window.lua and moving_window.lua (limits 5.x) in one script, the first run
-- once per hit.
-- KEYS[1] the window: a list of hit timestamps (seconds), newest first.
-- ARGV[1] now (seconds), ARGV[2] the limit, ARGV[3] the window's length (whole seconds),
-- ARGV[4] the hits (1 when absent): counted one by one until the window is full.
-- Returns {hits counted, oldest timestamp in the window, hits in the window}.
local now = tonumber(ARGV[1])
local limit = tonumber(ARGV[2])
local expiry = tonumber(ARGV[3])
local start = now - expiry
local allowed = 0
for _ = 1, tonumber(ARGV[4] or 1) do
    -- The window is full when its limit-th newest hit is still in it.
    local entry = redis.call('LINDEX', KEYS[1], limit - 1)
    if entry and tonumber(entry) >= start then
        break
    end
    redis.call('LPUSH', KEYS[1], ARGV[1])
    allowed = allowed + 1
end
if allowed > 0 then
    redis.call('LTRIM', KEYS[1], 0, limit - 1)
    redis.call('EXPIRE', KEYS[1], expiry)
end
-- Entries are newest first: find the last one still in the window (binary search).
local low = 0
local high = math.min(limit, redis.call('LLEN', KEYS[1])) - 1
local index = nil
while low <= high do
    local mid = math.floor((low + high) / 2)
    local value = tonumber(redis.call('LINDEX', KEYS[1], mid))
    if value and value >= start then
        index = mid
        low = mid + 1
    else
        high = mid - 1
    end
end
if index then
    return {allowed, redis.call('LINDEX', KEYS[1], index), index + 1}
end
return {allowed, ARGV[1], 0}
"""


class SweptMemoryStorage(MemoryStorage):
    """The library's memory storage, its expired entries swept by the caller, not a thread.

    The library schedules its sweep through the private ``__schedule_expiry`` on every write;
    this class replaces that method (by its mangled name) with a sweep done in line at most
    once per :data:`SWEEP_INTERVAL_S`. Only ``__init__`` still starts the library's timer,
    once. ``tests/unit/test_ratelimit.py`` checks that no hit starts a thread, and
    ``tests/compat/test_private_names.py`` that both mangled names are still there
    (:mod:`moorline.fastpaths`), so a version of the library that renames them fails there
    rather than silently going back to threads.
    """

    def __init__(self) -> None:
        super().__init__()
        self._next_sweep = time.monotonic() + SWEEP_INTERVAL_S

    def _MemoryStorage__schedule_expiry(self) -> None:
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + SWEEP_INTERVAL_S
            self.sweep()

    def sweep(self) -> None:
        """Drop every expired entry and counter now."""
        self._MemoryStorage__expire_events()  # type: ignore[attr-defined]  # mangled private


def _memory_storage(*, fast: bool) -> MemoryStorage:
    """:class:`SweptMemoryStorage`, or the library's own storage without ``fast``.

    ``fast`` is the setting ``fast_paths``; the library's storage sweeps from its timer thread
    and needs none of its internals.

    Raises:
        ConfigError: ``fast`` and the installed ``limits`` lacks the method replaced here.
    """
    if not fast:
        return MemoryStorage()
    fastpaths.require("limits")
    return SweptMemoryStorage()


@dataclass(frozen=True, slots=True, kw_only=True)
class RateLimitState:
    """Where a credential stands in its window after a request (the ``RateLimit-*`` headers).

    Attributes:
        limit: Requests allowed per window.
        remaining: Requests left in the current window.
        reset_s: Whole seconds until the window has room for one more request again (at
            least 1 when none remain).
    """

    limit: int
    remaining: int
    reset_s: int


class RateLimiter:
    """Counts requests per credential against its plan's rate; refuses the ones over it."""

    def __init__(self, settings: Settings) -> None:
        """Choose the storage: Redis when ``MOORLINE_REDIS_URL`` is set, else memory."""
        self._client: RedisClient | None = None
        self._redis: tuple[RedisClient, AsyncScript, type[Exception]] | None = None
        self._memory = SyncMovingWindowRateLimiter(_memory_storage(fast=settings.fast_paths))
        self._key_prefix = RedisKeys(settings.redis_prefix).rate_limits()
        if settings.redis_url:
            from redis.exceptions import RedisError

            from moorline.runtime.redis import run_scripts
            from moorline.runtime.redis_client import RedisConnector

            self._run_scripts = run_scripts
            # Our own client, so that close() can release its connections; a blocking pool, so
            # that a burst waits for a connection instead of failing (and being let through).
            self._client = client = RedisConnector(settings.redis_url).client(
                max_connections=REDIS_CONNECTIONS
            )
            self._redis = (client, client.register_script(MOVING_WINDOW_HIT), RedisError)
        self._items: dict[str, limits.RateLimitItem] = {}

    def _item(self, rate: str) -> limits.RateLimitItem:
        item = self._items.get(rate)
        if item is None:
            # Plans validate their rate (moorline.plans.parse_rate_limit) with the same grammar.
            item = self._items[rate] = limits.parse(rate)
        return item

    @property
    def is_shared(self) -> bool:
        """Whether the windows live in Redis (shared by every API process), not in memory.

        Only then does a hit cost a round trip, which :meth:`hit_many` shares among a batch.
        """
        return self._redis is not None

    async def hit(self, identity: str, rate: str) -> RateLimitState | None:
        """Count one request of ``identity`` against ``rate``.

        Args:
            identity: The credential the request came with (never the secret itself).
            rate: The plan's rate, ``"<count>/<second|minute|hour|day>"``.

        Returns:
            The credential's window after this request; None when the storage did not
            answer (the request is let through).

        Raises:
            RateLimited: the window is full; nothing was counted.
        """
        [state] = await self.hit_many([(identity, rate)])
        if isinstance(state, RateLimited):
            raise state
        return state

    async def hit_many(
        self, hits: Sequence[tuple[str, str]]
    ) -> list[RateLimitState | RateLimited | None]:
        """Count one request per ``(identity, rate)`` of ``hits``, in one Redis round trip.

        Returns:
            Per hit, in order: the window after it; the refusal of a hit over the limit
            (nothing was counted for it); or None when the storage did not answer (every hit is
            let through).
        """
        if self._redis is None:
            return list(self._hit_memory(hits))
        client, _, redis_error = self._redis
        try:
            replies = await self._run_scripts(client, self.script_calls(hits))
        except redis_error as exc:
            logger.warning("rate limit storage unavailable, letting the request through: %s", exc)
            return [None] * len(hits)
        return list(self.read_replies(hits, replies))

    def _hit_memory(self, hits: Sequence[tuple[str, str]]) -> list[RateLimitState | RateLimited]:
        """:meth:`hit_many` in this process's memory, with the Redis script's counting.

        One hit of the library per credential and rate, costing as many as the window takes
        of its hits (no await in between, so nothing else counts meanwhile): a bulk
        submission's thousand triggers are one entry in the window's list, not a thousand
        inserts at its head.
        """
        windows: dict[tuple[str, str], tuple[int, float, int]] = {}
        for (identity, rate), count in Counter(hits).items():
            item = self._item(rate)
            allowed = count
            if not self._memory.hit(item, identity, cost=count):
                # Not all of them fit (the hit counted none): as many as the window has room for.
                allowed = min(count, self._memory.get_window_stats(item, identity).remaining)
                if allowed > 0:
                    self._memory.hit(item, identity, cost=allowed)
            reset_at, remaining = self._memory.get_window_stats(item, identity)
            windows[identity, rate] = (allowed, reset_at, remaining)
        return self._spread(hits, windows)

    def script_calls(self, hits: Sequence[tuple[str, str]]) -> "list[ScriptCall]":
        """The Redis script calls that count ``hits`` (see :meth:`hit_many`), for a pipeline.

        One call per credential and rate, however many of its hits: a burst from one API key
        costs Redis one script, not one per trigger. With :meth:`read_replies`, lets another
        Redis user (admission's gate) send them in its own round trip. Only with Redis
        storage (:attr:`is_shared`).
        """
        if self._redis is None:
            raise RuntimeError("the rate limits are in memory, not in Redis")
        _, script, _ = self._redis
        now = time.time()
        calls: list[ScriptCall] = []
        for (identity, rate), count in Counter(hits).items():
            item = self._item(rate)
            key = f"{self._key_prefix}:{item.key_for(identity)}"
            calls.append((script, [key], [now, item.amount, item.get_expiry(), count]))
        return calls

    def read_replies(
        self, hits: Sequence[tuple[str, str]], replies: Sequence[Any]
    ) -> list[RateLimitState | RateLimited]:
        """Per hit, the window after it or its refusal, from the replies of :meth:`script_calls`."""
        windows: dict[tuple[str, str], tuple[int, float, int]] = {}
        for (identity, rate), (allowed, oldest, count) in zip(Counter(hits), replies, strict=True):
            item = self._item(rate)
            reset_at = float(oldest) + item.get_expiry()
            windows[identity, rate] = (int(allowed), reset_at, item.amount - int(count))
        return self._spread(hits, windows)

    def _spread(
        self,
        hits: Sequence[tuple[str, str]],
        windows: dict[tuple[str, str], tuple[int, float, int]],
    ) -> list[RateLimitState | RateLimited]:
        """Per hit, its state, from each credential's (hits counted, reset time, room left).

        A credential's hits were counted in their order until its window was full: the first
        ones see the window fill up one hit at a time, the rest are refused.
        """
        seen: Counter[tuple[str, str]] = Counter()
        states: list[RateLimitState | RateLimited] = []
        for hit in hits:
            allowed, reset_at, remaining = windows[hit]
            nth = seen[hit]
            seen[hit] += 1
            # The nth counted hit left remaining + (allowed - 1 - nth) hits in the window.
            left = remaining + allowed - 1 - nth
            states.append(self._state(self._item(hit[1]), hit[1], nth < allowed, reset_at, left))
        return states

    @staticmethod
    def _state(
        item: limits.RateLimitItem, rate: str, allowed: bool, reset_at: float, remaining: int
    ) -> RateLimitState | RateLimited:
        """The state after a hit, or the refusal of a hit over the limit."""
        reset_s = max(1, math.ceil(reset_at - time.time()))
        if not allowed:
            return RateLimited(
                f"API rate limit of {rate} exceeded; retry in {reset_s}s",
                limit=item.amount,
                reset_s=reset_s,
            )
        return RateLimitState(limit=item.amount, remaining=remaining, reset_s=reset_s)

    async def close(self) -> None:
        """Release the Redis connections, if any; idempotent."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()
