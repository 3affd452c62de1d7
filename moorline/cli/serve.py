"""``moorline serve``: the HTTP API, the reaper and in-process worker loops in one process.

Loaded only when ``serve`` is the command run (see ``moorline.cli.main.LAZY_COMMANDS``): the
API, FastAPI and uvicorn cost a worker process over a second of start-up it has no use for.
"""

import asyncio
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Annotated

import typer
import uvicorn
from fastapi import FastAPI
from rich.console import Console
from starlette.types import ASGIApp

from moorline.admission.scheduler import make_scheduler
from moorline.api.access import ErrorAccessLog
from moorline.api.app import create_app
from moorline.api.deps import Services
from moorline.api.protocol import uvicorn_limits
from moorline.cli.banner import cli_command, start_banner, workflow_lines
from moorline.cli.main import configure_logging
from moorline.db.manager import DatabaseManager
from moorline.engine.loader import DEFAULT_APP, load_app
from moorline.engine.registry import Moorline
from moorline.errors import ConfigError
from moorline.observability import tracing
from moorline.plans import default_lane_slots, resolve_plans
from moorline.settings import AccessLog, Settings, load_settings
from moorline.worker.process import (
    freeze_start_up_objects,
    run_worker_process,
    with_worker_pool,
)

EXIT_STARTUP_FAILED = 3  # as uvicorn.run: the server never started (port taken, lifespan error)


def register(cli: typer.Typer) -> None:
    """Add ``serve`` to the ``moorline`` command tree."""
    cli.command("serve")(serve)


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
    configure_logging(settings, warn_unknown=True)
    tracing.configure_from_env("moorline-serve")
    spec = app or settings.app or DEFAULT_APP
    application = load_app(spec, app_dir=os.getcwd())
    # The port first: a port in use must be one line before anything is printed, generated or
    # connected to (no banner, no admin token, no worker against the database).
    listening = bind_socket(host, port)
    with listening, asyncio.Runner(loop_factory=_fast_event_loop()) as runner:
        serving = _serve(
            settings,
            application,
            listening=listening,
            host=host,
            loops=workers,
            listed=workflow_lines(application, spec),
        )
        try:
            started = runner.run(serving)
        finally:
            tracing.shutdown()  # the spans still buffered are exported
    if not started:
        raise typer.Exit(EXIT_STARTUP_FAILED)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``, ready for uvicorn to listen on.

    Raises:
        ConfigError: the address cannot be resolved or bound (in use, not this host's, no
            permission); one line naming it.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    # As uvicorn binds: a restarted server may take the port while old connections linger.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def _fast_event_loop() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop factory of uvloop when it is installed, else None (asyncio's own).

    An API process spends much of a trigger's CPU in the event loop and the transport, which
    uvloop makes cheaper (``bench/api.py``; docs/performance.md); uvicorn picks it
    only when it creates the loop itself, and ``serve`` creates its own.
    """
    try:
        import uvloop
    except ImportError:  # pragma: no cover - installed with moorline on every platform it has
        return None
    return uvloop.new_event_loop


async def _serve(
    settings: Settings,
    app: Moorline,
    *,
    listening: socket.socket,
    host: str,
    loops: int = 1,
    listed: Sequence[str] = (),
) -> bool:
    """Run the API server, the reaper and ``loops`` worker loops; whether the server started.

    ``listed`` (the app's workflows) is printed after the banner.

    (uvicorn has logged why when it did not.)
    """
    # Worker loops in this process keep their connections as a worker process does.
    pooled = with_worker_pool(settings, worker_lanes(settings), loops) if loops else settings
    db = DatabaseManager(pooled)
    try:
        await db.initialize()
    except BaseException:
        await db.dispose()
        raise
    port: int = listening.getsockname()[1]
    banner = start_banner(
        settings,
        host=host,
        port=port,
        database=db.display_url,
        command=cli_command(sys.argv[0]),
    )
    if banner.settings is not settings:
        # A generated admin token: log lines must blank it like a configured one.
        settings = banner.settings
        configure_logging(settings)
    # From here the app's lifespan disposes the database when the server stops.
    api = create_app(settings, db, workflows=app)
    _run_workers_with_the_api(api, settings, app, loops)
    # log_config=None: uvicorn's loggers (its access log too) go through our root handler, so
    # they share MOORLINE_LOG_FORMAT and its redaction (a key someone put in a URL, refused
    # with 400, must not land in the access log). MOORLINE_ACCESS_LOG=errors (the default) logs
    # only responses of 400 and more, with uvicorn's line (moorline.api.access).
    logged: ASGIApp = ErrorAccessLog(api) if settings.access_log is AccessLog.ERRORS else api
    server = uvicorn.Server(
        uvicorn.Config(
            logged,
            lifespan="on",
            log_config=None,
            access_log=settings.access_log is AccessLog.ALL,
            # Head size and count, read timeouts, connections (moorline.api.protocol).
            **uvicorn_limits(settings),
        )
    )
    shown = [*banner.lines, *listed]
    Console(soft_wrap=True, highlight=False).print("\n".join(shown), markup=False)
    with _shutdown_signals_end_cleanly():
        await server.serve(sockets=[listening])
    return server.started


def worker_lanes(settings: Settings) -> dict[str, int]:
    """The lanes and slots of the worker loops ``serve`` runs: every plan's lane, by default."""
    return default_lane_slots(resolve_plans(settings))


def _run_workers_with_the_api(api: FastAPI, settings: Settings, app: Moorline, loops: int) -> None:
    """Run the reaper and ``loops`` worker loops inside the API's lifespan.

    They start after the API's services and stop (running runs get the grace period, then are
    released) before those close, and they share the API's RuntimeStore and wake-ups, so a
    trigger wakes a worker of this process at once and a cancel or a message reaches it
    without Redis. With no worker loop (``--workers 0``) nothing waits for a lane, so the
    wake-ups' listener is not started: it would receive every wake-up of the deployment, this
    process's own triggers' included, and drop each one.
    """
    services: Services = api.state.services
    lanes = worker_lanes(settings)
    serving = api.router.lifespan_context

    @asynccontextmanager
    async def with_workers(application: FastAPI) -> AsyncIterator[None]:
        async with serving(application):
            if loops:
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
                    chores=[
                        make_scheduler(
                            settings,
                            services.db,
                            admission=services.admission,
                            workflows=app,
                            metrics=services.metrics,
                        )
                    ],
                ),
                name="workers",
            )
            # What the start made lives as long as the server: out of the GC's full passes.
            freeze_start_up_objects()
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
