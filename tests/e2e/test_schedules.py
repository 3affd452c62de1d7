"""End to end, issue 20: a schedule made with the CLI fires on a real deployment.

``moorline serve`` and ``moorline worker`` both run the scheduler chore (one leads); the
worker executes the ticks' runs. The CLI creates, lists, pauses, resumes and deletes; the
client reads the schedule's counts, which must match the runs stored (no tick doubled by the
two schedulers).
"""

import asyncio
import json
from collections.abc import Iterator

import pytest

from moorline import Client
from moorline.client.results import Schedule
from moorline.types import RunStatus
from tests.e2e.conftest import Cluster, run_cluster
from tests.e2e.test_e2e import cli_as, new_tenant
from tests.helpers import wait_for
from tests.integration.test_cli import assert_one_line_error


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("e2e_schedules")
    with run_cluster(
        root,
        MOORLINE_DATABASE_URL=f"sqlite+aiosqlite:///{root / 'moorline.db'}",
        MOORLINE_SCHEDULER_INTERVAL="0.2",
    ) as c:
        yield c


async def greet_runs(client: Client) -> list[RunStatus]:
    page = await client.list_runs(workflow="greet", limit=200)
    return [run.status for run in page.runs]


async def test_a_schedule_made_with_the_cli_fires_pauses_and_is_deleted(
    cluster: Cluster,
) -> None:
    key = await new_tenant(cluster)
    made = cli_as(
        cluster, key, "schedules", "create", "greet", "--every", "1",
        "--input", '{"name": "tick"}', "--json",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    schedule_id = json.loads(made.stdout)["schedule_id"]
    async with Client(cluster.url, key) as client:

        async def fired(at_least: int) -> Schedule | None:
            schedule = await client.get_schedule(schedule_id)
            return schedule if schedule.fired_count >= at_least else None

        await wait_for(lambda: fired(3), timeout_s=20, message="three ticks fired")
        statuses = await wait_for(
            lambda: _all_succeeded(client), timeout_s=20, message="the ticks' runs succeeded"
        )
        assert statuses is not None and len(statuses) >= 3

        paused = cli_as(cluster, key, "schedules", "pause", schedule_id, "--json")
        assert json.loads(paused.stdout)["paused"] is True, paused.stderr
        # A pass already firing when the pause landed may add its tick: let it finish first.
        await asyncio.sleep(0.5)
        before = await client.get_schedule(schedule_id)
        await asyncio.sleep(2.0)  # two ticks' worth of observation: nothing may fire
        after = await client.get_schedule(schedule_id)
        assert after.fired_count == before.fired_count
        # Two schedulers (serve's and the worker's), one run per counted tick.
        assert len(await greet_runs(client)) == after.fired_count
        assert after.refused_count == 0 and after.last_run_id is not None

    listed = cli_as(cluster, key, "schedules", "list")
    assert schedule_id in listed.stdout and "paused" in listed.stdout, listed.stderr
    resumed = cli_as(cluster, key, "schedules", "resume", schedule_id)
    assert resumed.returncode == 0 and "next" in resumed.stdout, resumed.stderr
    deleted = cli_as(cluster, key, "schedules", "delete", schedule_id)
    assert deleted.returncode == 0, deleted.stderr
    again = cli_as(cluster, key, "schedules", "delete", schedule_id)
    assert_one_line_error(again, "error: schedule_not_found")
    bad = cli_as(cluster, key, "schedules", "create", "greet", "--cron", "* * *")
    assert_one_line_error(bad, "error: invalid_request")


async def _all_succeeded(client: Client) -> list[RunStatus] | None:
    statuses = await greet_runs(client)
    done = statuses and all(status is RunStatus.SUCCEEDED for status in statuses)
    return statuses if done else None
