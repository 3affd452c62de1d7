"""``bench/peers/moorline_driver.py`` measures every Moorline figure, at toy size, on SQLite.

The driver goes only through public surfaces (``app.submit``, ``submit_many``,
``moorline.Client`` against ``moorline serve``, ``moorline worker``); a change to one of them
that breaks the peer benchmark fails here instead of in its next run. Nothing is downloaded:
the peers' venv is the benchmark's, not the tests'.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import FULL_SIZE

DRIVER = Path(__file__).resolve().parents[2] / "bench" / "peers" / "moorline_driver.py"
TOY = {"runs": 5, "bulk_runs": 200, "step_runs": 60, "latency_runs": 3, "batch": 100}


@pytest.mark.skipif(
    not FULL_SIZE, reason="a bench smoke of minutes on a loaded machine: make test-full"
)
def test_the_driver_gives_every_figure() -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("MOORLINE_")}
    env["PYTHONPATH"] = str(DRIVER.parents[2])
    done = subprocess.run(
        [sys.executable, str(DRIVER), "sqlite", json.dumps(TOY | {"wide_slots": 16})],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    rates = ("enqueue", "enqueue_http", "bulk", "bulk_http", "drain", "drain_wide", "drain_step")
    assert all(found[key] > 0 for key in rates), found
    assert 0 < found["latency_p50"] <= found["latency_p99"], found
    assert found["slots"] > found["tenant_cap"] >= 1, found
