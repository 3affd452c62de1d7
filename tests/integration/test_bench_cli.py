"""``moorline bench`` as a real subprocess: quick sizes, SQLite, one benchmark.

Checks both reports are written and agree with each other, not the figures themselves (a
loaded CI machine makes any threshold flaky); and that a bad option value is one line.
"""

import json
from pathlib import Path

from tests.integration.test_cli import assert_one_line_error, run_cli


def test_quick_bench_writes_both_reports(tmp_path: Path) -> None:
    markdown, json_path = tmp_path / "report.md", tmp_path / "report.json"
    result = run_cli(
        "bench",
        "--quick",
        "--backends",
        "sqlite",
        "--benchmarks",
        "step",
        "--markdown",
        str(markdown),
        "--json",
        str(json_path),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr

    report = json.loads(json_path.read_text())
    assert report["rounds"] == 3
    assert report["quick"] is True
    [step] = report["results"]
    assert (step["benchmark"], step["metric"], step["target"]) == ("step", "step", "sqlite")
    assert len(step["values"]) == 3
    assert all(value > 0 for value in step["values"])
    assert step["min"] <= step["median"] <= step["max"]
    assert step["median"] == sorted(step["values"])[1]

    lines = markdown.read_text().splitlines()
    assert lines[0] == "# Moorline benchmark report"
    header = next(line for line in lines if line.startswith("| Figure |"))
    assert header == "| Figure | sqlite |"
    [row] = [line for line in lines if line.startswith("| Step overhead")]
    assert f"{step['median']:.2f} ({step['min']:.2f}-{step['max']:.2f})" in row
    # Nothing written to the working directory when both paths are given.
    assert not (tmp_path / "bench-report.md").exists()


def test_unknown_benchmark_is_one_line(tmp_path: Path) -> None:
    result = run_cli("bench", "--benchmarks", "step,warp", cwd=tmp_path)
    assert_one_line_error(result, "--benchmarks", "warp", "step")
    assert not (tmp_path / "bench-report.json").exists()
