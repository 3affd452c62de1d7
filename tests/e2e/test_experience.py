"""End to end, issue 21: what a new user and an operator meet on a real deployment.

The workflow catalogue (``moorline workflows``, and the list ``serve`` and ``worker`` print at
start) and a failed run's traceback (the API, ``moorline status``, the worker's log), through
the ``cluster`` of ``conftest.py``: ``moorline serve`` and ``moorline worker`` on SQLite.
"""

import json
from typing import Any

from moorline import Client
from moorline.types import RunStatus
from tests.api.conftest import ADMIN_TOKEN
from tests.e2e.conftest import APP, Cluster
from tests.e2e.test_e2e import TIMEOUT_S, cli_as, new_tenant, wait_until
from tests.helpers import wait_for
from tests.integration.test_cli import assert_one_line_error


async def test_the_cli_lists_the_served_workflows(cluster: Cluster) -> None:
    key = await new_tenant(cluster)
    listed = cli_as(cluster, key, "workflows", "--json")
    assert listed.returncode == 0, listed.stderr
    entries = {entry["name"]: entry for entry in json.loads(listed.stdout)["workflows"]}
    assert {"greet", "deploy", "explode"} <= set(entries)
    assert entries["greet"]["parameters"]["required"] == ["name"]
    assert entries["explode"]["limits"]["max_attempts"] == 1
    assert entries["greet"]["lane"] == "workflow_team"

    table = cli_as(cluster, key, "workflows")
    assert table.returncode == 0, table.stderr
    assert "greet" in table.stdout and "name: string" in table.stdout


def test_serve_and_worker_print_their_workflows_at_start(cluster: Cluster) -> None:
    for log in cluster.logs:  # serve's, then the worker's
        text = log.read_text(encoding="utf-8")
        assert f"Workflows of {APP}:" in text, text
        assert "  . greet(name: str)  [max_attempts=3]" in text, text
        assert "  . explode()  [max_attempts=1]" in text, text


async def test_a_failed_run_keeps_its_traceback_in_the_api_the_cli_and_the_log(
    cluster: Cluster,
) -> None:
    key = await new_tenant(cluster)
    async with Client(cluster.url, key) as client:
        accepted = await client.trigger("explode", {})
        run = await wait_until(client, accepted.run_id, RunStatus.FAILED)
    assert isinstance(run.error, dict)
    assert (run.error["type"], run.error["message"]) == ("RuntimeError", "boom")
    trace = run.error["traceback"]
    assert trace.startswith("Traceback (most recent call last):")
    assert 'raise RuntimeError("boom")' in trace and "in explode" in trace

    shown = cli_as(cluster, key, "status", accepted.run_id)
    assert shown.returncode == 0, shown.stderr
    assert '"message": "boom"' in shown.stdout
    assert "Traceback (most recent call last):" in shown.stdout
    assert "\\n" not in shown.stdout  # the traceback is printed as lines, not escaped
    followed = cli_as(cluster, key, "submit", "explode", "--input", "{}", "--follow")
    assert followed.returncode == 2, followed.stderr  # the run did not succeed
    assert '"message": "boom"' in followed.stdout
    assert "Traceback (most recent call last):" in followed.stdout
    assert "\\n" not in followed.stdout

    async def logged() -> str | None:
        log = cluster.logs[1].read_text(encoding="utf-8")
        return log if f"WARNING moorline.worker.worker: run {accepted.run_id}" in log else None

    log = await wait_for(logged, timeout_s=TIMEOUT_S, message="the failure's log line")
    assert log is not None
    after = log[log.index(f"run {accepted.run_id} attempt 1 failed") :]
    assert after.splitlines()[1] == "Traceback (most recent call last):"


async def test_tenants_and_webhooks_are_managed_with_the_cli(cluster: Cluster) -> None:
    admin = {"MOORLINE_ADMIN_TOKEN": ADMIN_TOKEN}
    created = cluster.cli(
        "tenants", "create", "cli-managed", "--plan", "sandbox", "--json", **admin
    )
    assert created.returncode == 0, created.stderr
    tenant = json.loads(created.stdout)
    moved = cluster.cli("tenants", "plan", tenant["tenant_id"], "team", "--json", **admin)
    assert json.loads(moved.stdout)["plan"] == "team", moved.stderr
    listed = cluster.cli("tenants", "list", "--json", **admin)
    assert tenant["tenant_id"] in {row["tenant_id"] for row in json.loads(listed.stdout)["tenants"]}

    issued = cluster.cli("tenants", "issue-key", tenant["tenant_id"], "--json", **admin)
    second = json.loads(issued.stdout)
    keys = json.loads(cluster.cli("tenants", "keys", tenant["tenant_id"], "--json", **admin).stdout)
    first_id = keys["keys"][0]["key_id"]
    revoked = cluster.cli("tenants", "revoke-key", tenant["tenant_id"], first_id, **admin)
    assert revoked.returncode == 0 and "revoked" in revoked.stdout, revoked.stderr
    refused = cli_as(cluster, tenant["api_key"], "webhooks", "list")
    assert_one_line_error(refused, "error: unauthorized")

    async with Client(cluster.url, second["api_key"]) as client:
        hook = await client.create_webhook("greet")
    hooks = cli_as(cluster, second["api_key"], "webhooks", "list", "--json")
    assert [h["webhook_id"] for h in json.loads(hooks.stdout)["webhooks"]] == [hook.webhook_id]
    deleted = cli_as(cluster, second["api_key"], "webhooks", "delete", hook.webhook_id)
    assert deleted.returncode == 0, deleted.stderr
    again = cli_as(cluster, second["api_key"], "webhooks", "delete", hook.webhook_id)
    assert_one_line_error(again, "error: webhook_not_found")


async def test_the_cli_lists_the_workers_and_the_runs_each_holds(cluster: Cluster) -> None:
    """Issue 20, item 5: ``moorline workers`` over the cluster's one worker process."""
    admin = {"MOORLINE_ADMIN_TOKEN": ADMIN_TOKEN}
    key = await new_tenant(cluster)
    async with Client(cluster.url, key) as client:
        accepted = await client.trigger("wait", {})  # runs until it gets a message
        await wait_until(client, accepted.run_id, RunStatus.RUNNING)

        async def holding() -> dict[str, Any] | None:
            listed = cluster.cli("workers", "--json", "--status", "live", **admin)
            assert listed.returncode == 0, listed.stderr
            workers: list[dict[str, Any]] = json.loads(listed.stdout)["workers"]
            return next((w for w in workers if accepted.run_id in w["run_ids"]), None)

        worker = await wait_for(holding, timeout_s=TIMEOUT_S, message="the run held")
        assert worker is not None
        assert (worker["status"], worker["runs"]) == ("live", 1)
        assert "workflow_team" in worker["lanes"]
        worker_id = str(worker["worker_id"])

        table = cluster.cli("workers", **admin)
        assert table.returncode == 0, table.stderr
        assert worker_id in table.stdout and "live" in table.stdout
        assert "workflow_team=" in table.stdout
        one = cluster.cli("workers", worker_id, **admin)
        assert one.returncode == 0, one.stderr
        assert f"worker {worker_id} (live)" in one.stdout and accepted.run_id in one.stdout
        await client.cancel(accepted.run_id)

    assert_one_line_error(cluster.cli("workers", "no-such:1:x", **admin), "worker_not_found")
    assert_one_line_error(cli_as(cluster, key, "workers", "--admin-token", key), "forbidden")
