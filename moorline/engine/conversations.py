"""Conversations at run time: the conversation lease and the interactive window of an attempt.

At most one run per conversation of a tenant is active (conversation ids are the tenant's own
names: the store keys them with the tenant, :func:`~moorline.runtime.base.conversation_key`).
The database decides at admission
(:meth:`~moorline.db.repos.runs.RunsRepo.submit_many` refuses a second active run with
:class:`~moorline.errors.ConversationBusy`); at run time the RuntimeStore holds two states with
different lifetimes (seed 000):

- the **conversation lease**, held by ``"<run id>#<attempt>"`` from the moment the attempt
  starts until it is over and its outcome written (:meth:`Conversations.release`), renewed by
  the worker's heartbeat with the lease TTL. A lease left by a dead attempt expires with its
  TTL; one left by an attempt the database shows over (its run ended, or was taken over) is
  released by the next holder at once. A live holder of another run refuses the attempt with
  ``ConversationBusy``, a retryable failure: two runs of one conversation never execute
  together.
- the **interactive window**, which names the run whose workflow code is executing now: it
  opens as the workflow starts and closes as soon as it returns or raises, before the
  attempt's post-processing (final events, outcome), so messages are accepted only while
  something can still drain them. Runs without a conversation use their run id as the window's
  key. The worker's attempts open and close their windows in shared round trips
  (:mod:`moorline.engine.windows`).

  The workflow does not wait for its window to open: the open is queued as it starts, and the
  attempt's first write (an event, a step, an interrupt, a drain, a child; the
  :class:`~moorline.engine.events.EventWriter` waits in :meth:`Conversations.opened`) waits for
  it. Whatever a run shows the world goes through such a write, so anyone who saw the run
  act, and answers it with a message, finds its window open; code with no write yet may find
  a message refused for a round trip longer than before (a ``running`` run already refused
  them until its window opened). A workflow that returns before any batch took its open
  withdraws it: that window never opens, nothing is closed, and a no-op run makes no store
  call at all.

The store is coordination that may be lost: when it cannot be reached, the attempt runs on
(the database still fences every write). A lease or window the attempt could not take at its
start is asked for again by each heartbeat while its workflow runs (an agent waiting hours for
a message must not stay deaf for a blip of the store at its start); one taken and then lost (a
store restart) is taken again by the next heartbeat. A heartbeat's open goes into the same
ordered stream as the workflow's close, so it never lands behind it.
"""

import asyncio
import functools
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from moorline.db.repos.queue import Claim
from moorline.db.repos.records import Run
from moorline.db.repos.runs import RunsRepo
from moorline.engine.outages import OutageLog
from moorline.engine.windows import Windows, within
from moorline.errors import BackendUnavailable, ConversationBusy
from moorline.runtime.base import RuntimeStore, conversation_key
from moorline.types import Attempt, RunId, RunStatus

logger = logging.getLogger(__name__)

T = TypeVar("T")

HOLDER_SEPARATOR = "#"

STORE_CALL_TIMEOUT_S = 5.0
"""Longest a bookkeeping call to the store may take before it is given up (and logged)."""


def lease_holder(claim: Claim) -> str:
    """The conversation-lease holder of an attempt: ``"<run id>#<attempt>"``."""
    return f"{claim.fence.run_id}{HOLDER_SEPARATOR}{claim.fence.attempt}"


def parse_holder(holder: str) -> tuple[RunId, Attempt] | None:
    """``(run id, attempt)`` of a :func:`lease_holder` string; None for anything else."""
    run_id, separator, attempt = holder.rpartition(HOLDER_SEPARATOR)
    if not separator or not run_id or not attempt.isdigit():
        return None
    return RunId(run_id), Attempt(int(attempt))


def lease_key(run: Run) -> str | None:
    """The store's key of a run's conversation lease; None for a run without a conversation."""
    if run.conversation_id is None:
        return None
    return conversation_key(run.tenant_id, run.conversation_id)


def window_key(run: Run) -> str:
    """The key of a run's interactive window: its conversation's, else the run id."""
    key = lease_key(run)
    return key if key is not None else run.run_id


@dataclass(eq=False, slots=True)
class _Live:
    claim: Claim
    executing: bool = True
    """The workflow code runs: the attempt wants its window (until :meth:`Conversations.leave`)."""
    holds_lease: bool = False
    window_open: bool = False
    """Its open was asked for and it is not closing (the open may still be under way)."""
    opening: asyncio.Future[bool] | None = None
    """The attempt's last open (:meth:`Windows.begin`), done once the store has it."""
    told_held: bool = False
    """Logged that another run holds the conversation: every heartbeat asks again, and one
    warning per attempt says it (a long run would log one every heartbeat otherwise)."""


class Conversations:
    """Conversation leases and interactive windows of this worker's attempts.

    Args:
        store: The RuntimeStore.
        runs: Reads the runs of stale lease holders.
        lease_ttl_s: TTL of leases and windows (``MOORLINE_LEASE_TTL``); the heartbeat
            renews them every third of it.
    """

    def __init__(self, store: RuntimeStore, runs: RunsRepo, *, lease_ttl_s: float) -> None:
        self._store = store
        self._windows = Windows(store, ttl_s=lease_ttl_s, timeout_s=STORE_CALL_TIMEOUT_S)
        self._runs = runs
        self._ttl_s = lease_ttl_s
        self._live: dict[tuple[RunId, Attempt], _Live] = {}
        self._failures = OutageLog(logger, "runtime store bookkeeping")

    async def enter(self, claim: Claim) -> None:
        """Take the conversation lease (if the run has a conversation), queue the window's open.

        Raises:
            ConversationBusy: Another run of the conversation holds the lease and is live.
        """
        live = self._live.setdefault(_key(claim), _Live(claim))
        key = lease_key(claim.run)
        try:
            if key is not None:
                await self._acquire(claim, key)
                live.holds_lease = True
        except BackendUnavailable as exc:
            logger.warning(
                "run %s: runtime store unreachable, no conversation lease or window: %r",
                claim.fence.run_id,
                exc,
                extra=_extra(claim),
            )
            return  # the heartbeat asks again
        except BaseException:
            await self.release(claim)
            raise
        self._begin_open(live)

    async def opened(self, claim: Claim) -> None:
        """Wait until the attempt's window is open, or could not be opened (that is logged).

        Raises:
            Exception: What the store raised other than :class:`BackendUnavailable` (as the
                attempt's start raised it when the open was awaited there).
        """
        live = self._live.get(_key(claim))
        opening = None if live is None else live.opening
        if opening is None:
            return
        if not opening.done():
            await asyncio.wait([opening])  # not cancelled with its waiter: others wait too
        if opening.cancelled():
            return
        error = opening.exception()
        if error is not None and not isinstance(error, BackendUnavailable):
            raise error

    async def leave(self, claim: Claim) -> None:
        """Close the interactive window: the workflow code has returned or raised."""
        live = self._live.get(_key(claim))
        if live is None:
            return
        live.executing = False
        if not live.window_open:
            return
        live.window_open = False
        if live.opening is not None and self._windows.withdraw(live.opening):
            return  # the store never saw the open: nothing to close
        await self._quietly(claim, self._windows.close(window_key(claim.run), claim.fence.run_id))

    async def release(self, claim: Claim) -> None:
        """The attempt is over: close its window and give its conversation lease up."""
        await self.leave(claim)
        live = self._live.pop(_key(claim), None)
        key = lease_key(claim.run)
        if live is not None and live.holds_lease and key is not None:
            await self._quietly(claim, self._store.release_lease(key, lease_holder(claim)))

    async def renew(self, claims: Sequence[Claim]) -> None:
        """Extend the leases and windows of these attempts (the worker's heartbeat)."""
        held = [live for claim in claims if (live := self._live.get(_key(claim))) is not None]
        await asyncio.gather(*(self._renew_one(live) for live in held))

    async def _renew_one(self, live: _Live) -> None:
        claim = live.claim
        key = lease_key(claim.run)
        if key is not None and not live.holds_lease:
            await self._retake_lease(live, key)
        elif key is not None:
            holder = lease_holder(claim)
            renewed = await self._quietly(claim, self._store.renew_lease(key, holder, self._ttl_s))
            if renewed is False:
                # Expired (a store restart, a long pause): take it again if nobody else has.
                taken = await self._quietly(
                    claim, self._store.acquire_lease(key, holder, self._ttl_s)
                )
                if taken is not None and not taken.acquired:
                    _tell_held(
                        live,
                        "run %s: conversation %r is now held by %s",
                        claim.fence.run_id,
                        claim.run.conversation_id,
                        taken.holder,
                    )
                elif taken is not None:
                    _tell_taken(live)
        if live.executing and not live.window_open and (key is None or live.holds_lease):
            # Its open failed, or was never asked for (the store was unreachable at the start).
            opening = self._begin_open(live)
            await asyncio.wait([opening])  # bounded by the windows' own timeout
            if live.window_open:
                logger.info(
                    "run %s: interactive window opened by the heartbeat",
                    claim.fence.run_id,
                    extra=_extra(claim),
                )
        # Not while an open is under way: it sets the TTL itself, and until it is sent it may
        # still be withdrawn, which a second open behind it would undo.
        elif live.window_open and live.opening is not None and live.opening.done():
            await self._quietly(
                claim, self._windows.open(window_key(claim.run), claim.fence.run_id)
            )

    def _begin_open(self, live: _Live) -> asyncio.Future[bool]:
        """Queue the opening of the attempt's window (its first, or a heartbeat's retake)."""
        claim = live.claim
        opening = self._windows.begin(window_key(claim.run), claim.fence.run_id)
        live.opening, live.window_open = opening, True
        opening.add_done_callback(functools.partial(_note_open, live))
        return opening

    async def _retake_lease(self, live: _Live, key: str) -> None:
        """Take the lease the attempt could not take at its start, while its code still runs.

        A stale holder is replaced as at the start; a live one of another run (stored
        behind admission's back, which refused this attempt at its start) keeps it, and this
        attempt goes on without lease or window.
        """
        claim = live.claim
        if not live.executing:
            return
        try:
            await self._acquire(claim, key)
        except BackendUnavailable:
            return  # still unreachable; already said at the start
        except ConversationBusy as busy:
            _tell_held(
                live,
                "run %s: no conversation lease or window, the conversation is held: %s",
                claim.fence.run_id,
                busy,
            )
            return
        live.holds_lease = True
        _tell_taken(live)
        if self._live.get(_key(claim)) is not live:
            # The attempt ended while the lease was being taken: give it back.
            live.holds_lease = False
            await self._quietly(claim, self._store.release_lease(key, lease_holder(claim)))

    async def _acquire(self, claim: Claim, key: str) -> None:
        mine = lease_holder(claim)
        acquired, holder = await bounded(self._store.acquire_lease(key, mine, self._ttl_s))
        if acquired:
            return
        if await self._is_stale(holder):
            # Compare-and-delete: only that holder's lease goes, never a newer one.
            await bounded(self._store.release_lease(key, holder))
            acquired, holder = await bounded(self._store.acquire_lease(key, mine, self._ttl_s))
            if acquired:
                return
        parsed = parse_holder(holder)
        conversation_id = claim.run.conversation_id or key
        raise ConversationBusy(conversation_id, parsed[0] if parsed is not None else holder)

    async def _is_stale(self, holder: str) -> bool:
        """Whether the database shows the holder's attempt over (its run ended or moved on)."""
        parsed = parse_holder(holder)
        if parsed is None:
            return False
        run_id, attempt = parsed
        run = await self._runs.get(run_id)
        return run is None or run.status is not RunStatus.RUNNING or run.attempt != attempt

    async def _quietly(self, claim: Claim, call: Awaitable[T]) -> T | None:
        """Await a bookkeeping call; log (and return None) if the store fails or hangs.

        Logged once per outage (:class:`~moorline.engine.outages.OutageLog`): while the store
        is down every heartbeat's calls fail, for every attempt.
        """
        try:
            result = await bounded(call)
        except BackendUnavailable as exc:
            self._failures.failed(
                "run %s: runtime store bookkeeping failed: %r",
                claim.fence.run_id,
                exc,
                extra=_extra(claim),
            )
            return None
        self._failures.answered()
        return result


def _note_open(live: _Live, opening: asyncio.Future[bool]) -> None:
    """The first open is done: a failed one leaves the window closed, and is logged."""
    if opening.cancelled() or (error := opening.exception()) is None:
        return
    live.window_open = False
    claim = live.claim
    logger.warning(
        "run %s: runtime store unreachable, no interactive window: %r",
        claim.fence.run_id,
        error,
        extra=_extra(claim),
    )


def _tell_held(live: _Live, message: str, *args: object) -> None:
    """Log that another run holds the attempt's conversation: a warning once, then debug."""
    level = logging.DEBUG if live.told_held else logging.WARNING
    live.told_held = True
    logger.log(level, message, *args, extra=_extra(live.claim))


def _tell_taken(live: _Live) -> None:
    """The heartbeat took the conversation lease after saying another run held it."""
    if live.told_held:
        live.told_held = False
        logger.info(
            "run %s: conversation lease taken by the heartbeat",
            live.claim.fence.run_id,
            extra=_extra(live.claim),
        )


def _key(claim: Claim) -> tuple[RunId, Attempt]:
    return claim.fence.run_id, claim.fence.attempt


def _extra(claim: Claim) -> dict[str, object]:
    return {
        "run_id": claim.fence.run_id,
        "attempt": claim.fence.attempt,
        "tenant_id": claim.run.tenant_id,
    }


async def bounded(call: Awaitable[T]) -> T:
    """Await an attempt's store call, bounded by ``STORE_CALL_TIMEOUT_S`` (see ``within``).

    Raises:
        BackendUnavailable: The call failed, or took longer.
    """
    return await within(call, STORE_CALL_TIMEOUT_S)
