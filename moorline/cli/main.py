"""The ``moorline`` command line (Typer commands, Rich output).

Every expected failure (a bad setting, a schema behind the code, a database that does not
answer) is a :class:`~moorline.errors.MoorlineError`; :func:`main` prints it as one line on
stderr and exits 1. Anything else is a bug and keeps its traceback.

The command tree is built by :func:`build_cli` on each call rather than held in a module-level
``typer.Typer``, so nothing is shared between invocations (tests call ``build_cli()`` freely).
"""

import importlib
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.text import Text
from typer.core import TyperGroup
from typer.exceptions import TyperException

from moorline.errors import MoorlineError

if TYPE_CHECKING:
    from moorline.settings import Settings

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130

logger = logging.getLogger(__name__)

LAZY_COMMANDS: dict[str, str] = {
    "serve": "moorline.cli.serve",
    "worker": "moorline.cli.worker",
    "db": "moorline.cli.schema",
    "bench": "moorline.cli.bench",
    "tenants": "moorline.cli.management",
    "workers": "moorline.cli.management",
    "submit": "moorline.cli.client_commands",
    "submit-many": "moorline.cli.batches",
    "status": "moorline.cli.client_commands",
    "cancel": "moorline.cli.client_commands",
    "approve": "moorline.cli.client_commands",
    "deny": "moorline.cli.client_commands",
    "inject": "moorline.cli.client_commands",
    "runs": "moorline.cli.client_commands",
    "retry": "moorline.cli.run_actions",
    "rerun": "moorline.cli.run_actions",
    "bulk": "moorline.cli.run_actions",
    "workflows": "moorline.cli.catalogue",
    "webhooks": "moorline.cli.management",
    "schedules": "moorline.cli.schedules",
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
    "workers",
    "submit",
    "submit-many",
    "status",
    "cancel",
    "approve",
    "deny",
    "inject",
    "runs",
    "retry",
    "rerun",
    "bulk",
    "workflows",
    "webhooks",
    "schedules",
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
    # Every command is lazy; the group's callback holds the options of ``moorline`` itself.
    cli.callback()(_top_options)
    return cli


def _print_version(value: bool) -> None:
    """``--version``: print it and stop before any command runs."""
    if value:
        import moorline

        typer.echo(f"moorline {moorline.__version__}")
        raise typer.Exit()


def _top_options(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            is_eager=True,
            callback=_print_version,
            help="Print the installed version and exit.",
        ),
    ] = False,
) -> None:
    del version  # handled by its callback, before any command runs


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``moorline`` script and ``python -m moorline``."""
    args = list(argv) if argv is not None else None
    try:
        # standalone_mode=False: click's usage errors reach us instead of Typer's boxed
        # ``Error`` panel, so they are one ``error: ...`` line like every other failure.
        code = build_cli()(args=args, prog_name="moorline", standalone_mode=False)
    except TyperException as exc:
        # Click's errors as Typer (which vendors click) raises them; a usage error carries its
        # command's context. A group run without a command "fails" with its help, which Rich
        # has already printed (an empty message): nothing more to say.
        ctx = getattr(exc, "ctx", None)
        message = exc.format_message()
        if not message.strip():
            raise SystemExit(exc.exit_code) from None
        print_error(f"{message} (see '{ctx.command_path} --help')" if ctx else message)
        raise SystemExit(exc.exit_code) from None
    except typer.Abort:
        print_error("aborted")
        raise SystemExit(EXIT_ERROR) from None
    except MoorlineError as exc:
        print_error(exc.message)
        raise SystemExit(EXIT_ERROR) from None
    except KeyboardInterrupt:
        raise SystemExit(EXIT_INTERRUPTED) from None
    if isinstance(code, int) and code:  # a command's ``typer.Exit(code)``
        raise SystemExit(code)


def configure_logging(settings: "Settings", *, warn_unknown: bool = False) -> None:
    """Log ``MOORLINE_LOG_LEVEL`` and up to stderr in ``MOORLINE_LOG_FORMAT``, secrets blanked.

    With ``warn_unknown`` (the long-running commands), also a warning per unknown
    ``MOORLINE_*`` variable of the environment.
    """
    from moorline.api.redaction import redact
    from moorline.observability import logs as observability_logs
    from moorline.settings import unknown_variables

    # redact knows the tenant key format and credential query parameters (an access-log line
    # of a refused ``?api_key=`` request).
    observability_logs.configure_logging(settings, scrub=redact)
    if warn_unknown:
        for warning in unknown_variables(os.environ):
            logger.warning("%s", warning)


def print_error(message: str) -> None:
    """Print ``error: <message>`` as exactly one line on stderr."""
    # soft_wrap: Rich would otherwise break a long message at the terminal width (80 columns
    # when stderr is a pipe), and scripts rely on the one-line form.
    console = Console(stderr=True, soft_wrap=True, highlight=False)
    console.print(Text.assemble(("error: ", "bold red"), " ".join(message.split())))
