"""Engine fixtures: the RuntimeStore fixtures of ``tests/runtime``, for tests on both stores."""

from tests.runtime.conftest import (  # noqa: F401 - fixtures, found by name
    memory_store,
    redis_client,
    redis_prefix,
    redis_store,
    store,
    store_kind,
)
