"""End to end, issue 21: what a new user and an operator meet on a real deployment.

The workflow catalogue (``moorline workflows``, and the list ``serve`` and ``worker`` print at
start), run through the ``cluster`` of ``conftest.py``: ``moorline serve`` and ``moorline
worker`` processes on SQLite.
"""

import json

from tests.e2e.conftest import APP, Cluster
from tests.e2e.test_e2e import cli_as, new_tenant


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
