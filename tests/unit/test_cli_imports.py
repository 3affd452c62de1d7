"""What ``moorline worker`` imports: the fault and soak tests start dozens of worker processes.

The API, FastAPI, uvicorn, the HTTP client and the benchmarks cost a worker over a second of
CPU at start (a third of its start-up), for nothing it runs. ``moorline.cli.main`` imports the
commands that need them only when they run (``LAZY_COMMANDS``).
"""

import subprocess
import sys
from pathlib import Path

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

PROBE = """
import sys
from moorline.cli.main import main
try:
    main(["worker", "--help"])
except SystemExit:
    pass
print("imported:" + ",".join(name for name in {names!r} if name in sys.modules))
"""


def test_the_worker_command_imports_no_api_client_or_benchmarks() -> None:
    # A fresh interpreter: this one has imported everything the other tests use.
    probe = PROBE.format(names=NOT_FOR_A_WORKER)
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "Claim and execute runs" in done.stdout  # the help ran
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
