"""A worker process: database, plans, wake-ups, the chores and the :class:`Worker`.

``moorline worker`` runs this on its own; ``moorline serve`` runs it beside the API in one
process. Every worker process also runs the loops of the leader-elected chores (the reaper,
the timer sweep, the bulk-job processor, the retention cleaner, and those passed in, such as
the scheduler), of which only each chore's leader acts.
"""

import asyncio
import ctypes
import gc
import logging
import os
import signal
from collections.abc import Mapping, Sequence

from moorline.db.manager import DatabaseManager
from moorline.dispatch.bulk import make_bulk_processor
from moorline.dispatch.chores import LeaderChore
from moorline.dispatch.reaper import make_reaper
from moorline.dispatch.retention import make_retention_cleaner
from moorline.dispatch.timers import make_timer_sweep
from moorline.dispatch.wakeups import BackgroundNotifier, Notifier, Waiter
from moorline.engine.registry import Moorline
from moorline.engine.runner import WorkflowRunner
from moorline.llm.models import ModelsProvider
from moorline.observability.metrics import Metrics
from moorline.plans import PlansProvider
from moorline.runtime.base import RuntimeStore
from moorline.runtime.factory import make_runtime_store
from moorline.settings import Settings
from moorline.worker.governor import make_governor
from moorline.worker.worker import Worker, make_owner_id

logger = logging.getLogger(__name__)

EXIT_INTERRUPTED = 130

M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number of the mmap threshold (``<malloc.h>``)."""
MMAP_THRESHOLD_BYTES = 128 * 1024
"""glibc's default mmap threshold: larger blocks get their own mapping, returned when freed."""

CONNECTIONS_PER_SLOT = 2
"""A slot's run writes its checkpoints while its event writer, in the background, writes the
progress events a timer flushes (``step_started``, ``step_finished``): two at once at most."""
WORKER_LOOPS_PER_LANE = 1
"""A worker's claim loop of each lane, which holds a connection while it claims."""
WORKER_OWN_LOOPS = 3
"""A worker's outcome commits, lease heartbeat and presence beat: each holds a connection while
it writes, and the beats come while every slot may hold one (a drain under load)."""


def with_worker_pool(settings: Settings, lanes: Mapping[str, int], loops: int = 1) -> Settings:
    """``settings`` with a database pool that keeps the connections ``loops`` workers use.

    SQLAlchemy's pool closes a connection as it comes back whenever ``db_pool_size`` others
    already wait idle; only the overflow above them is opened again at the next demand. A
    worker's slots are its steady concurrency, not a peak: with more slots than kept
    connections, a drain opened and closed a connection every few runs (each a TCP and
    authentication handshake and a cold statement cache, several milliseconds of the worker's
    CPU). So a worker process keeps the connections its slots may hold at once
    (:data:`CONNECTIONS_PER_SLOT`) and one for each of a worker's own loops that meet the
    slots' demand (:data:`WORKER_LOOPS_PER_LANE` and :data:`WORKER_OWN_LOOPS`), within the
    same bound (``db_pool_size + db_max_overflow``): the most connections a process may hold
    is unchanged, it only stops giving them back mid-drain.
    """
    bound = settings.db_pool_size + settings.db_max_overflow
    slots = sum(lanes.values())
    per_worker = (
        CONNECTIONS_PER_SLOT * slots + WORKER_LOOPS_PER_LANE * len(lanes) + WORKER_OWN_LOOPS
    )
    kept = min(bound, max(settings.db_pool_size, max(loops, 1) * per_worker))
    return settings.model_copy(update={"db_pool_size": kept, "db_max_overflow": bound - kept})


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
    store: RuntimeStore | None = None,
    loops: int = 1,
    metrics: Metrics | None = None,
    chores: Sequence[LeaderChore] = (),
) -> None:
    """Run the reaper loop and ``loops`` workers over ``lanes`` until ``stop`` is set.

    Args:
        settings: The process settings.
        app: The workflows the workers run.
        db: The database.
        lanes: Lane → slots of each worker.
        stop: Set to stop: claiming ends, running runs get ``grace_s``, then are released.
        notifier: Wake-ups the reaper sends when it requeues runs.
        waiter: Wake-ups the workers wait on.
        grace_s: How long running runs may finish after ``stop``.
        store: The RuntimeStore to share (``moorline serve`` shares the API's, so a cancel or a
            message reaches in-process workers without Redis); None makes one, closed here.
        loops: Workers in this process, each with its own lease owner id; 0 runs the reaper
            and the timer sweep alone.
        metrics: Where the reaper and the workers count their events (``moorline serve``
            passes its API's, so ``/metrics`` shows them); None makes a set for this process.
        chores: More leader-elected loops to run beside the reaper and the timer sweep (the
            scheduler, which needs admission: the CLI builds it, this layer cannot).

    Raises:
        WorkerCrashed: a long-lived loop died (the process should exit non-zero).
    """
    plans = PlansProvider(settings)
    owners = [make_owner_id() for _ in range(max(loops, 1))]
    counted = metrics if metrics is not None else Metrics()
    reaper = make_reaper(settings, db, holder=owners[0], notifier=notifier, metrics=counted)
    timers = make_timer_sweep(settings, db, holder=owners[0], notifier=notifier, metrics=counted)
    cleaner = make_retention_cleaner(settings, db, plans, holder=owners[0])
    own_store = store is None
    secrets = [
        secret.get_secret_value()
        for secret in (settings.admin_token, settings.llm_api_key, settings.api_key)
        if secret is not None
    ]
    runtime = make_runtime_store(settings) if store is None else store
    bulk = make_bulk_processor(settings, db, holder=owners[0], notifier=notifier, store=runtime)
    # One governor per process: the limiter's waiters of all its workers share one queue.
    # The models file prices the calls and declares their limits, for it and the runners.
    models = ModelsProvider(settings)
    governor = make_governor(settings, db, plans, models=models)
    # Child runs a workflow starts wake the lane's workers (here and elsewhere) at once.
    enqueued = None if notifier is None else BackgroundNotifier(notifier)
    try:
        workers = [
            Worker(
                db,
                WorkflowRunner(
                    app,
                    db=db,
                    store=runtime,
                    settings=settings,
                    call_hook=governor,
                    models=models,
                    on_enqueued=enqueued,
                ),
                lanes=lanes,
                lease_ttl_s=settings.lease_ttl,
                poll_interval_s=settings.poll_interval,
                tenant_caps=plans.tenant_caps,
                waiter=waiter,
                owner=owner,
                grace_s=grace_s,
                metrics=counted,
                secrets=secrets,
                workflows=[workflow.name for workflow in app],
                notifier=notifier,
            )
            for owner in owners[:loops]
        ]
        async with asyncio.TaskGroup() as group:
            group.create_task(reaper.run(stop), name="reaper")
            group.create_task(timers.run(stop), name="timers")
            for chore in chores:
                group.create_task(chore.run(stop), name=chore.name)
            group.create_task(bulk.run(stop), name="bulk")
            group.create_task(cleaner.run(stop), name="retention")
            for index, worker in enumerate(workers):
                group.create_task(worker.run(stop), name=f"worker:{index}")
    finally:
        # After the workers: their runs have finished or been released, so no wait is cut
        # short.
        if enqueued is not None:
            await enqueued.close()
        await governor.close()
        if own_store:
            await runtime.close()


def pin_mmap_threshold() -> bool:
    """Keep glibc's mmap threshold at its default; whether it was set (False off glibc).

    asyncio's socket transport reads each time into a fresh 256 KiB ``bytes`` object and shrinks
    it to what arrived (``sock.recv(max_size)``): one such buffer per Redis reply and
    PostgreSQL read, dozens per run. glibc serves blocks above its mmap threshold (128 KiB) with
    a mapping of their own, but raises the threshold to the size of any mapped block freed (up
    to 32 MiB), and the imports of a worker free a few large ones. From then on every read
    buffer is carved from the heap and shrunk in place, and the heap fragments: a worker on the
    Redis store (more reads per run) grew its RSS about 1 MiB per 1,000 runs, all of it free
    heap memory glibc kept (``fordblks``) while the memory in use stayed flat, and so did the
    Python objects (``bench/memory.py`` shows both). A fixed threshold turns the adjustment off,
    as ``MALLOC_MMAP_THRESHOLD_`` does: read buffers are mapped and unmapped whole (three system
    calls per read) and the heap stops growing. uvloop (``moorline serve``) reads into one
    reused buffer and does not need this.
    """
    try:
        os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError, AttributeError):
        return False  # not glibc: its allocator has no such threshold to pin
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def freeze_start_up_objects() -> None:
    """Leave what exists once a server or worker has started out of the cyclic GC's passes.

    Every full pass of CPython's cyclic garbage collector visits every object it tracks, and
    most of those in a started process are its imports' (modules, classes, SQLAlchemy's tables
    and compiled statements, FastAPI's routes and models), alive until it exits. A full pass
    comes each time the objects that outlived the younger passes reach a quarter of the old
    ones, and a batch of a thousand runs keeps enough alive long enough for that every few
    batches: under a stream of batches ``moorline serve`` spent a good part of its time in
    those passes (docs/performance.md). Frozen (after a collection, so no garbage is kept),
    those objects are no longer visited and a full pass visits only what was made since; that
    is collected as before. An object frozen that becomes garbage in a cycle later is not
    collected: done once, at start, that is a few objects, not a growing leak.
    """
    gc.collect()
    gc.freeze()


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
