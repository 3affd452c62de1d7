"""Admission on Redis Sentinel and Redis Cluster: the Redis tests of ``test_admission.py`` again.

The same test functions (imported, so pytest collects them here too) with ``MOORLINE_REDIS_URL``
a ``redis+sentinel://`` URL and then a ``redis+cluster://`` one: exact quotas under 200
concurrent triggers, rate-limit hits before quota units, the gate's pipelined scripts (on
Cluster split by node, each script's key in its own slot) and their reload after
``SCRIPT FLUSH``. Left to the one-server module: the check that the window is the ``limits``
library's own (its storage is not what Moorline uses on any topology; the keys are the same).
"""

from collections.abc import AsyncIterator

import pytest

from moorline.runtime.redis_client import RedisConnector
from tests.api.test_admission import (  # noqa: F401 - tests and fixtures, collected here again
    Deployment,
    api_database_url,
    test_a_trigger_refused_by_the_rate_limit_keeps_no_unit,
    test_concurrent_triggers_admit_exactly_the_quota,
    test_hits_of_one_credential_in_one_call_count_one_by_one,
    test_rate_limit_hits_are_counted_before_quota_units,
    test_the_admins_tenants_view_counts_as_usage_does,
    test_the_gate_loads_the_scripts_redis_forgot,
    test_units_the_gate_took_for_runs_not_stored_are_given_back,
)
from tests.runtime.conftest import delete_keys, keys_without_ttl
from tests.servers import unique_name


@pytest.fixture(scope="module", params=["postgresql"])
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module", params=["sentinel", "cluster"])
def redis_url(request: pytest.FixtureRequest) -> str:
    """The URL of a Sentinel-watched master, or of a six-node Cluster."""
    url: str = request.getfixturevalue(f"{request.param}_redis").url
    return url


@pytest.fixture
async def deployment(redis_url: str) -> AsyncIterator[Deployment]:
    client = RedisConnector(redis_url).client(decode_responses=True)
    prefix = unique_name("mo_api")
    try:
        yield Deployment(redis=client, prefix=prefix, url=redis_url)
        assert await keys_without_ttl(client, prefix) == []
    finally:
        await delete_keys(client, prefix)
        await client.aclose()
