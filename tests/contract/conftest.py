"""The contract suite runs on PgBouncer too: PostgreSQL through transaction pooling.

Only here, not in every module that asks for ``backend``: the contract is what the database
layer promises, and it must hold when each transaction may get another server session.
"""

import pytest

from tests.conftest import BACKENDS


@pytest.fixture(scope="module", params=[*BACKENDS, "pgbouncer"])
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name
