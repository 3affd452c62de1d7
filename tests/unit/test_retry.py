"""Retry policy: exponential backoff with full jitter, attempt budgets, non-retryable errors."""

import random

import pytest

from moorline.dispatch.retry import RetryPolicy
from moorline.errors import ConfigError


def test_ceiling_doubles_from_base_up_to_cap() -> None:
    policy = RetryPolicy(base_s=1.0, cap_s=10.0)
    assert [policy.ceiling_s(n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert policy.ceiling_s(10_000) == 10.0


def test_full_jitter_stays_in_window_and_spreads() -> None:
    policy = RetryPolicy(base_s=2.0, cap_s=60.0)
    rng = random.Random(7)
    delays = [policy.next_delay(3, rng) for _ in range(2000)]
    assert all(0.0 <= d <= 8.0 for d in delays)
    # Full jitter covers the whole window, not just its top.
    assert min(delays) < 0.5
    assert max(delays) > 7.5
    assert 3.5 < sum(delays) / len(delays) < 4.5


def test_same_seed_same_delays() -> None:
    policy = RetryPolicy()
    first = [policy.next_delay(n, random.Random(1)) for n in range(1, 5)]
    again = [policy.next_delay(n, random.Random(1)) for n in range(1, 5)]
    assert first == again


def test_attempts_count_from_one() -> None:
    with pytest.raises(ValueError):
        RetryPolicy().ceiling_s(0)


def test_exhaustion() -> None:
    policy = RetryPolicy()
    assert not policy.is_exhausted(1, 3)
    assert not policy.is_exhausted(2, 3)
    assert policy.is_exhausted(3, 3)
    assert policy.is_exhausted(4, 3)


class Permanent(Exception):
    pass


def test_decide() -> None:
    policy = RetryPolicy(base_s=1.0, cap_s=4.0, non_retryable=(Permanent,))
    rng = random.Random(0)
    retry = policy.decide(RuntimeError("flaky"), 1, 3, rng)
    assert retry.retry and retry.reason == "retry" and 0.0 <= retry.delay_s <= 1.0
    last = policy.decide(RuntimeError("flaky"), 3, 3, rng)
    assert (last.retry, last.reason) == (False, "max attempts")
    permanent = policy.decide(Permanent(), 1, 3, rng)
    assert (permanent.retry, permanent.reason) == (False, "non-retryable")


def test_default_non_retryable_errors() -> None:
    policy = RetryPolicy()
    assert not policy.is_retryable(TypeError("bad arguments"))
    assert not policy.is_retryable(ConfigError("bad setting"))
    assert policy.is_retryable(TimeoutError())
    assert policy.is_retryable(ConnectionError())


def test_bad_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        RetryPolicy(base_s=10.0, cap_s=1.0)
    with pytest.raises(ConfigError):
        RetryPolicy(base_s=-1.0)
