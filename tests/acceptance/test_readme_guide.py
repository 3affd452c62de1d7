"""README's "Your first workflow", pasted as it stands, against a real server (issue 21).

The section's code blocks run in order in an empty directory, as a new user runs them in a
fresh checkout: a block after a ``<!-- file: NAME -->`` comment is saved as NAME, and every
``sh`` block runs, all in one bash (the venv's activation and the exports carry over, as in one
terminal) with ``set -euo pipefail``, so any command that fails fails the test. ``.venv`` is a
link to the venv running the tests, and ``PYTHONPATH`` puts this checkout's ``moorline`` first,
as the CLI tests do. Then the database the guide's server left behind must hold what the guide
says: the CLI's and the client's runs approved and succeeded, the curl one waiting.

The guide serves on 127.0.0.1:8000, the default. To run it as written without taking that port
from anything else on the machine, the script runs in a network namespace of its own
(``unshare -rn``, loopback only) when the kernel allows one; otherwise on the host's loopback if
the port is free, and the test is skipped when neither is possible.
"""

import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import port_is_free
from tests.integration.test_cli import SOURCE_ROOT, cli_env

README = SOURCE_ROOT / "README.md"
SECTION = "## Your first workflow"
GUIDE_PORT = 8000
RUN_TIMEOUT_S = 240.0
"""The whole guide: about 20 s on an idle machine (the simulated model streams at its
realistic pace, and the CLI's wait polls once a second)."""

_BLOCK = re.compile(
    r"(?:<!-- file: (?P<file>[\w.]+) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)\n```", re.S
)


def guide_blocks(readme: str) -> Iterator[tuple[str, str | None, str]]:
    """(language, file name or None, text) of each code block of the guide, in order."""
    start = readme.find(SECTION + "\n")
    assert start >= 0, f"README.md has no {SECTION!r} section"
    end = readme.find("\n## ", start + len(SECTION))
    section = readme[start : end if end >= 0 else len(readme)]
    for match in _BLOCK.finditer(section):
        yield match["lang"], match["file"], match["body"] + "\n"


def write_guide(readme: str, root: Path) -> Path:
    """Save the guide's files under ``root``; the script of its shell blocks, in order."""
    script = ["set -euo pipefail"]
    for number, (lang, name, body) in enumerate(guide_blocks(readme), start=1):
        if name is not None:
            (root / name).write_text(body, encoding="utf-8")
        elif lang == "sh":
            script += [f"echo '### guide block {number}' >&2", body]
        else:
            assert lang in ("", "text"), f"block {number} ({lang}) has no <!-- file: --> name"
    # Not the guide's: wait for the server it stopped, so that its database is complete.
    script.append("wait")
    path = root / "guide.sh"
    path.write_text("\n".join(script), encoding="utf-8")
    return path


def isolated_network() -> list[str] | None:
    """The command prefix of a private network namespace with loopback up, if allowed."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return None
    probe = subprocess.run(
        ["unshare", "-rn", "ip", "link", "set", "lo", "up"], capture_output=True, check=False
    )
    if probe.returncode != 0:
        return None
    return ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$@"', "-"]


def run_guide(root: Path, script: Path) -> subprocess.CompletedProcess[str]:
    prefix = isolated_network()
    if prefix is None and not port_is_free(GUIDE_PORT):
        pytest.skip(f"no network namespace (unshare -rn) and 127.0.0.1:{GUIDE_PORT} is in use")
    # A new session: whatever the guide left running (its server, if a step failed) is killed
    # with it below.
    process = subprocess.Popen(
        [*(prefix or []), "bash", str(script)],
        cwd=root,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        stderr += f"\n(killed after {RUN_TIMEOUT_S:g} s)"
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def test_the_first_workflow_guide_works_as_pasted(tmp_path: Path) -> None:
    readme = README.read_text(encoding="utf-8")
    script = write_guide(readme, tmp_path)
    assert (tmp_path / "mywf.py").exists() and (tmp_path / "trigger.py").exists()
    (tmp_path / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)

    done = run_guide(tmp_path, script)
    log = tmp_path / "moorline.log"
    server_log = log.read_text(encoding="utf-8") if log.exists() else "(no moorline.log)"
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n--- moorline.log\n{server_log}"
    assert "Workflows of mywf:app:" in server_log
    assert "interrupt" in done.stdout and "approved" in done.stdout  # moorline approve
    assert "published: True" in done.stdout  # trigger.py

    with sqlite3.connect(tmp_path / "moorline.db") as db:
        runs = db.execute("SELECT workflow, status, input, output FROM runs").fetchall()
    by_topic = {json.loads(run[2])["topic"]: run for run in runs}
    assert set(by_topic) == {"lighthouses", "tide tables", "durable workflows"}
    for topic in ("lighthouses", "durable workflows"):  # the CLI's, the client's
        workflow, status, _, output = by_topic[topic]
        assert (workflow, status) == ("post", "succeeded")
        published = json.loads(output)
        assert published["published"] is True
        assert published["text"].startswith("[Simulated reply from moorline-simulated")
    assert by_topic["tide tables"][1] == "waiting"  # curl's, left for the dashboard
