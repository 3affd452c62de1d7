"""Integration fixtures: the Redis fixtures of ``tests/runtime``, for tests that deploy Redis."""

from tests.runtime.conftest import (  # noqa: F401 - fixtures, found by name
    redis_client,
    redis_prefix,
)
