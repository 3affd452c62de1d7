"""A worker process: database, plans, wake-ups, the reaper loop and the :class:`Worker`.

``moorline worker`` runs this on its own; ``moorline serve`` runs it beside the API in one
process. Every worker process also runs the reaper loop, of which only the leader acts.
"""

import asyncio
import logging
import os
import signal
from collections.abc import Mapping

from moorline.db.manager import DatabaseManager
from moorline.dispatch.reaper import make_reaper
from moorline.dispatch.wakeups import Notifier, Waiter
from moorline.engine.registry import Moorline
from moorline.engine.runner import WorkflowRunner
from moorline.plans import PlansProvider
from moorline.runtime.factory import make_runtime_store
from moorline.settings import Settings
from moorline.worker.worker import Worker, make_owner_id

logger = logging.getLogger(__name__)

EXIT_INTERRUPTED = 130


async def run_worker_process(
    settings: Settings,
    app: Moorline,
    db: DatabaseManager,
    *,
    lanes: Mapping[str, int],
    stop: asyncio.Event,
    notifier: Notifier | None = None,
    waiter: Waiter | None = None,
    grace_s: float = 30.0,
) -> None:
    """Run the reaper loop and a worker over ``lanes`` until ``stop`` is set.

    Raises:
        WorkerCrashed: a long-lived loop died (the process should exit non-zero).
    """
    plans = PlansProvider(settings)
    owner = make_owner_id()
    reaper = make_reaper(settings, db, holder=owner, notifier=notifier)
    store = make_runtime_store(settings)
    try:
        worker = Worker(
            db,
            WorkflowRunner(app, db=db, store=store, settings=settings),
            lanes=lanes,
            lease_ttl_s=settings.lease_ttl,
            tenant_caps=plans.tenant_caps,
            waiter=waiter,
            owner=owner,
            grace_s=grace_s,
        )
        async with asyncio.TaskGroup() as group:
            group.create_task(reaper.run(stop), name="reaper")
            group.create_task(worker.run(stop), name="worker")
    finally:
        # After the worker: its runs have finished or been released, so no wait is cut short.
        await store.close()


def install_stop_signals(stop: asyncio.Event) -> None:
    """SIGTERM or a first SIGINT: graceful stop. A second SIGINT: exit at once (130)."""
    loop = asyncio.get_running_loop()

    def graceful(name: str) -> None:
        if stop.is_set():
            if name == "SIGINT":
                logger.warning("second SIGINT: exiting without waiting for running runs")
                os._exit(EXIT_INTERRUPTED)
            return
        logger.info("%s: stopping; running runs get the grace period, then are released", name)
        stop.set()

    loop.add_signal_handler(signal.SIGTERM, graceful, "SIGTERM")
    loop.add_signal_handler(signal.SIGINT, graceful, "SIGINT")
