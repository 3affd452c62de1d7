"""One claimed run as the worker runs it: an :class:`Execution`, and its self-fence deadline.

The worker (:mod:`moorline.worker.worker`) starts and finishes executions; the lease keeper
(:mod:`moorline.worker.leases`) renews, fences and loses them. Both read and set the flags
below, always from the worker's event loop.
"""

import asyncio
import time
from dataclasses import dataclass, field

from moorline.db.repos.queue import Claim


@dataclass(eq=False)
class SelfFence:
    """One self-fence deadline, shared by the executions one claim or one renewal extended.

    A claim starts a whole batch and a heartbeat renews every lease in one statement, so
    their deadlines coincide: one timer serves them all, instead of a timer per execution
    armed, re-armed at each heartbeat and cancelled again at its end.
    """

    members: "set[Execution]" = field(default_factory=set)
    timer: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class Execution:
    """A claimed run in this worker, from its claim until its outcome is written."""

    claim: Claim
    lane: str
    task: asyncio.Task[None] | None = None
    self_fence: SelfFence | None = None
    """The deadline this execution is stopped at unless a renewal moves it on."""
    lost: bool = False
    """The lease is gone (or self-fenced): write nothing more for this attempt."""
    releasing: bool = False
    """Cancelled by shutdown: give the run back instead of failing it."""
    cancel_requested: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a heartbeat finds the run's cancel recorded in the database."""
    started: float = field(default_factory=time.monotonic)
    finished: bool = False
    """Its outcome is written (or given up): no heartbeat or fence concerns it any more."""
    parked: bool = False
    """Its attempt parked the run and is winding down: it holds no lease to renew or lose."""
    slot_released: bool = False
    """Its outcome was committed with its lane's next claim, which took its slot."""

    @property
    def is_held(self) -> bool:
        """Its lease is this worker's to renew: running, neither lost nor parked."""
        return not (self.lost or self.parked) and self.task is not None and not self.task.done()
