"""Durable waits: ``ctx.sleep``, ``ctx.sleep_until``, ``ctx.wait_for_message``, and parking.

A wait shorter than ``park_after`` is awaited in memory. A longer one *parks* the run
(:meth:`~moorline.db.repos.parking.ParkingRepo.park`): the run becomes ``waiting`` and holds
no lease, no worker slot and no unit of its tenant's cap, and the attempt ends with
:class:`~moorline.errors.RunParked`. What ends the wait re-queues the run (a decision or a
message in its own transaction, a due timer through the timer sweep); the next attempt replays
the workflow from its checkpoints to the same wait, which then returns.

A model call that would wait longer than ``park_after`` for provider capacity parks the same
way (:meth:`Waits.park_for_capacity`, kind ``capacity``, until the limiter's answer); the next
attempt replays to the call, which asks the limiter again.

Each wait is a checkpoint, so a replay takes the path the first attempt took:

* a timer records its end the first time (step ``moorline.sleep:<n>``, or
  ``moorline.wait:<n>`` for a message wait's timeout): a replayed sleep that is already due
  returns at once, and its end never moves;
* a message wait ends with a drain of at most one message (``moorline.drain:<k>``, shared
  with ``drain_messages``), recorded also when it found none (the timeout): a replay
  returns what the first attempt returned, ``None`` included.

``Waits`` is a base class of :class:`~moorline.engine.context.Context`, one concept of it
kept in its own module; it uses the context's fenced writes and cancel checks.
"""

import asyncio
import math
from collections.abc import Coroutine
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from moorline.db.repos.messages import MessagesRepo
from moorline.db.repos.parking import ParkingRepo, Wait, WaitKind
from moorline.db.repos.records import Fence, Run
from moorline.engine.checkpoints import Checkpoints
from moorline.engine.steps import call_hash
from moorline.errors import RunParked

T = TypeVar("T")

SLEEP_STEP_PREFIX = "moorline.sleep:"
"""Step key of a run's n-th sleep: ``moorline.sleep:<n>`` (persisted; contract)."""

MESSAGE_WAIT_STEP_PREFIX = "moorline.wait:"
"""Step key of the timeout of a run's n-th message wait (persisted; contract)."""

TIMER_FUNCTION = "moorline.timer"
"""The ``function`` recorded on timer steps."""

MESSAGE_POLL_S = 0.05
"""How often an in-memory message wait reads whether a message arrived, in seconds."""


def _now() -> datetime:
    return datetime.now(UTC)


class Waits:
    """Sleeps and message waits of one attempt; parking for every kind of wait."""

    # Set by Context.__init__.
    _fence: Fence
    _run: Run
    _checkpoints: Checkpoints
    _messages: MessagesRepo
    _parking: ParkingRepo
    _park_after_s: float
    _deadline_s: float | None
    _timers: int
    _message_waits: int
    _drains: int
    _parked: RunParked | None
    _emit_calls: int

    if TYPE_CHECKING:
        # Provided by the class these are mixed into; declared for the type checker only,
        # so no stub here can shadow the real method in the MRO.
        async def _fenced(self, write: Coroutine[Any, Any, T]) -> T:
            raise NotImplementedError

        async def _check_boundary(self) -> None:
            raise NotImplementedError

        async def _pause(self, delay_s: float) -> None:
            raise NotImplementedError

        async def _drain(self, limit: int | None) -> list[str]:
            raise NotImplementedError

        async def flush_saved(self) -> None:
            raise NotImplementedError

    # --- sleeping ----------------------------------------------------------------------------

    async def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, durably: a sleep of ``park_after`` or longer parks the run.

        The end is recorded at the first call; a replay of the run (after a park or a crash)
        sleeps only what is left of it, and returns at once when it is due.

        Raises:
            ValueError: ``seconds`` is negative or not finite.
            Cancelled: The run was cancelled before or during the sleep.
            RunParked: The run parked; let it through.
        """
        if not (0 <= seconds < math.inf):
            raise ValueError(f"ctx.sleep: seconds must be a finite number >= 0, not {seconds!r}")
        await self.sleep_until(_now() + timedelta(seconds=seconds))

    async def sleep_until(self, when: datetime) -> None:
        """Sleep until ``when`` (an aware datetime), durably; see :meth:`sleep`.

        Raises:
            ValueError: ``when`` is naive.
            Cancelled: The run was cancelled before or during the sleep.
            RunParked: The run parked; let it through.
        """
        if when.tzinfo is None:
            raise ValueError("ctx.sleep_until: give an aware datetime (e.g. with tzinfo=UTC)")
        await self._check_boundary()
        self._timers += 1
        until = await self._timer(f"{SLEEP_STEP_PREFIX}{self._timers}", when)
        left_s = (until - _now()).total_seconds()
        if left_s <= 0:
            return
        if left_s >= self._park_after_s:
            await self._park(Wait(kind=WaitKind.SLEEP, until=until))
            left_s = (until - _now()).total_seconds()  # not parked: it is due by database time
        if left_s > 0:
            await self._pause(left_s)

    # --- messages ----------------------------------------------------------------------------

    async def wait_for_message(
        self,
        timeout: float | None = None,  # noqa: ASYNC109 - the documented contract
    ) -> str | None:
        """The next message posted to the run, waiting for it durably; None on timeout.

        Messages come exactly once and in order, shared with :meth:`drain_messages`. While
        the run waits longer than ``park_after`` it parks; ``POST /v1/runs/{id}/messages``
        re-queues it.

        Args:
            timeout: Seconds to wait; None waits for as long as it takes (the run's deadline,
                if it has one, still ends it).

        Raises:
            ValueError: ``timeout`` is negative or not finite.
            Cancelled: The run was cancelled; the messages stay queued.
            RunParked: The run parked; let it through.
        """
        if timeout is not None and not (0 <= timeout < math.inf):
            raise ValueError(f"ctx.wait_for_message: bad timeout {timeout!r}")
        await self._check_boundary()
        self._message_waits += 1
        until = None
        if timeout is not None:
            key = f"{MESSAGE_WAIT_STEP_PREFIX}{self._message_waits}"
            until = await self._timer(key, _now() + timedelta(seconds=timeout))
        if await self._checkpoints.was_recorded(f"moorline.drain:{self._drains + 1}"):
            return await self._take_message()  # a replay: what the first attempt got
        parked_once = False
        while True:
            if await self._messages.has_waiting(self._fence.run_id):
                return await self._take_message()
            left_s = math.inf if until is None else (until - _now()).total_seconds()
            if left_s <= 0:
                return await self._take_message()  # None, or one that came just in time
            if parked_once:
                # The park found a message or a due timer by database time; look again soon.
                await self._pause(min(left_s, MESSAGE_POLL_S))
                continue
            if await self._poll_messages(min(left_s, self._park_after_s)):
                continue
            parked_once = True
            await self._park(Wait(kind=WaitKind.MESSAGE, until=until))

    async def _poll_messages(self, window_s: float) -> bool:
        """Read for a waiting message every :data:`MESSAGE_POLL_S` for ``window_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + window_s
        while (left_s := deadline - loop.time()) > 0:
            await self._pause(min(left_s, MESSAGE_POLL_S))
            if await self._messages.has_waiting(self._fence.run_id):
                return True
        return False

    async def _take_message(self) -> str | None:
        taken = await self._drain(1)
        return taken[0] if taken else None

    # --- provider capacity ---------------------------------------------------------------

    @property
    def park_after_s(self) -> float:
        """Seconds a wait is awaited in memory before the run parks (``park_after``)."""
        return self._park_after_s

    async def park_for_capacity(self, model: str, wait_s: float) -> None:
        """Park the run for ``wait_s`` seconds of no capacity for ``model``.

        Called by the model-call hook (:mod:`moorline.llm.governance`), not by workflows.
        Nothing is recorded for the wait: the replay makes the call again, and the limiter
        answers afresh.

        Raises:
            RunParked: The run is ``waiting`` (kind ``capacity``) until then.
        """
        await self._check_boundary()
        until = _now() + timedelta(seconds=wait_s)
        await self._park(Wait(kind=WaitKind.CAPACITY, until=until, model=model))

    # --- shared ------------------------------------------------------------------------------

    async def _timer(self, key: str, due: datetime) -> datetime:
        """The end of the timer ``key``: ``due`` at its first call, as recorded on a replay."""
        digest = call_hash(TIMER_FUNCTION, (), {})
        start = await self._fenced(self._checkpoints.start(key, TIMER_FUNCTION, digest))
        if start.replay:
            recorded: Any = start.output
            return datetime.fromisoformat(recorded["until"])
        await self._fenced(self._checkpoints.succeed(key, {"until": due.isoformat()}))
        return due

    async def _park(self, wait: Wait) -> None:
        """Park the run for ``wait`` and stop the attempt; return if what it waits for is here.

        Raises:
            RunParked: The run is ``waiting`` now; the attempt ends.
        """
        # Nothing may be written once the run is parked (the lease goes with it): what this
        # attempt's replays saved is written first.
        await self.flush_saved()
        deadline_at = None
        if self._deadline_s is not None:
            deadline_at = self._run.created_at + timedelta(seconds=self._deadline_s)
        parking = self._parking.park(
            self._fence, wait, deadline_at=deadline_at, emits=self._emit_calls
        )
        if await self._fenced(parking):
            self._parked = RunParked(self._fence, wait.kind.value)
            raise self._parked
