"""``moorline serve`` and ``moorline worker`` behind PgBouncer in transaction mode, no Redis.

Both processes reach PostgreSQL only through the test process's PgBouncer
(``MOORLINE_DATABASE_POOLER=pgbouncer``), whose few server sessions they share; their LISTEN
goes straight to PostgreSQL (``MOORLINE_LISTEN_URL``). The worker's poll is 30 s, so a run that
starts within seconds was woken by a NOTIFY: a new run, and a parked run whose permission was
decided. Without ``MOORLINE_LISTEN_URL`` the processes say once that they poll, and do.
"""

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from moorline import Client
from moorline.types import RunStatus
from tests.api.conftest import ADMIN_TOKEN
from tests.e2e.conftest import Cluster, run_cluster, upgrade_with_cli
from tests.helpers import wait_for
from tests.pgbouncer import PrivateBouncer, direct_url
from tests.servers import run_sql, unique_name

SLOW_POLL_S = 30.0
WOKEN_WITHIN_S = 5.0
"""Well under the slow poll: a run that starts within it was woken, not polled."""

DRAIN_RUNS = 40
DRAIN_S = 60.0
FALLBACK_POLL_S = 0.5
FALLBACK_LINE = "no LISTEN behind PgBouncer without MOORLINE_LISTEN_URL"


@pytest.fixture(scope="module")
def bounced_database(pgbouncer: PrivateBouncer) -> Iterator[dict[str, str]]:
    """A migrated database reached through PgBouncer: the settings of every process."""
    name = unique_name("moorline_pgb")
    run_sql("postgresql", f"CREATE DATABASE {name}")
    settings = {
        "MOORLINE_DATABASE_URL": pgbouncer.url(name),
        "MOORLINE_DATABASE_POOLER": "pgbouncer",
    }
    try:
        upgrade_with_cli(settings)  # the migrations run through PgBouncer too
        yield {**settings, "MOORLINE_LISTEN_URL": direct_url(name)}
    finally:
        run_sql("postgresql", f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="module")
def bounced_cluster(
    bounced_database: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    with run_cluster(
        tmp_path_factory.mktemp("pgb"),
        **bounced_database,
        MOORLINE_POLL_INTERVAL=str(SLOW_POLL_S),
        MOORLINE_PARK_AFTER="0",
    ) as cluster:
        yield cluster


async def _tenant_key(cluster: Cluster) -> str:
    async with Client(cluster.url, admin_token=ADMIN_TOKEN) as admin:
        tenant = await admin.create_tenant(f"pgb-{uuid.uuid4().hex[:8]}", "team")
    assert tenant.api_key is not None
    return tenant.api_key


async def _drain(cluster: Cluster, count: int, within_s: float) -> None:
    """Trigger ``count`` runs at once (a new tenant's); every one must succeed in time."""
    key = await _tenant_key(cluster)
    async with Client(cluster.url, key) as client:
        await asyncio.gather(
            *(client.trigger("greet", {"name": f"n{index}"}) for index in range(count))
        )

        async def drained() -> bool:
            page = await client.list_runs(status=RunStatus.SUCCEEDED, limit=count)
            return len(page.runs) == count

        await wait_for(drained, timeout_s=within_s, interval_s=0.2, message="the runs to end")
        every = await client.list_runs(limit=count + 1)
    assert sorted(run.status for run in every.runs) == [RunStatus.SUCCEEDED] * count


async def test_new_runs_wake_the_worker_through_listen(bounced_cluster: Cluster) -> None:
    key = await _tenant_key(bounced_cluster)
    async with Client(bounced_cluster.url, key) as client:
        # One after another: each finds the worker back in its 30 s wait.
        for index in range(3):
            accepted = await client.trigger("greet", {"name": f"w{index}"})
            run = await client.wait(accepted.run_id, timeout=WOKEN_WITHIN_S)
            assert run.status is RunStatus.SUCCEEDED


async def test_a_decided_permission_wakes_its_parked_run(bounced_cluster: Cluster) -> None:
    key = await _tenant_key(bounced_cluster)
    async with Client(bounced_cluster.url, key) as client:
        accepted = await client.trigger("deploy", {"target": "prod"})

        async def parked() -> bool:
            run = await client.get_run(accepted.run_id)
            return run.status is RunStatus.WAITING and run.pending_interrupt is not None

        await wait_for(parked, timeout_s=WOKEN_WITHIN_S * 2, message="the run to park")
        await client.approve(accepted.run_id)
        run = await client.wait(accepted.run_id, timeout=WOKEN_WITHIN_S)
    assert run.output == {"deployed": True, "reason": "approved"}


async def test_a_burst_of_runs_drains(bounced_cluster: Cluster) -> None:
    await _drain(bounced_cluster, DRAIN_RUNS, DRAIN_S)


def test_without_a_listen_url_the_processes_poll(
    bounced_database: dict[str, str], tmp_path: Path
) -> None:
    settings = {k: v for k, v in bounced_database.items() if k != "MOORLINE_LISTEN_URL"}
    with run_cluster(tmp_path, **settings, MOORLINE_POLL_INTERVAL=str(FALLBACK_POLL_S)) as cluster:
        asyncio.run(_drain(cluster, 5, DRAIN_S))
        logs = [log.read_text() for log in cluster.logs]
    assert all(log.count(FALLBACK_LINE) == 1 for log in logs), logs
