"""Fault-test fixtures: the Redis fixtures of ``tests/runtime``, for workers sharing a store."""

from tests.runtime.conftest import (  # noqa: F401 - fixtures, found by name
    redis_client,
    redis_prefix,
)
