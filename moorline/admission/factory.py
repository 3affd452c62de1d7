"""Admission built for a process that has no API: the scheduler of ``moorline worker``.

The API builds its own in :func:`moorline.api.app.create_app`, beside the services it shares
them with; this is the same wiring, for a worker process whose scheduler submits ticks.
"""

from contextlib import AsyncExitStack

from moorline.admission.admit import Admission
from moorline.admission.gate import make_gate
from moorline.admission.quotas import make_quota_store
from moorline.admission.ratelimit import RateLimiter
from moorline.db.manager import DatabaseManager
from moorline.db.repos.listing import RunListing
from moorline.db.repos.runs import RunsRepo
from moorline.dispatch.submit import Submitter
from moorline.dispatch.wakeups import BackgroundNotifier, Notifier
from moorline.observability.metrics import Metrics
from moorline.settings import Settings


def build_admission(
    settings: Settings, db: DatabaseManager, *, notifier: Notifier, metrics: Metrics
) -> tuple[Admission, AsyncExitStack]:
    """Admission over ``db``, and the exit stack that closes what it opened (not ``db``).

    Its runs wake their lanes through ``notifier``; its quota counters and rate limits are
    where the settings put the API's (the database or Redis), so they are the same ones.
    """
    closing = AsyncExitStack()
    wakeups = BackgroundNotifier(notifier)
    closing.push_async_callback(wakeups.close)
    runs = RunsRepo(db)
    quotas = make_quota_store(settings, db)
    closing.push_async_callback(quotas.close)
    rate_limiter = RateLimiter(settings)
    closing.push_async_callback(rate_limiter.close)
    submitter = Submitter(runs, on_enqueued=wakeups, gate=make_gate(rate_limiter, quotas))
    closing.push_async_callback(submitter.close)
    admission = Admission(
        runs=runs,
        listing=RunListing(db),
        submitter=submitter,
        quotas=quotas,
        rate_limiter=rate_limiter,
        metrics=metrics,
    )
    closing.push_async_callback(admission.close)
    return admission, closing
