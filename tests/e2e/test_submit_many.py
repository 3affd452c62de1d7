"""``moorline submit-many``: JSON lines on stdin to runs, through a real ``moorline serve``."""

import json
import subprocess
import sys

from moorline import Client
from moorline.types import RunStatus
from tests.e2e.conftest import Cluster
from tests.e2e.test_e2e import new_tenant, wait_until
from tests.integration.test_cli import assert_one_line_error, cli_env


def submit_many(
    cluster: Cluster, key: str, lines: str, *args: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "moorline", "submit-many", *args],
        cwd=cluster.root,
        env={**cli_env(MOORLINE_URL=cluster.url), "MOORLINE_API_KEY": key},
        input=lines,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_lines_from_stdin_become_runs_each_answered(cluster: Cluster) -> None:
    key = await new_tenant(cluster)
    lines = "\n".join(
        [
            json.dumps({"input": {"name": "ada"}, "idempotency_key": "one"}),
            "",
            json.dumps({"input": {"name": "ada"}, "idempotency_key": "one"}),
            json.dumps({"input": {"name": "bob"}}),
            json.dumps({"input": {"nom": "eve"}}),
        ]
    )
    done = submit_many(cluster, key, lines, "greet", "-", "--json")
    # One item refused (its input does not fit): exit 1, one line saying which.
    assert done.returncode == 1, done.stderr
    assert_one_line_error(done, "1 of 4 items refused", "item 4", "invalid_input")
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    assert [a["status_code"] for a in answers] == [202, 200, 202, 422]
    assert answers[0]["run_id"] == answers[1]["run_id"]
    async with Client(cluster.url, key) as client:
        for answer in (answers[0], answers[2]):
            run = await wait_until(client, answer["run_id"], RunStatus.SUCCEEDED)
            assert run.output is not None and run.output["greeting"].startswith("hello, ")


async def test_a_bad_line_is_one_line_error_and_nothing_is_sent(cluster: Cluster) -> None:
    key = await new_tenant(cluster)
    lines = json.dumps({"name": "ada"}) + "\n{not json\n"
    done = submit_many(cluster, key, lines, "greet", "--inputs")
    assert done.returncode == 1
    assert_one_line_error(done, "stdin line 2", "not valid JSON")
    async with Client(cluster.url, key) as client:
        assert (await client.list_runs()).runs == []
    ok = submit_many(cluster, key, lines.splitlines()[0] + "\n", "greet", "--inputs")
    assert ok.returncode == 0, ok.stderr
    assert "1 items: 1 new runs" in ok.stdout
