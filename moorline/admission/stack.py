"""Admission with everything it stands on, built one way for every process that admits runs.

The API, ``app.submit`` and the scheduler of a ``moorline worker`` all build it here.

:func:`build_admission` makes the wake-ups, the quota and budget stores, the rate limiter,
the group-commit :class:`~moorline.dispatch.submit.Submitter` (gated when the counters are in
Redis) and the :class:`~moorline.admission.admit.Admission` over them, and registers each one's
close on the caller's exit stack, so the last built closes first (admission lets its decisions
finish before the Submitter writes its last batch, before the counters it settles batches
with).
"""

from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass

from moorline.admission.admit import Admission
from moorline.admission.gate import make_gate
from moorline.admission.quotas import make_quota_store
from moorline.admission.ratelimit import RateLimiter
from moorline.db.manager import DatabaseManager
from moorline.db.repos.listing import RunListing
from moorline.db.repos.runs import RunsRepo
from moorline.dispatch.budgets import make_budget_store
from moorline.dispatch.submit import Submitter
from moorline.dispatch.wakeups import (
    BackgroundNotifier,
    ListeningWakeups,
    Notifier,
    Waiter,
    make_wakeups,
)
from moorline.observability.metrics import Metrics
from moorline.settings import Settings


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionStack:
    """Admission and the parts of it other code uses too.

    Attributes:
        notifier: Wakes a lane's workers (the Submitter's hook sends through it).
        waiter: The same wake-ups' receiving half; started only where workers wait.
    """

    admission: Admission
    rate_limiter: RateLimiter
    runs: RunsRepo
    listing: RunListing
    notifier: Notifier
    waiter: Waiter


def build_admission(
    settings: Settings,
    db: DatabaseManager,
    closing: AsyncExitStack,
    *,
    metrics: Metrics,
    wakeups: tuple[Notifier, Waiter] | None = None,
) -> AdmissionStack:
    """Admission over ``db`` with the deployment's wake-ups, counters and rate limits.

    Nothing connects here: each client opens its connections on first use.

    Args:
        settings: Choose Redis or the database for counters and wake-ups.
        db: The runs' database.
        closing: Where each part's close is registered.
        metrics: Where admission counts its refusals.
        wakeups: The process's own wake-ups (a worker process's, which its caller closes);
            None: made here from the settings, and closed with ``closing``.
    """
    if wakeups is None:
        wakeups = make_wakeups(settings, db)
        closing.push_async_callback(wakeups[1].close)  # also releases the notifier's connections
    notifier, waiter = wakeups
    on_enqueued: Callable[[set[str]], bool | None]
    announcement = None
    if (
        isinstance(notifier, ListeningWakeups)
        and (announcement := notifier.announcement()) is not None
    ):
        # LISTEN/NOTIFY: the batches' writes send the other processes' wake-ups themselves,
        # and the hook has only this process's waiters to wake.
        on_enqueued = notifier.wake
    else:
        background = BackgroundNotifier(notifier)
        closing.push_async_callback(background.close)
        on_enqueued = background
    runs = RunsRepo(db)
    quotas = make_quota_store(settings, db)
    closing.push_async_callback(quotas.close)
    budgets = make_budget_store(settings, db)
    closing.push_async_callback(budgets.close)
    rate_limiter = RateLimiter(settings)
    closing.push_async_callback(rate_limiter.close)
    submitter = Submitter(
        runs,
        on_enqueued=on_enqueued,
        gate=make_gate(rate_limiter, quotas),
        announcement=announcement,
    )
    closing.push_async_callback(submitter.close)
    listing = RunListing(db)
    admission = Admission(
        runs=runs,
        listing=listing,
        submitter=submitter,
        quotas=quotas,
        rate_limiter=rate_limiter,
        metrics=metrics,
        budgets=budgets,
    )
    closing.push_async_callback(admission.close)
    return AdmissionStack(
        admission=admission,
        rate_limiter=rate_limiter,
        runs=runs,
        listing=listing,
        notifier=notifier,
        waiter=waiter,
    )
