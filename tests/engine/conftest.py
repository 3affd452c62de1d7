"""Engine fixtures: the RuntimeStore fixtures of ``tests/runtime``, for tests on both stores.

The engine runs on the in-memory store and on one Redis server: how Redis is run (Sentinel,
Cluster) is the store's business, held to the same contract in ``tests/runtime``.
"""

import pytest

from tests.runtime.conftest import (  # noqa: F401 - fixtures, found by name
    memory_store,
    redis_client,
    redis_prefix,
    redis_store,
    store,
)


@pytest.fixture(params=["memory", "redis"])
def store_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind
