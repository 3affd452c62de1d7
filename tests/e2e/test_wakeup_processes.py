"""Wake-ups between two real processes on one SQLite file, without Redis.

``moorline serve --workers 0`` takes the triggers and a separate ``moorline worker`` runs them;
they share only the database file (and the directory of wake-up sockets beside it). With the
worker's poll at 30 s, only a wake-up can start a run within seconds; with the directory made
unusable, the worker falls back to its poll and still runs everything.
"""

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from moorline import Client
from moorline.dispatch.datagrams import SOCKET_SUFFIX, directory_for
from tests.api.conftest import ADMIN_TOKEN
from tests.e2e.conftest import Cluster, run_cluster
from tests.helpers import wait_for

SLOW_POLL_S = 30.0
STARTED_WITHIN_S = 5.0
"""Well under the slow poll: a run that starts within it was woken, not polled."""

FALLBACK_POLL_S = 0.5


def _database(root: Path) -> Path:
    return root / "moorline.db"


@pytest.fixture(scope="module")
def slow_poll_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("wake")
    with run_cluster(
        root,
        MOORLINE_DATABASE_URL=f"sqlite+aiosqlite:///{_database(root)}",
        MOORLINE_POLL_INTERVAL=str(SLOW_POLL_S),
    ) as cluster:
        yield cluster


async def _runs_start_quickly(cluster: Cluster, count: int, within_s: float) -> None:
    async with Client(cluster.url, admin_token=ADMIN_TOKEN) as admin:
        key = (await admin.create_tenant(f"wake-{uuid.uuid4().hex[:8]}", "team")).api_key
    async with Client(cluster.url, key) as client:
        for index in range(count):
            run = await client.trigger("greet", {"name": f"n{index}"})

            async def started(run_id: str = run.run_id) -> bool:
                return (await client.get_run(run_id)).started_at is not None

            await wait_for(started, timeout_s=within_s, message=f"run {index} to start")


async def test_a_worker_process_is_woken_by_the_api_process(slow_poll_cluster: Cluster) -> None:
    directory = directory_for(str(_database(slow_poll_cluster.root)))
    # The worker's socket only: the API process runs no worker loop (--workers 0), so nothing
    # there waits for a lane and it does not listen (each datagram would be dropped unread).
    assert len(list(directory.glob(f"*{SOCKET_SUFFIX}"))) == 1
    # Several in a row: each one after the worker went back to its 30 s wait.
    await _runs_start_quickly(slow_poll_cluster, 3, STARTED_WITHIN_S)


async def test_child_runs_wake_the_worker_that_started_them(slow_poll_cluster: Cluster) -> None:
    # The children are queued by the worker's own workflow, not through the API: the worker
    # wakes its lane itself, or they would wait for its 30 s poll.
    async with Client(slow_poll_cluster.url, admin_token=ADMIN_TOKEN) as admin:
        key = (await admin.create_tenant(f"fan-{uuid.uuid4().hex[:8]}", "team")).api_key
    async with Client(slow_poll_cluster.url, key) as client:
        accepted = await client.trigger("fan", {"children": 5})
        run = await client.wait(accepted.run_id, timeout=STARTED_WITHIN_S * 2)
    assert run.output == {"greeted": 5}


def test_an_unusable_socket_directory_falls_back_to_the_poll(tmp_path: Path) -> None:
    database = _database(tmp_path)
    directory_for(str(database)).write_text("a file where the directory should be")
    with run_cluster(
        tmp_path,
        MOORLINE_DATABASE_URL=f"sqlite+aiosqlite:///{database}",
        MOORLINE_POLL_INTERVAL=str(FALLBACK_POLL_S),
    ) as cluster:
        asyncio.run(_runs_start_quickly(cluster, 2, STARTED_WITHIN_S))
        worker_log = cluster.logs[1].read_text()
    assert "wake-ups between processes on this SQLite file are off" in worker_log
