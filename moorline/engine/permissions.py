"""Permissions: ``ctx.request_permission``, a durable question to a person.

The interrupt is persisted (fenced, keyed by the request's position in the run) before the
wait, so a replayed run finds the same interrupt and the same decision. The wait is first in
memory, on the RuntimeStore's wake-up with a database re-read every poll slice, for
``park_after`` seconds; then the run parks (:mod:`moorline.engine.waits`) until the decision
or the deadline re-queues it. Whatever ends the wait is persisted, first writer wins: a
decision, ``timeout``, ``cancelled`` (the run was cancelled) or ``shutdown`` (the store is
shutting down).

``Permissions`` is a base class of :class:`~moorline.engine.context.Context`, one concept of it
kept in its own module.
"""

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from moorline.db.repos.interrupts import InterruptResolved, InterruptsRepo
from moorline.db.repos.parking import Wait, WaitKind
from moorline.db.repos.records import DecisionReason, Fence, Interrupt
from moorline.engine.events import EventWriter
from moorline.engine.progress import permission_request, permission_resolved
from moorline.engine.steps import to_json
from moorline.runtime.base import CANCELLED_DECISION, RuntimeStore, StoreShutdown
from moorline.types import JSONObject, JSONValue, RunId

T = TypeVar("T")

DEFAULT_INTERRUPT_POLL_S = 3.0
"""How often a permission wait re-reads its interrupt from the database, in seconds: a
wake-up lost by the RuntimeStore then costs this much latency, never the decision."""

STORE_INTERRUPT_MARGIN_S = 60.0
"""Extra seconds an interrupt stays in the RuntimeStore past its deadline."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """The answer to ``ctx.request_permission``.

    Attributes:
        approved: Whether the action may go ahead.
        reason: ``approved``, ``denied``, ``timeout``, ``cancelled`` or ``shutdown``.
        data: What the approver sent with the decision, if anything.
    """

    approved: bool
    reason: str
    data: JSONObject | None


def _decision_of(interrupt: Interrupt) -> Decision:
    reason = interrupt.reason or (
        DecisionReason.APPROVED if interrupt.approved else DecisionReason.DENIED
    )
    return Decision(approved=interrupt.approved, reason=reason.value, data=interrupt.decision)


class Permissions:
    """Permission requests of one attempt (a base of ``Context``)."""

    # Set by Context.__init__.
    _fence: Fence
    _events: EventWriter
    _interrupts: InterruptsRepo
    _store: RuntimeStore
    _permission_timeout_s: float
    _interrupt_poll_s: float
    _park_after_s: float
    _permissions: int
    _is_cancelled: bool
    _cancel_delivered: bool

    @property
    def run_id(self) -> RunId:
        return self._fence.run_id

    if TYPE_CHECKING:
        # Provided by the class these are mixed into; declared for the type checker only,
        # so no stub here can shadow the real method in the MRO.
        async def _fenced(self, write: Coroutine[Any, Any, T]) -> T:
            raise NotImplementedError

        async def _check_boundary(self) -> None:
            raise NotImplementedError

        def _check_lease(self) -> None:
            raise NotImplementedError

        async def _park(self, wait: Wait) -> None:
            raise NotImplementedError

    async def request_permission(
        self,
        action: str,
        data: JSONValue,
        timeout: float | None = None,  # noqa: ASYNC109 - docs/design.md's contract
        *,
        park_after: float | None = None,
    ) -> Decision:
        """Pause until a person approves or denies ``action``, or the wait ends otherwise.

        The interrupt is persisted before the wait, keyed by the position of this request
        among the run's permission requests, so a replayed run finds the same interrupt and
        the same decision. The wait always ends: a decision, ``timeout`` (at the deadline),
        ``cancelled`` (the run was cancelled) or ``shutdown`` (the runtime store is shutting
        down); every outcome is persisted and only the first one counts.

        Args:
            action: What permission is asked for, shown to the approver.
            data: Details for the approver (JSON).
            timeout: Seconds to wait; ``MOORLINE_PERMISSION_TIMEOUT`` when None.
            park_after: Seconds to wait in memory before the run parks (``waiting``, holding
                no slot); ``MOORLINE_PARK_AFTER`` when None, 0 parks at once. The replay
                after the decision returns it at this same call.

        Raises:
            RunParked: The run parked; let it through (the attempt ends here).
            Cancelled: The run was cancelled before the request; nothing was written.
            LeaseLost: This attempt no longer holds the run; nothing was written.
            InterruptMismatch: A replay asked a different action at this position.
        """
        timeout_s = self._permission_timeout_s if timeout is None else timeout
        if timeout_s <= 0:
            raise ValueError(f"permission {action!r}: timeout must be positive")
        park_after_s = self._park_after_s if park_after is None else park_after
        if park_after_s < 0:
            raise ValueError(f"permission {action!r}: park_after must not be negative")
        payload = to_json(data, f"the data of permission {action!r}")
        await self._check_boundary()
        self._permissions += 1
        key = f"permission:{self._permissions}"
        interrupt = await self._fenced(
            self._interrupts.open(self._fence, key, action, payload, timeout_s)
        )
        if not interrupt.is_pending:
            return _decision_of(interrupt)
        await self._fenced(self._events.write(*permission_request(interrupt)))
        left_s = (interrupt.expires_at - datetime.now(UTC)).total_seconds()
        remaining_s = max(0.0, min(timeout_s, left_s))
        decision = None
        if remaining_s > park_after_s:
            decision = await self._await_decision(interrupt, park_after_s, final=False)
            if decision is None:
                wait = Wait(
                    kind=WaitKind.PERMISSION,
                    until=interrupt.expires_at,
                    interrupt_id=interrupt.interrupt_id,
                )
                await self._park(wait)
                # Not parked: the decision is recorded, or the deadline passed.
                remaining_s = max(0.0, (interrupt.expires_at - datetime.now(UTC)).total_seconds())
        if decision is None:
            decision = await self._await_decision(interrupt, remaining_s, final=True)
        resolved = permission_resolved(
            interrupt, approved=decision.approved, reason=decision.reason, data=decision.data
        )
        await self._events.add(*resolved)  # progress: the resume does not wait for its write
        return decision

    @overload
    async def _await_decision(
        self, interrupt: Interrupt, remaining_s: float, *, final: Literal[True]
    ) -> Decision: ...

    @overload
    async def _await_decision(
        self, interrupt: Interrupt, remaining_s: float, *, final: bool
    ) -> Decision | None: ...

    async def _await_decision(
        self, interrupt: Interrupt, remaining_s: float, *, final: bool
    ) -> Decision | None:
        """The decision within ``remaining_s``; then a timeout if ``final``, else None."""
        store, iid = self._store, interrupt.interrupt_id
        loop = asyncio.get_running_loop()
        deadline = loop.time() + remaining_s
        try:
            await store.open_interrupt(self.run_id, iid, remaining_s + STORE_INTERRUPT_MARGIN_S)
            # Read once the store has the interrupt, so a decision signalled before is seen.
            found = await self._interrupts.get(iid)
            while found is None or found.is_pending:
                left_s = deadline - loop.time()
                if left_s <= 0:
                    if not final:
                        return None
                    return await self._settle(interrupt, DecisionReason.TIMEOUT)
                slice_s = min(left_s, self._interrupt_poll_s)
                woke = await store.wait_interrupt(self.run_id, iid, slice_s)
                if woke == CANCELLED_DECISION:
                    self._is_cancelled = self._cancel_delivered = True
                    return await self._settle(interrupt, DecisionReason.CANCELLED)
                if woke is None:
                    # A poll slice ended, or the store forgot the interrupt: keep it open there
                    # (idempotent) and read the database again.
                    await store.open_interrupt(
                        self.run_id,
                        iid,
                        max(0.0, deadline - loop.time()) + STORE_INTERRUPT_MARGIN_S,
                    )
                found = await self._interrupts.get(iid)
                if woke is not None and (found is None or found.is_pending):
                    # The store has a decision the database does not show yet: the approver
                    # commits there first, so give its commit a poll slice to become visible.
                    if await store.wait_cancelled(self.run_id, slice_s):
                        self._is_cancelled = self._cancel_delivered = True
                        return await self._settle(interrupt, DecisionReason.CANCELLED)
            return _decision_of(found)
        except StoreShutdown:
            return await self._settle(interrupt, DecisionReason.SHUTDOWN)

    async def _settle(self, interrupt: Interrupt, reason: DecisionReason) -> Decision:
        """Deny the interrupt for ``reason`` in the database, unless a decision came first."""
        self._check_lease()
        try:
            resolved = await self._interrupts.resolve(
                self.run_id, interrupt.interrupt_id, approved=False, reason=reason, data=None
            )
        except InterruptResolved:
            found = await self._interrupts.get(interrupt.interrupt_id)
            if found is None:  # pragma: no cover - interrupts are never deleted while running
                raise
            resolved = found
        return _decision_of(resolved)
