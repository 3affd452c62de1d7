"""The one-process RuntimeStore: the embedded default, and a real backend of the contract suite.

Plain dictionaries on the event loop; no locks are needed because no method awaits between
reading and writing its state. TTLs are honoured with the monotonic clock: an expired entry is
invisible at once and removed by the next sweep (run from writes, at most once a second), so
nothing needs a background task. Waiters park on one :class:`asyncio.Event` each, registered per
run; every change to a run sets its waiters' events, and each waiter re-checks the state.

A published event batch is copied once (through JSON, as it would travel through Redis) and
shared by the run's subscribers (:class:`~moorline.runtime.fanout.LocalFanout`).
"""

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar, cast

from moorline.runtime.base import (
    CANCELLED_DECISION,
    DEFAULT_EVENT_QUEUE_SIZE,
    DEFAULT_MAX_MESSAGES,
    EventSubscription,
    InterruptState,
    InterruptStatus,
    LeaseAcquisition,
    QueuedMessage,
    RuntimeStore,
    StoreShutdown,
    WindowChange,
    decode_decision,
    encode_decision,
    queue_full,
)
from moorline.runtime.fanout import LocalFanout
from moorline.types import JSONObject, RunId

T = TypeVar("T")

SWEEP_INTERVAL_S = 1.0
"""Expired entries are removed by the first write after this many seconds."""

DEFAULT_RETENTION_S = 1800.0


def _now() -> float:
    return time.monotonic()


def _expiry(ttl_s: float) -> float:
    return _now() + ttl_s


@dataclass(slots=True)
class _Timed(Generic[T]):
    value: T
    expires_at: float

    @property
    def is_live(self) -> bool:
        return _now() < self.expires_at


@dataclass(slots=True)
class _Interrupt:
    expires_at: float
    decision: str | None = None
    """Canonical JSON of the winning decision; ``None`` while pending."""

    @property
    def is_live(self) -> bool:
        return _now() < self.expires_at


@dataclass(slots=True)
class _Run:
    interrupts: dict[str, _Interrupt] = field(default_factory=dict)
    cancelled_until: float | None = None
    messages: dict[int, str] = field(default_factory=dict)
    """Injected-message signals, seq → text."""
    messages_until: float = 0.0

    @property
    def is_cancelled(self) -> bool:
        return self.cancelled_until is not None and _now() < self.cancelled_until

    def live_interrupt(self, interrupt_id: str) -> _Interrupt | None:
        interrupt = self.interrupts.get(interrupt_id)
        return interrupt if interrupt is not None and interrupt.is_live else None

    def sweep(self) -> bool:
        """Drop what expired; True when nothing is left."""
        self.interrupts = {k: v for k, v in self.interrupts.items() if v.is_live}
        if not self.is_cancelled:
            self.cancelled_until = None
        if _now() >= self.messages_until:
            self.messages.clear()
        return not self.interrupts and self.cancelled_until is None and not self.messages


_Check = Callable[[], tuple[bool, T, float]]
"""A waiter's re-check: (done, value, monotonic time at which the state may change by itself)."""


class InMemoryRuntimeStore(RuntimeStore):
    """RuntimeStore for one process (see :class:`~moorline.runtime.base.RuntimeStore`).

    Args:
        retention_s: Lifetime of cancel flags and message queues (the execution timeout).
        event_queue_size: Events a live subscriber may fall behind by before it is cut off.
        max_messages: Injected-message signals a run may have queued.
    """

    def __init__(
        self,
        *,
        retention_s: float = DEFAULT_RETENTION_S,
        event_queue_size: int = DEFAULT_EVENT_QUEUE_SIZE,
        max_messages: int = DEFAULT_MAX_MESSAGES,
    ) -> None:
        self._retention_s = retention_s
        self._max_messages = max_messages
        self._leases: dict[str, _Timed[str]] = {}
        self._interactive: dict[str, _Timed[RunId]] = {}
        self._runs: dict[RunId, _Run] = {}
        self._waiters: dict[RunId, set[asyncio.Event]] = {}
        self._fanout = LocalFanout(max_queued=event_queue_size)
        self._is_shut_down = False
        self._next_sweep = _now() + SWEEP_INTERVAL_S

    # -- conversation lease ------------------------------------------------------------------

    async def acquire_lease(
        self, conversation_id: str, holder: str, ttl_s: float
    ) -> LeaseAcquisition:
        self._maybe_sweep()
        lease = self._leases.get(conversation_id)
        if lease is not None and lease.is_live and lease.value != holder:
            return LeaseAcquisition(False, lease.value)
        self._leases[conversation_id] = _Timed(holder, _expiry(ttl_s))
        return LeaseAcquisition(True, holder)

    async def renew_lease(self, conversation_id: str, holder: str, ttl_s: float) -> bool:
        lease = self._leases.get(conversation_id)
        if lease is None or not lease.is_live or lease.value != holder:
            return False
        lease.expires_at = _expiry(ttl_s)
        return True

    async def release_lease(self, conversation_id: str, holder: str) -> bool:
        lease = self._leases.get(conversation_id)
        if lease is None or not lease.is_live or lease.value != holder:
            return False
        del self._leases[conversation_id]
        return True

    async def get_lease_holder(self, conversation_id: str) -> str | None:
        lease = self._leases.get(conversation_id)
        return lease.value if lease is not None and lease.is_live else None

    # -- interactive window ------------------------------------------------------------------

    async def mark_interactive(self, conversation_id: str, run_id: RunId, ttl_s: float) -> None:
        self._maybe_sweep()
        self._interactive[conversation_id] = _Timed(run_id, _expiry(ttl_s))

    async def get_interactive_run(self, conversation_id: str) -> RunId | None:
        window = self._interactive.get(conversation_id)
        return window.value if window is not None and window.is_live else None

    async def is_interactive(self, conversation_id: str, run_id: RunId) -> bool:
        return await self.get_interactive_run(conversation_id) == run_id

    async def clear_interactive(self, conversation_id: str, run_id: RunId) -> bool:
        if await self.get_interactive_run(conversation_id) != run_id:
            return False
        del self._interactive[conversation_id]
        return True

    async def change_windows(self, changes: Sequence[WindowChange], ttl_s: float) -> list[bool]:
        done = []
        for key, run_id, opens in changes:
            if opens:
                await self.mark_interactive(key, run_id, ttl_s)
            done.append(opens or await self.clear_interactive(key, run_id))
        return done

    # -- interrupts --------------------------------------------------------------------------

    async def open_interrupt(self, run_id: RunId, interrupt_id: str, ttl_s: float) -> None:
        self._maybe_sweep()
        run = self._runs.setdefault(run_id, _Run())
        interrupt = run.live_interrupt(interrupt_id)
        if interrupt is None:
            run.interrupts[interrupt_id] = _Interrupt(_expiry(ttl_s))
        else:
            interrupt.expires_at = _expiry(ttl_s)
        self._wake(run_id)

    async def resolve_interrupt(
        self, run_id: RunId, interrupt_id: str, decision: JSONObject
    ) -> bool:
        return self._resolve(run_id, interrupt_id, encode_decision(decision)) is not None

    def _resolve(self, run_id: RunId, interrupt_id: str, encoded: str) -> str | None:
        """Record ``encoded`` unless another decision won; return the winner (None: unknown)."""
        run = self._runs.get(run_id)
        interrupt = run.live_interrupt(interrupt_id) if run is not None else None
        if interrupt is None:
            return None
        if interrupt.decision is None:
            interrupt.decision = encoded
            self._wake(run_id)
            return encoded
        return interrupt.decision if interrupt.decision == encoded else None

    async def get_interrupt(self, run_id: RunId, interrupt_id: str) -> InterruptState | None:
        run = self._runs.get(run_id)
        interrupt = run.live_interrupt(interrupt_id) if run is not None else None
        if interrupt is None:
            return None
        if interrupt.decision is None:
            return InterruptState(status=InterruptStatus.PENDING, decision=None)
        return InterruptState(
            status=InterruptStatus.RESOLVED, decision=decode_decision(interrupt.decision)
        )

    async def wait_interrupt(
        self, run_id: RunId, interrupt_id: str, timeout_s: float
    ) -> JSONObject | None:
        def check() -> tuple[bool, JSONObject | None, float]:
            run = self._runs.get(run_id)
            interrupt = run.live_interrupt(interrupt_id) if run is not None else None
            if run is None or interrupt is None:
                return True, None, math.inf
            if interrupt.decision is None and run.is_cancelled:
                interrupt.decision = encode_decision(CANCELLED_DECISION)
            if interrupt.decision is not None:
                return True, decode_decision(interrupt.decision), math.inf
            return False, None, interrupt.expires_at

        return await self._wait(run_id, check, timeout_s, None)

    # -- cancellation ------------------------------------------------------------------------

    async def request_cancel(self, run_id: RunId) -> None:
        self._maybe_sweep()
        self._runs.setdefault(run_id, _Run()).cancelled_until = _expiry(self._retention_s)
        self._wake(run_id)

    async def is_cancelled(self, run_id: RunId) -> bool:
        run = self._runs.get(run_id)
        return run is not None and run.is_cancelled

    async def wait_cancelled(self, run_id: RunId, timeout_s: float) -> bool:
        def check() -> tuple[bool, bool, float]:
            run = self._runs.get(run_id)
            cancelled = run is not None and run.is_cancelled
            return cancelled, cancelled, math.inf

        return await self._wait(run_id, check, timeout_s, False)

    # -- injected messages -------------------------------------------------------------------

    async def push_message(self, run_id: RunId, seq: int, text: str) -> None:
        self._maybe_sweep()
        run = self._runs.setdefault(run_id, _Run())
        if _now() >= run.messages_until:
            run.messages.clear()
        if seq in run.messages:
            return
        if len(run.messages) >= self._max_messages:
            raise queue_full(run_id, self._max_messages)
        run.messages[seq] = text
        run.messages_until = _expiry(self._retention_s)

    async def drain_messages(self, run_id: RunId) -> list[QueuedMessage]:
        run = self._runs.get(run_id)
        if run is None or _now() >= run.messages_until:
            return []
        drained = sorted(QueuedMessage(seq, text) for seq, text in run.messages.items())
        run.messages.clear()
        return drained

    # -- live events -------------------------------------------------------------------------

    async def publish_events(self, run_id: RunId, events: Sequence[JSONObject]) -> None:
        if events and self._fanout.has_subscribers(run_id):
            # One copy per batch, shared by this run's subscribers, as from Redis.
            copied = cast(list[JSONObject], json.loads(json.dumps(list(events))))
            self._fanout.deliver(run_id, copied)

    async def subscribe_events(self, run_id: RunId) -> EventSubscription:
        if self._is_shut_down:
            ended = EventSubscription()
            ended.end()
            return ended
        return self._fanout.subscribe(run_id)

    # -- lifecycle ---------------------------------------------------------------------------

    async def cleanup_run(self, run_id: RunId) -> None:
        self._runs.pop(run_id, None)
        self._wake(run_id)

    async def check_available(self, timeout_s: float) -> None:
        return  # the store is this process's memory: it answers whenever the process does

    async def shutdown(self) -> None:
        self._is_shut_down = True
        for waiters in self._waiters.values():
            for wake in waiters:
                wake.set()
        self._fanout.end_all()

    async def close(self) -> None:
        await self.shutdown()
        self._leases.clear()
        self._interactive.clear()
        self._runs.clear()

    # -- internals ---------------------------------------------------------------------------

    async def _wait(self, run_id: RunId, check: _Check[T], timeout_s: float, default: T) -> T:
        """Re-check after every change of the run until done, the deadline or shutdown."""
        deadline = _now() + timeout_s
        wake = asyncio.Event()
        self._waiters.setdefault(run_id, set()).add(wake)
        try:
            while True:
                if self._is_shut_down:
                    raise StoreShutdown("the runtime store is shutting down")
                done, value, changes_at = check()
                if done:
                    return value
                now = _now()
                if now >= deadline:
                    return default
                wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(deadline, changes_at) - now):
                        await wake.wait()
        finally:
            waiters = self._waiters.get(run_id)
            if waiters is not None:
                waiters.discard(wake)
                if not waiters:
                    del self._waiters[run_id]

    def _wake(self, run_id: RunId) -> None:
        for wake in self._waiters.get(run_id, ()):
            wake.set()

    def _maybe_sweep(self) -> None:
        now = _now()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_INTERVAL_S
        self._leases = {k: v for k, v in self._leases.items() if v.is_live}
        self._interactive = {k: v for k, v in self._interactive.items() if v.is_live}
        self._runs = {k: v for k, v in self._runs.items() if not v.sweep()}
