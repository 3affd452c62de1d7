"""The rate limiter's in-memory moving window (deployments without Redis)."""

import pytest

from moorline.admission.ratelimit import RateLimiter
from moorline.errors import RateLimited
from moorline.settings import Settings


async def test_the_limiter_refuses_with_the_time_until_there_is_room() -> None:
    limiter = RateLimiter(Settings())
    state = await limiter.hit("key:a", "2/minute")
    assert state is not None and (state.limit, state.remaining) == (2, 1)
    assert 59 <= state.reset_s <= 60
    await limiter.hit("key:a", "2/minute")
    with pytest.raises(RateLimited) as refused:
        await limiter.hit("key:a", "2/minute")
    assert 1 <= refused.value.reset_s <= 60
    assert await limiter.hit("key:b", "2/minute") is not None
    await limiter.close()
