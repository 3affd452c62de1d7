"""Cancelling a run: the request is recorded in the database, then signalled to its worker.

The database is the truth of a cancel; the RuntimeStore only makes it fast. The order matters:
:meth:`~moorline.db.repos.runs.RunsRepo.request_cancel` commits ``cancel_requested_at`` (and
ends a ``queued`` or ``pending`` run at once) before the store's cancel flag is set, so losing
the store (a Redis restart, a failed signal) can delay a cancel but never drop it:

* signal delivered → the worker executing the run learns within milliseconds, its workflow
  raises ``moorline.Cancelled`` at its next check, and after ``MOORLINE_CANCEL_GRACE`` it is
  cancelled outright;
* signal lost → the worker's next heartbeat reads the request with the leases it renews (at
  most ``LEASE_TTL/3`` later), and step starts refuse it in the meantime;
* worker dead → the reaper ends the run ``cancelled`` when its lease expires.
"""

import logging

from moorline.db.repos.children import ChildrenRepo
from moorline.db.repos.records import Run
from moorline.db.repos.runs import RunsRepo
from moorline.errors import BackendUnavailable, RunFinished
from moorline.runtime.base import RuntimeStore
from moorline.types import RunId, RunStatus, TenantId

logger = logging.getLogger(__name__)


async def cancel_run(
    runs: RunsRepo,
    store: RuntimeStore,
    tenant_id: TenantId,
    run_id: RunId,
    children: ChildrenRepo | None = None,
) -> Run:
    """Cancel the tenant's run: record the request, then signal a running run's worker.

    Args:
        runs: The runs repository (the request is committed there first).
        store: The RuntimeStore the workers listen on.
        tenant_id: The tenant asking; another tenant's run is not found.
        run_id: The run to cancel.
        children: Where its child runs are found: every unfinished descendant is cancelled
            too (detached ones included: a cancel is the user's), each exactly once.

    Returns:
        The run after the request: ``cancelled`` when it was not running yet, else
        ``running`` with ``cancel_requested_at`` set (it ends ``cancelled`` at its next check,
        or after the grace period).

    Raises:
        RunNotFound: The tenant has no such run.
        RunFinished: The run already ended; nothing changed.
    """
    run = await runs.request_cancel(tenant_id, run_id)
    await after_cancel(runs, store, run, children)
    return run


async def after_cancel(
    runs: RunsRepo, store: RuntimeStore, run: Run, children: ChildrenRepo | None = None
) -> None:
    """What follows a recorded cancel: signal its worker, cancel its unfinished descendants.

    Args:
        runs: The runs repository.
        store: The RuntimeStore the workers listen on.
        run: The run as the cancel left it (``cancelled``, or ``running`` with the request).
        children: Where its child runs are found; None to leave them.
    """
    await _signal(store, run)
    if children is not None:
        for child in await children.unfinished_descendants(run.run_id):
            try:
                await _signal(store, await runs.request_cancel(run.tenant_id, child.run_id))
            except RunFinished:
                pass  # it ended meanwhile


async def _signal(store: RuntimeStore, run: Run) -> None:
    """Tell a running run's worker through the store; the heartbeat delivers it otherwise."""
    run_id, tenant_id = run.run_id, run.tenant_id
    if run.status is RunStatus.RUNNING:
        try:
            await store.request_cancel(run_id)
        except BackendUnavailable as exc:
            # Recorded all the same: the worker's next heartbeat delivers it.
            logger.warning(
                "cancel of run %s recorded, but not signalled: %r",
                run_id,
                exc,
                extra={"run_id": run_id, "tenant_id": tenant_id},
            )
