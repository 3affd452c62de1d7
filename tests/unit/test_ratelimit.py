"""The rate limiter's in-memory moving window (deployments without Redis)."""

import threading
import time

import limits
import pytest
from limits.strategies import MovingWindowRateLimiter

from moorline.admission.ratelimit import RateLimiter, SweptMemoryStorage
from moorline.errors import RateLimited
from moorline.settings import Settings


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "public"])
async def test_the_limiter_refuses_with_the_time_until_there_is_room(fast: bool) -> None:
    # fast_paths=False: the library's own memory storage, its sweep on its timer thread.
    limiter = RateLimiter(Settings(fast_paths=fast))
    state = await limiter.hit("key:a", "2/minute")
    assert state is not None and (state.limit, state.remaining) == (2, 1)
    assert 59 <= state.reset_s <= 60
    await limiter.hit("key:a", "2/minute")
    with pytest.raises(RateLimited) as refused:
        await limiter.hit("key:a", "2/minute")
    assert 1 <= refused.value.reset_s <= 60
    assert await limiter.hit("key:b", "2/minute") is not None
    await limiter.close()


async def test_hits_start_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # The library's memory storage starts a timer thread to sweep expired entries whenever its
    # last one has ended; under load that was a thread start every few triggers.
    limiter = RateLimiter(Settings(fast_paths=True))
    started: list[threading.Thread] = []
    start = threading.Thread.start

    def counted(thread: threading.Thread) -> None:
        started.append(thread)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", counted)
    deadline = time.monotonic() + 0.1  # long past the library's 10 ms timer
    hits = 0
    while time.monotonic() < deadline or hits < 100:
        await limiter.hit(f"key:{hits % 7}", "1000000/second")
        hits += 1
    assert started == []
    await limiter.close()


def test_a_sweep_keeps_the_window_and_drops_only_expired_entries() -> None:
    storage = SweptMemoryStorage()
    limiter = MovingWindowRateLimiter(storage)
    item = limits.parse("3/hour")
    assert limiter.hit(item, "key:a") and limiter.hit(item, "key:a")
    storage.sweep()
    assert limiter.get_window_stats(item, "key:a").remaining == 1
    assert limiter.hit(item, "key:a") and not limiter.hit(item, "key:a")
