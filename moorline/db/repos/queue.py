"""Dispatch-side SQL in one object: claims, leases, reaping and the leader lease.

Each concept has its own module (:mod:`.claims`, :mod:`.leases`, :mod:`.reaping`,
:mod:`.leader`) and the claim-order policy is :mod:`moorline.db.fairness`. :class:`QueueRepo`
joins the four repositories for the worker, the reaper and the tests, which use them together,
and the names they import from here are re-exported.
"""

from moorline.db.manager import DatabaseManager

# The event names live in events.py; re-exported (``as``) so imports from here keep working.
from moorline.db.repos.claims import Claim as Claim
from moorline.db.repos.claims import ClaimBatch as ClaimBatch
from moorline.db.repos.claims import ClaimRequest as ClaimRequest
from moorline.db.repos.claims import ClaimsRepo
from moorline.db.repos.events import EVENT_CANCELLED as EVENT_CANCELLED
from moorline.db.repos.events import EVENT_FAILED as EVENT_FAILED
from moorline.db.repos.events import EVENT_RECLAIMED as EVENT_RECLAIMED
from moorline.db.repos.events import EVENT_RELEASED as EVENT_RELEASED
from moorline.db.repos.events import EVENT_STARTED as EVENT_STARTED
from moorline.db.repos.leader import LeaderRepo
from moorline.db.repos.leases import LeasesRepo
from moorline.db.repos.leases import Renewal as Renewal
from moorline.db.repos.reaping import DEFAULT_REAP_LIMIT as DEFAULT_REAP_LIMIT
from moorline.db.repos.reaping import MAX_ATTEMPTS_REASON as MAX_ATTEMPTS_REASON
from moorline.db.repos.reaping import Reaped as Reaped
from moorline.db.repos.reaping import ReapingRepo


class QueueRepo(ClaimsRepo, LeasesRepo, ReapingRepo, LeaderRepo):
    """Claims, leases, reaping and leader leases over one :class:`DatabaseManager`.

    No code of its own: the methods are the four repositories'. Patching one on this class (as
    tests do) reaches every caller that holds a ``QueueRepo``.
    """

    def __init__(self, db: DatabaseManager) -> None:
        ClaimsRepo.__init__(self, db)
        LeasesRepo.__init__(self, db)
        ReapingRepo.__init__(self, db)
        LeaderRepo.__init__(self, db)
