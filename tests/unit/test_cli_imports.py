"""What a ``moorline`` command imports: the fault, soak and end-to-end tests start dozens.

The API, FastAPI, uvicorn, the HTTP client and the benchmarks cost a worker over a second of
CPU at start (a third of its start-up), for nothing it runs; the database layer and the engine
cost a client command as much. ``moorline.cli.main`` imports a command's module only when it
runs (``LAZY_COMMANDS``), and the ``moorline`` package its public names on first use.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import typer

from moorline.cli.main import HELP_ORDER, LAZY_COMMANDS, build_cli

REPO_ROOT = Path(__file__).resolve().parents[2]
NOT_FOR_A_WORKER = (
    "fastapi",
    "uvicorn",
    "httpx",
    "moorline.api.app",
    "moorline.client",
    "moorline.benchmarks",
    "moorline.cli.serve",
    "moorline.cli.bench",
    "moorline.cli.client_commands",
    "rich.progress",
)
NOT_FOR_A_CLIENT = (
    "sqlalchemy",
    "moorline.db",
    "moorline.engine",
    "moorline.worker",
    "fastapi",
    "uvicorn",
    "moorline.benchmarks",
    "moorline.cli.worker",
    "moorline.cli.serve",
)

PROBE = """
import runpy, sys
sys.argv = ["moorline", {command!r}, "--help"]
try:
    runpy.run_module("moorline", run_name="__main__")
except SystemExit:
    pass
print("imported:" + ",".join(name for name in {names!r} if name in sys.modules))
"""


@pytest.mark.parametrize(
    ("command", "says", "not_imported"),
    [
        ("worker", "Claim and execute runs", NOT_FOR_A_WORKER),
        ("status", "Show a run", NOT_FOR_A_CLIENT),
    ],
)
def test_a_command_imports_only_what_it_runs(
    command: str, says: str, not_imported: tuple[str, ...]
) -> None:
    # A fresh interpreter (as `python -m moorline`): this one has imported everything.
    probe = PROBE.format(command=command, names=not_imported)
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert says in done.stdout  # the help ran
    assert done.stdout.splitlines()[-1] == "imported:"


def test_every_lazy_command_is_found_and_its_module_adds_only_its_own() -> None:
    group = typer.main.get_group(build_cli())
    with typer.Context(group) as ctx:
        assert group.list_commands(ctx) == list(HELP_ORDER)
        for name in LAZY_COMMANDS:
            assert group.get_command(ctx, name) is not None, name
        # A module adds exactly the commands LAZY_COMMANDS maps to it, so none is found only
        # after another one happened to be looked up first.
        assert set(group.commands) == set(HELP_ORDER)
    assert group.get_command(ctx, "no-such-command") is None
