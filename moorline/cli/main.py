"""The ``moorline`` command line (Typer commands, Rich output).

Every expected failure (a bad setting, a schema behind the code, a database that does not
answer) is a :class:`~moorline.errors.MoorlineError`; :func:`main` prints it as one line on
stderr and exits 1. Anything else is a bug and keeps its traceback.

The command tree is built by :func:`build_cli` on each call rather than held in a module-level
``typer.Typer``, so nothing is shared between invocations (tests call ``build_cli()`` freely).
"""

import asyncio
import importlib
from collections.abc import Sequence
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.text import Text
from typer.core import TyperGroup

from moorline.api.redaction import redact
from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.dispatch.lanes import resolve_lanes
from moorline.dispatch.wakeups import make_wakeups
from moorline.engine.loader import load_app
from moorline.engine.registry import Moorline
from moorline.errors import MoorlineError
from moorline.observability import logs as observability_logs
from moorline.plans import default_lane_slots, resolve_plans
from moorline.settings import Settings, load_settings
from moorline.worker.process import install_stop_signals, run_worker_process

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130

LAZY_COMMANDS: dict[str, str] = {
    "serve": "moorline.cli.serve",
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
"""Commands whose module is imported only when they run (or help lists them), by name.

Each module has ``register(cli)``, which adds exactly the commands listed here for it. They
import what a worker never needs: the API, FastAPI and uvicorn (``serve``), the HTTP client
(the client commands), the benchmarks and Rich's progress bars (``bench``). ``worker`` and
``db upgrade`` stay in this module: a worker process pays only for what it runs, which is most
of its start-up time on a loaded machine (the fault tests start dozens of them).
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
    cli.command("worker")(worker)
    db_cli = typer.Typer(
        help="Manage the database schema.", no_args_is_help=True, rich_markup_mode="markdown"
    )
    db_cli.command("upgrade")(db_upgrade)
    cli.add_typer(db_cli, name="db")
    return cli


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``moorline`` script and ``python -m moorline``."""
    try:
        build_cli()(args=list(argv) if argv is not None else None, prog_name="moorline")
    except MoorlineError as exc:
        print_error(exc.message)
        raise SystemExit(EXIT_ERROR) from None
    except KeyboardInterrupt:
        raise SystemExit(EXIT_INTERRUPTED) from None


def configure_logging(settings: Settings) -> None:
    """Log INFO and above to stderr in ``MOORLINE_LOG_FORMAT``, secrets and API keys blanked."""
    # redact knows the tenant key format and credential query parameters (an access-log line
    # of a refused ``?api_key=`` request).
    observability_logs.configure_logging(settings, scrub=redact)


def print_error(message: str) -> None:
    """Print ``error: <message>`` as exactly one line on stderr."""
    # soft_wrap: Rich would otherwise break a long message at the terminal width (80 columns
    # when stderr is a pipe), and scripts rely on the one-line form.
    console = Console(stderr=True, soft_wrap=True, highlight=False)
    console.print(Text.assemble(("error: ", "bold red"), " ".join(message.split())))


# --- moorline db upgrade ---------------------------------------------------------------------


def db_upgrade(
    database_url: Annotated[
        str | None,
        typer.Option(
            "--database-url",
            help="Database to upgrade, instead of MOORLINE_DATABASE_URL(S).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Bring the database schema to this version of Moorline.

    PostgreSQL and MySQL/MariaDB are migrated with Alembic to the head revision; a SQLite
    database gets its tables created (it has no migrations).
    """
    overrides: dict[str, Any] = {}
    if database_url is not None:
        # An explicit URL wins over MOORLINE_DATABASE_URLS too, not only MOORLINE_DATABASE_URL.
        overrides = {"database_url": database_url, "database_urls": []}
    settings = load_settings(**overrides)
    display_url, revision = asyncio.run(_upgrade(settings))
    console = Console(soft_wrap=True, highlight=False)
    if revision is None:
        console.print(f"{display_url}: SQLite schema created (SQLite has no migrations)")
    else:
        console.print(f"{display_url}: schema at revision {revision} (head)")


async def _upgrade(settings: Settings) -> tuple[str, str | None]:
    db = DatabaseManager(settings)
    try:
        return db.display_url, await upgrade(db)
    finally:
        await db.dispose()


# --- moorline worker -------------------------------------------------------------------------


def worker(
    app: Annotated[
        str | None,
        typer.Option(
            "--app",
            metavar="MODULE:ATTR",
            help="The Moorline app with your workflows (default MOORLINE_APP, else the "
            "bundled example app).",
            show_default=False,
        ),
    ] = None,
    lanes: Annotated[
        str | None,
        typer.Option(
            "--lanes",
            metavar="LANE=SLOTS,...",
            help="Lanes to serve and slots in each (default: every plan's lane with its "
            "plan's slots).",
            show_default=False,
        ),
    ] = None,
    grace: Annotated[
        float,
        typer.Option(min=0, help="Seconds running runs may finish after SIGTERM before release."),
    ] = 30.0,
) -> None:
    """Claim and execute runs until SIGTERM (graceful) or a second Ctrl-C (immediate).

    Every worker also runs the reaper loop; only the elected leader acts.
    """
    settings = load_settings()
    configure_logging(settings)
    application = load_app(app or settings.app)
    served = resolve_lanes(lanes, default_lane_slots(resolve_plans(settings)))
    asyncio.run(_work(settings, application, served, grace))


async def _work(settings: Settings, app: Moorline, lanes: dict[str, int], grace_s: float) -> None:
    db = DatabaseManager(settings)
    try:
        await db.initialize()
        stop = asyncio.Event()
        install_stop_signals(stop)
        notifier, waiter = make_wakeups(settings, db)
        await waiter.start()
        try:
            await run_worker_process(
                settings,
                app,
                db,
                lanes=lanes,
                stop=stop,
                notifier=notifier,
                waiter=waiter,
                grace_s=grace_s,
            )
        finally:
            await waiter.close()
    finally:
        await db.dispose()
