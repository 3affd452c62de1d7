"""The CLI as a new user meets it: ``--app`` from the working directory, one-line usage errors,
``--version``, ``MOORLINE_LOG_LEVEL`` and a warning for a misspelt ``MOORLINE_*`` variable."""

import subprocess
import sys
from pathlib import Path

import moorline
from moorline.settings import unknown_variables
from tests.integration.test_cli import CLI_TIMEOUT_S, assert_one_line_error, cli_env, run_cli

SCRIPT = Path(sys.executable).parent / "moorline"


def run_script(*args: str, cwd: Path, **settings: str) -> subprocess.CompletedProcess[str]:
    """The installed ``moorline`` script: unlike ``python -m``, its sys.path lacks the cwd."""
    return subprocess.run(
        [str(SCRIPT), *args],
        cwd=cwd,
        env=cli_env(**settings),
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )


def test_app_is_imported_from_the_working_directory(tmp_path: Path) -> None:
    # A module beside the user, as uvicorn finds it; `app` is deliberately not a Moorline app,
    # so the worker stops right after the import with a line that proves the import worked.
    (tmp_path / "mywf.py").write_text("app = 42\n")
    result = run_script("worker", "--app", "mywf:app", cwd=tmp_path)
    assert_one_line_error(result, "'app' is a int, not a Moorline app")


def test_a_usage_error_is_one_lowercase_line(tmp_path: Path) -> None:
    result = run_cli("serve", "--bogus", cwd=tmp_path)
    assert result.returncode == 2
    assert_one_line_error(result, "error: No such option: --bogus", "moorline serve --help")
    missing = run_cli("status", cwd=tmp_path)
    assert_one_line_error(missing, "error: Missing argument 'RUN_ID'")


def test_version_prints_the_installed_version(tmp_path: Path) -> None:
    result = run_cli("--version", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"moorline {moorline.__version__}"


def test_unknown_variables_name_the_closest_setting() -> None:
    environ = {"MOORLINE_LEASE_TTLL": "5", "MOORLINE_LEASE_TTL": "5", "PATH": "/bin"}
    assert unknown_variables(environ) == [
        "unknown setting MOORLINE_LEASE_TTLL is ignored; did you mean MOORLINE_LEASE_TTL?"
    ]
    assert unknown_variables({"MOORLINE_QQQQQQQQQQQQQQ": "1"}) == [
        "unknown setting MOORLINE_QQQQQQQQQQQQQQ is ignored"
    ]


def test_start_warns_of_an_unknown_variable_unless_the_log_level_hides_it(tmp_path: Path) -> None:
    warned = run_cli("worker", "--app", "nosuch:app", cwd=tmp_path, MOORLINE_LEASE_TTLL="5")
    assert warned.returncode != 0
    warning, error = warned.stderr.strip().splitlines()
    assert "WARNING" in warning and "did you mean MOORLINE_LEASE_TTL?" in warning
    assert error.startswith("error: --app 'nosuch:app'")

    quiet = run_cli(
        "worker",
        "--app",
        "nosuch:app",
        cwd=tmp_path,
        MOORLINE_LEASE_TTLL="5",
        MOORLINE_LOG_LEVEL="error",
    )
    assert_one_line_error(quiet, "error: --app 'nosuch:app'")


def test_a_bad_log_level_is_one_line(tmp_path: Path) -> None:
    result = run_cli("worker", cwd=tmp_path, MOORLINE_LOG_LEVEL="loud")
    assert_one_line_error(result, "MOORLINE_LOG_LEVEL")
