"""The ``moorline`` command line (Typer commands, Rich output).

Every expected failure (a bad setting, a schema behind the code, a database that does not
answer) is a :class:`~moorline.errors.MoorlineError`; :func:`main` prints it as one line on
stderr and exits 1. Anything else is a bug and keeps its traceback.

The command tree is built by :func:`build_cli` on each call rather than held in a module-level
``typer.Typer``, so nothing is shared between invocations (tests call ``build_cli()`` freely).
"""

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.text import Text
from typer.core import TyperGroup

from moorline.errors import MoorlineError

if TYPE_CHECKING:
    from moorline.settings import Settings

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130

LAZY_COMMANDS: dict[str, str] = {
    "serve": "moorline.cli.serve",
    "worker": "moorline.cli.worker",
    "db": "moorline.cli.schema",
    "bench": "moorline.cli.bench",
    "tenants": "moorline.cli.client_commands",
    "submit": "moorline.cli.client_commands",
    "status": "moorline.cli.client_commands",
    "cancel": "moorline.cli.client_commands",
    "approve": "moorline.cli.client_commands",
    "deny": "moorline.cli.client_commands",
    "inject": "moorline.cli.client_commands",
    "runs": "moorline.cli.client_commands",
}
"""Each command's module, imported only when the command runs (or help lists it), by name.

Each module has ``register(cli)``, which adds exactly the commands listed here for it. A
process pays only for what it runs: a worker does not import the API, FastAPI and uvicorn
(``serve``), the HTTP client (the client commands), the benchmarks and Rich's progress bars
(``bench``); a client command does not import the database layer. Imports are most of a
process's start-up on a loaded machine, and the fault and end-to-end tests start dozens.
"""


HELP_ORDER = (
    "serve",
    "worker",
    "bench",
    "db",
    "tenants",
    "submit",
    "status",
    "cancel",
    "approve",
    "deny",
    "inject",
    "runs",
)
"""The order ``moorline --help`` lists the commands in (as before they were lazy)."""


class LazyCommands(TyperGroup):
    """The top-level command group: ``LAZY_COMMANDS`` are built on first lookup."""

    def list_commands(self, ctx: Any) -> list[str]:
        names = dict.fromkeys([*super().list_commands(ctx), *LAZY_COMMANDS])
        return sorted(names, key=lambda name: HELP_ORDER.index(name))

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in self.commands and cmd_name in LAZY_COMMANDS:
            module = importlib.import_module(LAZY_COMMANDS[cmd_name])
            extra = typer.Typer(rich_markup_mode="markdown")
            module.register(extra)
            for name, command in typer.main.get_group(extra).commands.items():
                self.add_command(command, name)
        return super().get_command(ctx, cmd_name)


def build_cli() -> typer.Typer:
    """The ``moorline`` command tree."""
    cli = typer.Typer(
        name="moorline",
        help="Moorline: durable, multi-tenant execution for LLM and agent workloads.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        # Markdown joins a docstring's wrapped lines into paragraphs and shows `code` as code.
        rich_markup_mode="markdown",
        cls=LazyCommands,
    )
    # Typer builds a group only for a Typer with a command or a callback; every command is
    # lazy, so the group gets a callback that does nothing.
    cli.callback()(_no_options)
    return cli


def _no_options() -> None:
    pass


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``moorline`` script and ``python -m moorline``."""
    try:
        build_cli()(args=list(argv) if argv is not None else None, prog_name="moorline")
    except MoorlineError as exc:
        print_error(exc.message)
        raise SystemExit(EXIT_ERROR) from None
    except KeyboardInterrupt:
        raise SystemExit(EXIT_INTERRUPTED) from None


def configure_logging(settings: "Settings") -> None:
    """Log INFO and above to stderr in ``MOORLINE_LOG_FORMAT``, secrets and API keys blanked."""
    from moorline.api.redaction import redact
    from moorline.observability import logs as observability_logs

    # redact knows the tenant key format and credential query parameters (an access-log line
    # of a refused ``?api_key=`` request).
    observability_logs.configure_logging(settings, scrub=redact)


def print_error(message: str) -> None:
    """Print ``error: <message>`` as exactly one line on stderr."""
    # soft_wrap: Rich would otherwise break a long message at the terminal width (80 columns
    # when stderr is a pipe), and scripts rely on the one-line form.
    console = Console(stderr=True, soft_wrap=True, highlight=False)
    console.print(Text.assemble(("error: ", "bold red"), " ".join(message.split())))
