"""``bench/scale.py --quick`` runs end to end on PostgreSQL + Redis with 1 and 2 workers.

The script starts real ``moorline worker`` processes, a redis-server of its own and reads the
servers' counters: a change to the CLI, the public submit path or the counters it reads fails
here instead of in the next measurement. Only the output's shape is checked, never a rate.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COLUMNS = 10


def test_quick_run_prints_a_row_per_drain(tmp_path: Path) -> None:
    report = tmp_path / "scale.json"
    env = {key: value for key, value in os.environ.items() if not key.startswith("MOORLINE_")}
    env["PYTHONPATH"] = str(REPO)
    command = [sys.executable, "bench/scale.py", "--quick", "--backends", "postgresql"]
    command += ["--workers", "1,2", "--kind", "noop", "--json", str(report)]
    done = subprocess.run(
        command,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("backend ")))
    rows = [line.split() for line in lines[header + 1 :]]
    assert [row[:3] for row in rows] == [
        ["postgresql+redis", "noop", "1"],
        ["postgresql+redis", "noop", "2"],
    ]
    for row in rows:
        assert len(row) == COLUMNS, row
        figures = [float(value) for value in row[3:]]  # every column a number: none is n/a
        # A 200-run drain lasts well under a second: the commit counts (PostgreSQL publishes a
        # backend's at most once a second) and Redis's CPU may print as 0 then.
        runs_per_s, worker_cpu = figures[0], figures[3]
        assert runs_per_s > 0 and worker_cpu > 0 and min(figures) >= 0, row
    written = json.loads(report.read_text())
    assert [(row["backend"], row["workers"]) for row in written] == [
        ("postgresql", 1),
        ("postgresql", 2),
    ]
    assert all(row["runs"] > 0 and row["commits_per_run"] is not None for row in written), written
