"""``moorline worker``: claim and execute runs (and run the reaper loop) until stopped."""

import asyncio
import os
from contextlib import AsyncExitStack
from typing import Annotated

import typer

from moorline.admission.scheduler import make_scheduler
from moorline.admission.stack import build_admission
from moorline.cli.banner import workflow_lines
from moorline.cli.main import configure_logging
from moorline.db.manager import DatabaseManager
from moorline.dispatch.lanes import resolve_lanes
from moorline.dispatch.wakeups import make_wakeups
from moorline.engine.loader import DEFAULT_APP, load_app
from moorline.engine.registry import Moorline
from moorline.observability import tracing
from moorline.observability.metrics import Metrics
from moorline.plans import default_lane_slots, resolve_plans
from moorline.settings import Settings, load_settings
from moorline.worker.process import (
    freeze_start_up_objects,
    install_stop_signals,
    pin_mmap_threshold,
    run_worker_process,
    with_worker_pool,
)


def register(cli: typer.Typer) -> None:
    """Add ``worker`` to the ``moorline`` command tree."""
    cli.command("worker")(worker)


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
    configure_logging(settings, warn_unknown=True)
    tracing.configure_from_env("moorline-worker")
    spec = app or settings.app or DEFAULT_APP
    application = load_app(spec, app_dir=os.getcwd())
    print("\n".join(workflow_lines(application, spec)), flush=True)
    served = resolve_lanes(lanes, default_lane_slots(resolve_plans(settings)))
    pin_mmap_threshold()  # RSS stays flat on asyncio's read buffers: see the function
    try:
        asyncio.run(_work(with_worker_pool(settings, served), application, served, grace))
    finally:
        tracing.shutdown()  # the spans still buffered are exported


async def _work(settings: Settings, app: Moorline, lanes: dict[str, int], grace_s: float) -> None:
    db = DatabaseManager(settings)
    try:
        await db.initialize()
        stop = asyncio.Event()
        install_stop_signals(stop)
        notifier, waiter = make_wakeups(settings, db)
        await waiter.start()
        metrics = Metrics()
        # The scheduler submits ticks through admission, as the API submits triggers.
        closing = AsyncExitStack()
        stack = build_admission(settings, db, closing, metrics=metrics, wakeups=(notifier, waiter))
        try:
            async with closing:
                scheduler = make_scheduler(
                    settings, db, admission=stack.admission, workflows=app, metrics=metrics
                )
                freeze_start_up_objects()
                await run_worker_process(
                    settings,
                    app,
                    db,
                    lanes=lanes,
                    stop=stop,
                    notifier=notifier,
                    waiter=waiter,
                    grace_s=grace_s,
                    metrics=metrics,
                    chores=[scheduler],
                )
        finally:
            await waiter.close()
    finally:
        await db.dispose()
