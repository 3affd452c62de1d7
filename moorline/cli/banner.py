"""What ``serve`` prints at start: the API's address, a first tenant's command, the workflows.

``worker`` prints the workflows too (:func:`workflow_lines`).

Admin routes need ``MOORLINE_ADMIN_TOKEN`` (unset means they are off). Without one, a server
that listens only on a loopback interface gets a random token for this process, printed once:
only users of this machine can reach it, and its output is theirs, so the first tenant is one
command away without weakening anything. A server listening on other interfaces keeps the
admin routes off and says how to set a token: a token printed by a server reachable from the
network would end up in its logs.

The commands it prints start with :func:`cli_command`: ``moorline`` when that is what the
user's shell runs, else the path it was started by (``.venv/bin/moorline`` from ``make run``),
so that they work as pasted.
"""

import inspect
import ipaddress
import secrets
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import SecretStr

from moorline.engine.registry import Moorline, WorkflowDefinition
from moorline.settings import Settings

ADMIN_TOKEN_BYTES = 32


@dataclass(frozen=True, slots=True, kw_only=True)
class Banner:
    """The settings to serve with (maybe with a generated admin token) and the lines to print."""

    settings: Settings
    lines: list[str]


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback interface (``localhost``, ``127.x``, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cli_command(argv0: str, *, path: str | None = None) -> str:
    """How the user's shell runs this ``moorline``, for commands printed to be pasted.

    Args:
        argv0: How this process was started (``sys.argv[0]``).
        path: The ``PATH`` to look ``moorline`` up in; None for the environment's.
    """
    on_path = shutil.which("moorline", path=path)
    if Path(argv0).name != "moorline":  # python -m moorline
        return "moorline" if on_path else f"{shlex.quote(sys.executable)} -m moorline"
    if on_path is not None and Path(on_path).resolve() == Path(argv0).resolve():
        return "moorline"
    # A venv not activated: the path as the user typed it works from where they typed it.
    return shlex.quote(argv0)


def start_banner(
    settings: Settings, *, host: str, port: int, database: str, command: str = "moorline"
) -> Banner:
    """The start message of a server on ``host:port``, and its admin token if it needs one.

    ``command`` starts the printed commands (:func:`cli_command`).
    """
    shown_host = f"[{host}]" if ":" in host else host
    url = f"http://{shown_host}:{port}"
    lines = [
        f"Starting the Moorline API on {url} (database {database})",
        f"  dashboard: {url}/",
        f"  API docs:  {url}/docs",
    ]
    # A wildcard address is not a URL to reach the server at: name the loopback one instead.
    reach = url if host not in ("0.0.0.0", "::") else f"http://127.0.0.1:{port}"
    create = f"{command} tenants create my-team --plan team --url {shlex.quote(reach)}"
    if settings.public_url is None:
        # Webhook URLs are built from the configured address, never from a request's Host.
        settings = settings.model_copy(update={"public_url": reach})
        lines.append(f"  webhooks:  {reach}/v1/hooks/… (set MOORLINE_PUBLIC_URL to change)")
    if settings.admin_token is not None:
        lines += [
            "Create a first tenant (MOORLINE_ADMIN_TOKEN as set for this server):",
            f"  {create}",
        ]
        return Banner(settings=settings, lines=lines)
    if not is_loopback(host):
        lines += [
            "Admin routes are off: MOORLINE_ADMIN_TOKEN is not set. To create tenants, restart "
            "with a token, e.g. MOORLINE_ADMIN_TOKEN=$(openssl rand -hex 32), then:",
            f"  MOORLINE_ADMIN_TOKEN=<token> {create}",
        ]
        return Banner(settings=settings, lines=lines)
    token = secrets.token_urlsafe(ADMIN_TOKEN_BYTES)
    lines += [
        "MOORLINE_ADMIN_TOKEN is not set: this process accepts a generated admin token, shown "
        "only now (set MOORLINE_ADMIN_TOKEN to choose a lasting one). Create a first tenant:",
        f"  MOORLINE_ADMIN_TOKEN={token} {create}",
    ]
    return Banner(
        settings=settings.model_copy(update={"admin_token": SecretStr(token)}), lines=lines
    )


def workflow_lines(app: Moorline, spec: str) -> list[str]:
    """The lines ``serve`` and ``worker`` print at start: each workflow with its signature.

    As Celery prints its tasks: an operator sees at once whether ``--app`` named the app they
    meant (``spec`` is how it was named).
    """
    lines = [f"Workflows of {spec}:"]
    for definition in sorted(app, key=lambda item: item.name):
        lines.append(f"  . {definition.name}({_signature(definition)}){_limits(definition)}")
    if len(lines) == 1:
        lines.append("  (none: nothing can be triggered)")
    return lines


def _signature(definition: WorkflowDefinition) -> str:
    """The workflow's parameters as written in its ``def``, without the Context."""
    params = list(inspect.signature(definition.fn).parameters.values())[1:]
    return ", ".join(str(param) for param in params)


def _limits(definition: WorkflowDefinition) -> str:
    parts = [f"max_attempts={definition.max_attempts}"]
    if definition.timeout_s is not None:
        parts.append(f"timeout={definition.timeout_s:g}s")
    if definition.soft_timeout_s is not None:
        parts.append(f"soft_timeout={definition.soft_timeout_s:g}s")
    return "  [" + " ".join(parts) + "]"
