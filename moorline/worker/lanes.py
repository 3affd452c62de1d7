"""A worker's lane: its slots, and the loop that claims runs for them.

Each lane of a worker has its own slots and its own claim loop, so a flooded sandbox lane never
takes a professional slot. A loop claims as many runs as it has free slots, in one transaction
(:meth:`~moorline.db.repos.queue.QueueRepo.claim`, which also enforces tenant caps and
round-robin between tenants), then sleeps until a wake-up, the slow poll, or a local reason to
look again: a freed slot when the lane was full or a tenant's cap held runs back, or a retry of
its own whose delay has passed (:meth:`Lane.wake`).

While the loop wants a freed slot, ending runs hand it their outcomes, and its next claim
writes them first, in the same transaction (:mod:`moorline.worker.handoffs`).
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from sqlalchemy.exc import DBAPIError

from moorline.concurrency import is_set_within
from moorline.db.repos.handoffs import HandoffsRepo
from moorline.db.repos.queue import Claim, ClaimBatch, ClaimRequest, QueueRepo
from moorline.db.repos.runs import Outcome
from moorline.errors import BackendUnavailable
from moorline.worker.completions import Completer
from moorline.worker.executions import Execution
from moorline.worker.handoffs import Handed, Handoffs

logger = logging.getLogger(__name__)

CLAIM_BACKOFF_S = 0.1
"""First pause after a failed claim; doubled per further failure, up to CLAIM_BACKOFF_MAX_S."""
CLAIM_BACKOFF_MAX_S = 5.0


class Waiter(Protocol):
    """Wakes a lane's claim loop when new work may be there (see ``moorline.dispatch``)."""

    async def wait(self, lane: str, timeout_s: float, *, seen_before: float | None = None) -> bool:
        """Return True when woken for ``lane``, False after ``timeout_s``.

        Wake-ups from before ``seen_before`` (``time.monotonic()``) are already covered.
        """
        ...


def _answered(recheck: asyncio.Event, _: "asyncio.Future[bool]") -> None:
    """The waiter's task ended (woken or timed out): the claim loop looks again."""
    recheck.set()


@dataclass(frozen=True, slots=True, kw_only=True)
class Claiming:
    """What every lane of one worker claims with, and how it learns of new work."""

    queue: QueueRepo
    handoffs_repo: HandoffsRepo
    owner: str
    lease_ttl_s: float
    tenant_caps: Callable[[], Awaitable[Mapping[str, int]]]
    """Plan → tenant concurrency cap, asked before every claim."""
    workflows: Sequence[str] | None
    waiter: Waiter | None
    poll_interval_s: float


class Lane:
    """One lane of a worker: its slots, its claim loop, and what makes the loop look again."""

    def __init__(
        self,
        name: str,
        slots: int,
        claiming: Claiming,
        *,
        handoffs: Handoffs[Execution],
        completer: Completer,
        start: Callable[[Sequence[Claim]], None],
    ) -> None:
        """A lane of ``slots`` slots; ``start`` runs each claimed batch (it is called at once)."""
        self.name = name
        self.slots = slots
        self._claiming = claiming
        self._handoffs = handoffs
        self._completer = completer
        self._start = start
        self.in_use = 0
        """Slots taken: executions running, and outcomes not yet committed."""
        self._is_claiming = True
        self._recheck = asyncio.Event()
        """Set when this process knows the lane may have claimable work (see :meth:`run`)."""
        self._wants_slot = False
        """Whether a slot freed in the lane should make its loop claim again."""
        self._waiting = False
        """Whether the loop waits (for work or a slot) rather than claims right now."""
        self._freed_at = 0.0
        """``time.monotonic()`` when the lane's latest slot was freed."""
        self.claim_transactions = 0
        """Claims made so far, empty ones included."""
        self.handed_off = 0
        """Outcomes committed with the lane's next claim (:mod:`moorline.worker.handoffs`)."""

    def wake(self) -> None:
        """The lane may have claimable work: its loop looks again."""
        self._recheck.set()

    def stop_claiming(self) -> None:
        """Claim no more: the loop ends at its next turn (it is woken for it)."""
        self._is_claiming = False
        self._recheck.set()

    def freed(self) -> None:
        """An execution of the lane ended and its slot is free (its outcome is written)."""
        self.in_use -= 1
        self._freed_at = time.monotonic()
        if self._wants_slot:
            self._recheck.set()

    async def complete(self, execution: Execution, outcome: Outcome) -> bool:
        """Write ``outcome``: handed to the loop if it wants a slot, else grouped.

        Handed also while the loop is claiming, not only while it waits: the outcome then goes
        with the claim after this one. Runs of a lane that end one after another (each ends a
        step or a commit after the one before) otherwise met a loop that was busy with the
        last one's claim, and each outcome became a group commit of its own beside a claim
        of one run. Handed that way they gather while a claim runs, and the next claim writes
        them all.
        """
        if self._is_claiming and self._wants_slot:
            answer = self._handoffs.hand(self.name, execution, outcome)
            self._recheck.set()
            return await answer
        return await self._completer.complete(outcome)

    async def run(self, stop: asyncio.Event) -> None:
        """Claim whenever the lane may have work for a free slot, else wait.

        The loop claims again at once after a full batch; otherwise it waits for a wake-up
        (new work somewhere), the slow poll, or a local reason: a run of this worker went
        back to the queue with a retry delay that has now passed, or a slot was freed while
        the last claim had left runs behind for want of a tenant's free slot. A slot freed
        when the last claim found the lane empty wakes nobody: a claim then would find nothing
        the wake-ups would not announce, and on SQLite would still take the write lock.

        While it waits for a freed slot, ending runs hand it their outcomes, and its next claim
        writes them first, in the same transaction (:mod:`moorline.worker.handoffs`).
        """
        failures = 0
        try:
            while self._is_claiming:
                failures = await self._claim_once(failures, stop)
        except BaseException:
            for handed in self._handoffs.take(self.name):
                # The worker is going down: their runs return through the reaper.
                handed.answer.cancel()
            raise
        # Handed as the loop stopped: the group commit writes them (it outlives the loops).
        await self._handoffs.to_completer(self._handoffs.take(self.name))

    async def _claim_once(self, failures: int, stop: asyncio.Event) -> int:
        """One turn of :meth:`run`: claim, or wait; the claim failures in a row."""
        handed = self._handoffs.take(self.name)
        # The handed runs' slots are free once their outcomes commit, before the claim reads
        # (those of executions already finished, stopped by their self-fence, were freed then).
        free = self.slots - self.in_use + sum(not h.execution.finished for h in handed)
        if free <= 0:
            self._wants_slot = True
            self._recheck.clear()
            await self._wait_while(self._recheck.wait())
            return failures
        try:
            batch = await self._claim(free, handed)
        except (DBAPIError, BackendUnavailable) as exc:
            # A dropped connection, a failover, a terminated backend: the worker outlives it. A
            # claim whose commit went through unseen only delays its runs until the reaper
            # hands them back (their lease names this worker, which never ran them). Outcomes
            # handed during the claim go through the group commit, which retries them, rather
            # than wait out the pause below.
            await self._handoffs.to_completer(self._handoffs.take(self.name))
            failures += 1
            delay_s = min(CLAIM_BACKOFF_MAX_S, CLAIM_BACKOFF_S * 2 ** (failures - 1))
            logger.warning(
                "claim in lane %s failed (%r); trying again in %.1fs", self.name, exc, delay_s
            )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay_s):
                    await stop.wait()
            return failures
        self.claim_transactions += 1
        self.in_use += len(batch.claims)
        self._start(batch.claims)
        if len(batch.claims) < free and self._is_claiming:
            self._wants_slot = batch.is_capped
            if batch.is_capped and self._freed_at > batch.began_monotonic_s:
                # A slot freed during the claim woke nobody (``_wants_slot`` was the last
                # batch's answer), and the claim may have counted its run still running.
                return 0
            await self._wait_while(self._wait_for_work(batch.began_monotonic_s))
        return 0

    async def _claim(self, free: int, handed: list[Handed[Execution]]) -> ClaimBatch:
        """Claim up to ``free`` runs, after writing the ``handed`` outcomes in the same transaction.

        Handed outcomes that could not be written that way go through the group commit, which
        retries them; the claim's failure is raised as a lone claim's would be.
        """
        claiming = self._claiming
        request = ClaimRequest(
            lane=self.name,
            owner=claiming.owner,
            limit=free,
            lease_ttl_s=claiming.lease_ttl_s,
            tenant_caps=await claiming.tenant_caps(),
            workflows=claiming.workflows,
        )
        if not handed:
            return await claiming.queue.claim_as(request)
        try:
            outcomes = [item.outcome for item in handed]
            applied, batch = await claiming.handoffs_repo.finish_and_claim(outcomes, request)
        except (DBAPIError, BackendUnavailable):
            await self._handoffs.to_completer(handed)
            raise
        except BaseException:
            for item in handed:
                item.answer.cancel()
            raise
        for item in handed:
            # Committed: the slot is the claim's now (counted free above), not the ended run's,
            # unless the execution finished meanwhile and freed it itself (:meth:`freed`).
            if not item.execution.finished:
                item.execution.slot_released = True
                self.in_use -= 1
        self.handed_off += len(handed)
        self._handoffs.settle(handed, applied)
        return batch

    async def _wait_while(self, waiting: Awaitable[object]) -> None:
        """Await ``waiting`` with the loop marked as waiting (it takes handoffs then)."""
        self._waiting = True
        try:
            await waiting
        finally:
            self._waiting = False

    async def _wait_for_work(self, seen_before: float) -> None:
        """Until a wake-up for the lane, a local recheck (``stop`` sets one), or the slow poll.

        Wake-ups sent before ``seen_before``, when the last claim's transaction began,
        announced runs that claim saw already: they do not count.

        Everything that ends the wait sets the lane's ``recheck`` event, the waiter's answer
        included (from its task's done callback), so the loop awaits one event: a wake-up
        reaches the claim in three turns of the event loop, not the six that
        ``asyncio.wait`` over a task per reason, and then collecting the cancelled ones,
        took. Each turn is a wait behind every ready callback of a busy worker.
        """
        recheck = self._recheck
        if recheck.is_set():
            recheck.clear()
            return
        claiming = self._claiming
        woken: asyncio.Future[bool] | None = None
        answered = partial(_answered, recheck)
        if claiming.waiter is not None:
            woken = asyncio.ensure_future(
                claiming.waiter.wait(self.name, claiming.poll_interval_s, seen_before=seen_before)
            )
            woken.add_done_callback(answered)
        try:
            await is_set_within(recheck, claiming.poll_interval_s)
        finally:
            if woken is not None:
                # Its answer no longer matters (one landing in this very turn still sets
                # ``recheck`` later: at most one spare claim).
                woken.remove_done_callback(answered)
                if not woken.done():
                    woken.cancel()
                elif not woken.cancelled() and woken.exception() is not None:
                    # A dead listener surfaces as from any other loop: the claim loop dies
                    # and the worker exits non-zero instead of spinning on a broken waiter.
                    woken.result()
            recheck.clear()
