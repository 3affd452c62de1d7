"""Leader election over a lease row in the database, with a cached, re-verified answer.

Only the leader runs periodic chores (the reaper). Leadership is an efficiency, not a safety
mechanism: every chore is made of conditional statements that stay correct when two processes
both believe they lead (a paused leader waking up, a partition), so correctness never depends
on there being exactly one leader.

The lease is a row of ``leader_leases`` (see
:meth:`moorline.db.repos.queue.QueueRepo.try_acquire_leader`): renewed by its holder, taken over
by anyone once it has expired by database time, deleted on resignation.

The holder caches its leadership and asks the database only every ``verify_every`` ticks
(5, seed 002 §4.2), and in any case once ``TRUST_FRACTION`` of the lease has passed on the
monotonic clock: the verification is a renewal, so the lease is renewed in time, and a cached
"yes" never outlives the lease it stands for. A process that does not lead asks on every tick,
so it takes over on its first tick after a silent holder's lease expired.
"""

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable

from moorline.db.repos.queue import QueueRepo

logger = logging.getLogger(__name__)

VERIFY_EVERY_TICKS = 5
"""Ticks a cached leadership answers for (the verifying tick included), seed 002 §4.2."""

TRUST_FRACTION = 0.5
"""Share of the lease TTL after which a cached leadership is verified whatever the tick count,
leaving the other half for the renewal to land before the lease expires."""


def new_holder_id() -> str:
    """A holder id unique to this process and call: ``host:pid:random``, readable in the table."""
    return f"{socket.gethostname()[:40]}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class LeaderElector:
    """Decides, tick by tick, whether this process leads the chore ``name``.

    One elector per chore and process; its ``tick`` is called by one task at a time.
    """

    def __init__(
        self,
        queue: QueueRepo,
        *,
        name: str,
        holder: str,
        ttl_s: float,
        verify_every: int = VERIFY_EVERY_TICKS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Create an elector; nothing is asked of the database before the first tick.

        Args:
            queue: Where the leader lease rows live.
            name: The lease's name, one per chore (e.g. ``"reaper"``); at most 64 characters.
            holder: This process's unique id (see :func:`new_holder_id`).
            ttl_s: Seconds a lease lives without renewal; a silent leader is replaced after
                it. Make it at least three tick intervals so renewals land in time.
            verify_every: Ticks one verification answers for; 1 asks the database every tick.
            clock: Monotonic clock in seconds, replaceable in tests.

        Raises:
            ValueError: ``ttl_s`` is not positive or ``verify_every`` is below 1.
        """
        if ttl_s <= 0 or verify_every < 1:
            raise ValueError("ttl_s must be positive and verify_every at least 1")
        self._queue = queue
        self.name = name
        self.holder = holder
        self.ttl_s = ttl_s
        self._verify_every = verify_every
        self._clock = clock
        self._leader = False
        self._cached_ticks = 0
        self._trust_until = 0.0
        # Whether the database may hold a lease of ours: after a campaign whose answer was
        # lost (an error after the commit) we cannot tell, and resigning is then worth a try.
        self._may_hold = False

    @property
    def is_leader(self) -> bool:
        """The answer of the last tick, from the cache (no database access)."""
        return self._leader

    async def tick(self) -> bool:
        """Whether to act as leader now: a cached answer, or a renewal or campaign when due.

        Returns:
            True when this process leads (by the cache or by the database just now).

        Raises:
            Exception: Whatever the database raised, after ``with_retry`` gave up; the cached
                leadership is dropped first, since leadership that cannot be verified is none.
        """
        now = self._clock()
        if self._leader and self._cached_ticks < self._verify_every - 1 and now < self._trust_until:
            self._cached_ticks += 1
            return True
        return await self._verify()

    async def _verify(self) -> bool:
        # Read before the statement: the database sets the expiry at or after this instant,
        # so trusting until started + TTL * TRUST_FRACTION never trusts an expired lease.
        started = self._clock()
        self._may_hold = True
        try:
            held = await self._queue.try_acquire_leader(self.name, self.holder, self.ttl_s)
        except BaseException:
            self._leader = False
            raise
        if held != self._leader:
            logger.info(
                "%s the leadership of %r",
                "took" if held else "lost",
                self.name,
                extra={"holder": self.holder},
            )
        self._leader = held
        self._may_hold = held
        self._cached_ticks = 0
        self._trust_until = started + self.ttl_s * TRUST_FRACTION
        return held

    async def resign(self) -> None:
        """Give the lease up (graceful shutdown) so another process need not wait the TTL.

        Deletes only a lease this holder holds, so resigning after losing the lease to
        another process leaves the new holder alone. The next tick campaigns again.
        """
        self._leader = False
        self._cached_ticks = 0
        if not self._may_hold:
            return
        if await self._queue.resign_leader(self.name, self.holder):
            logger.info("resigned the leadership of %r", self.name, extra={"holder": self.holder})
        self._may_hold = False
