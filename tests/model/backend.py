"""What every example of the run state machine on one backend shares."""

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from moorline.db.manager import DatabaseManager
from moorline.db.repos.parking import ParkingRepo
from moorline.db.repos.queue import QueueRepo
from moorline.dispatch.leader import LeaderElector
from moorline.dispatch.timers import LEADER_LEASE, TimerSweep
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.types import TenantId

T = TypeVar("T")

LONG_S = 3600.0
"""Database seconds of every lease, retry delay and deadline: never reached by itself."""

PAST_S = -60.0
"""Where ``advance_clock`` moves a lease, delay or deadline the model's clock passed."""

CALL_TIMEOUT_S = 30.0
"""Longest any one repository call may take before the example fails."""


@dataclass
class Backend:
    """What every example on one backend shares: the loop, database, RuntimeStore, tenant.

    Each example keeps to a lane of its own (claims read one lane) and deletes its runs, with
    their steps, events and approvals, when it ends (the reaper, approval expiry and the timer
    sweep read the whole database).
    """

    runner: asyncio.Runner
    db: DatabaseManager
    store: InMemoryRuntimeStore
    tenant: TenantId
    sweeps: dict[int, TimerSweep] = field(default_factory=dict)

    def timer_sweep(self, batch_limit: int) -> TimerSweep:
        """The timer sweep moving ``batch_limit`` runs a transaction; one leader for all."""
        if batch_limit not in self.sweeps:
            # One holder all along: its leader lease outlives the module (LONG_S).
            elector = LeaderElector(
                QueueRepo(self.db), name=LEADER_LEASE, holder="model", ttl_s=LONG_S
            )
            self.sweeps[batch_limit] = TimerSweep(
                ParkingRepo(self.db), elector, interval_s=1.0, batch_limit=batch_limit
            )
        return self.sweeps[batch_limit]

    def sync(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.runner.run(self._within_deadline(coroutine))

    async def _within_deadline(self, coroutine: Coroutine[Any, Any, T]) -> T:
        # A call that hangs fails here, with its stack, rather than at pytest's timeout.
        async with asyncio.timeout(CALL_TIMEOUT_S):
            return await coroutine
