"""The start banner's commands work as pasted (issue 21): `moorline` only if the shell has it."""

import os
import sys
from pathlib import Path

from moorline.cli.banner import cli_command, start_banner
from moorline.settings import Settings


def executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n", encoding="utf-8")
    path.chmod(0o755)
    return path


def test_the_command_is_moorline_only_when_the_shell_runs_this_one(tmp_path: Path) -> None:
    venv_bin = executable(tmp_path / ".venv" / "bin" / "moorline").parent
    other_bin = executable(tmp_path / "elsewhere" / "moorline").parent

    # make run: `.venv/bin/moorline serve` from the checkout, the venv not activated.
    assert cli_command(".venv/bin/moorline", path=str(tmp_path / "none")) == ".venv/bin/moorline"
    # Another moorline first on PATH is not this one.
    started = str(venv_bin / "moorline")
    assert cli_command(started, path=str(other_bin)) == started
    # Activated: the shell finds this very file.
    assert cli_command(started, path=os.pathsep.join([str(venv_bin), str(other_bin)])) == (
        "moorline"
    )
    # python -m moorline without a moorline on PATH: the same interpreter.
    main = str(Path(sys.prefix) / "moorline" / "__main__.py")
    assert cli_command(main, path=str(tmp_path / "none")).endswith(" -m moorline")


def test_the_banner_starts_its_commands_with_the_given_command() -> None:
    banner = start_banner(
        Settings(), host="127.0.0.1", port=8000, database="sqlite", command=".venv/bin/moorline"
    )
    text = "\n".join(banner.lines)
    assert " .venv/bin/moorline tenants create my-team --plan team" in text
