"""The ``moorline`` command line (Typer commands, Rich output).

Every expected failure (a bad setting, a schema behind the code, a database that does not
answer) is a :class:`~moorline.errors.MoorlineError`; :func:`main` prints it as one line on
stderr and exits 1. Anything else is a bug and keeps its traceback.

The command tree is built by :func:`build_cli` on each call rather than held in a module-level
``typer.Typer``, so nothing is shared between invocations (tests call ``build_cli()`` freely).
"""

import asyncio
import signal
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Annotated, Any

import typer
import uvicorn
from fastapi import FastAPI
from rich.console import Console
from rich.text import Text

from moorline.api.app import create_app
from moorline.api.deps import Services
from moorline.api.guards import redact
from moorline.cli import client_commands
from moorline.cli.banner import start_banner
from moorline.cli.bench import bench
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
EXIT_STARTUP_FAILED = 3  # as uvicorn.run: the server never started (port taken, lifespan error)
EXIT_INTERRUPTED = 130


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
    )
    cli.command("serve")(serve)
    cli.command("worker")(worker)
    cli.command("bench")(bench)
    db_cli = typer.Typer(
        help="Manage the database schema.", no_args_is_help=True, rich_markup_mode="markdown"
    )
    db_cli.command("upgrade")(db_upgrade)
    cli.add_typer(db_cli, name="db")
    client_commands.register(cli)
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


# --- moorline serve --------------------------------------------------------------------------


def serve(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port to listen on.")] = 8000,
    app: Annotated[
        str | None,
        typer.Option(
            "--app",
            metavar="MODULE:ATTR",
            help="The Moorline app whose workflows may be triggered; the API only validates "
            "inputs against it (default MOORLINE_APP, else the bundled example app).",
            show_default=False,
        ),
    ] = None,
    workers: Annotated[
        int,
        typer.Option(
            min=0,
            help="In-process worker loops beside the API (0: none; the reaper runs anyway).",
        ),
    ] = 1,
) -> None:
    """Serve the HTTP API v1 until SIGTERM or Ctrl-C.

    Start fails with one line when the database schema is behind the code: run
    `moorline db upgrade` first (SQLite databases are created on the spot). At start it
    prints where the API and its docs are and how to create a first tenant (see
    `moorline.cli.banner` for the admin token it may generate).
    """
    settings = load_settings()
    configure_logging(settings)
    application = load_app(app or settings.app)
    with asyncio.Runner(loop_factory=_fast_event_loop()) as runner:
        started = runner.run(_serve(settings, application, host=host, port=port, loops=workers))
    if not started:
        raise typer.Exit(EXIT_STARTUP_FAILED)


def _fast_event_loop() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop factory of uvloop when it is installed, else None (asyncio's own).

    An API process spends much of a trigger's CPU in the event loop and the transport (the
    issue 5 benchmark measured about a third less CPU per trigger with uvloop); uvicorn picks it
    only when it creates the loop itself, and ``serve`` creates its own.
    """
    try:
        import uvloop
    except ImportError:  # pragma: no cover - installed with moorline on every platform it has
        return None
    return uvloop.new_event_loop


async def _serve(
    settings: Settings, app: Moorline, *, host: str, port: int, loops: int = 1
) -> bool:
    """Run the API server, the reaper and ``loops`` worker loops; whether the server started.

    (uvicorn has logged why when it did not.)
    """
    db = DatabaseManager(settings)
    try:
        await db.initialize()
    except BaseException:
        await db.dispose()
        raise
    banner = start_banner(settings, host=host, port=port, database=db.display_url)
    if banner.settings is not settings:
        # A generated admin token: log lines must blank it like a configured one.
        settings = banner.settings
        configure_logging(settings)
    # From here the app's lifespan disposes the database when the server stops.
    api = create_app(settings, db, workflows=app)
    _run_workers_with_the_api(api, settings, app, loops)
    # log_config=None: uvicorn's loggers (its access log too) go through our root handler, so
    # they share MOORLINE_LOG_FORMAT and its redaction (a key someone put in a URL, refused
    # with 400, must not land in the access log).
    server = uvicorn.Server(
        uvicorn.Config(api, host=host, port=port, lifespan="on", log_config=None)
    )
    Console(soft_wrap=True, highlight=False).print("\n".join(banner.lines), markup=False)
    with _shutdown_signals_end_cleanly():
        await server.serve()
    return server.started


def _run_workers_with_the_api(api: FastAPI, settings: Settings, app: Moorline, loops: int) -> None:
    """Run the reaper and ``loops`` worker loops inside the API's lifespan.

    They start after the API's services and stop (running runs get the grace period, then are
    released) before those close, and they share the API's RuntimeStore and wake-ups, so a
    trigger wakes a worker of this process at once and a cancel or a message reaches it
    without Redis.
    """
    services: Services = api.state.services
    lanes = default_lane_slots(resolve_plans(settings))
    serving = api.router.lifespan_context

    @asynccontextmanager
    async def with_workers(application: FastAPI) -> AsyncIterator[None]:
        async with serving(application):
            await services.waiter.start()
            stop = asyncio.Event()
            workers = asyncio.create_task(
                run_worker_process(
                    settings,
                    app,
                    services.db,
                    lanes=lanes,
                    stop=stop,
                    notifier=services.notifier,
                    waiter=services.waiter,
                    store=services.store,
                    loops=loops,
                    metrics=services.metrics,
                ),
                name="workers",
            )
            try:
                yield
            finally:
                stop.set()
                await workers

    api.router.lifespan_context = with_workers


@contextmanager
def _shutdown_signals_end_cleanly() -> Iterator[None]:
    """Make a graceful SIGTERM/SIGINT shutdown end the process with status 0.

    uvicorn handles both signals while it serves, shuts down gracefully, then re-raises the
    signal so the previous handler runs. With the default handlers that would kill the process
    by SIGTERM (status -15) or raise KeyboardInterrupt after a clean stop; this no-op handler,
    in place only around ``server.serve()``, lets the re-raised signal land harmlessly.
    """
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, _ignore_after_shutdown) for sig in handled}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _ignore_after_shutdown(signum: int, frame: object) -> None:
    del signum, frame  # the server has already shut down gracefully


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
