"""``Context``: what a workflow knows about the run it executes, and how it acts on it.

Every write a ``Context`` makes (step checkpoints, events, interrupts) carries the claim's
fence. When one finds the lease gone it raises
:class:`~moorline.errors.LeaseLost` (a ``BaseException``, so ``except Exception`` lets it
through); the context remembers it and raises it again from
every later call, and the runner raises it even if the workflow swallowed it, so the worker
stops the attempt and writes nothing more (invariant 2).

A cancel is learnt three ways: the store's flag, asked at every check; the runner, which
watches the store's signal and the worker's heartbeat (the database's record of the request)
and marks the context; and the database itself, whose step and interrupt starts refuse a run
with a recorded cancel. :class:`Cancelled` is then raised at the top of every step that runs
(a replayed one returns its recorded output without asking), at a message drain, at a
permission request and during a step's retry pauses; a permission wait in progress ends with
the decision ``cancelled``. Like ``asyncio.CancelledError`` it is a
``BaseException``, so ``except Exception`` cannot swallow it.

Events go through the attempt's :class:`~moorline.engine.events.EventWriter`: ``delta`` events
are buffered and written in batches, every other event at once, and every fenced write (step
checkpoints, interrupts, message drains) first writes what is buffered, so the record keeps
the order the workflow acted in. Injected messages are drained from the database as fenced
checkpoints (:meth:`~moorline.db.repos.messages.MessagesRepo.drain`): the n-th drain of a
replayed attempt returns what the n-th drain returned before.
"""

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from moorline.db.repos.children import ChildrenRepo
from moorline.db.repos.events import (
    EVENT_CANCELLED,
    EVENT_FAILED,
    EVENT_MESSAGE_RECEIVED,
    EVENT_QUEUED,
    EVENT_RECLAIMED,
    EVENT_RELEASED,
    EVENT_RESUMED,
    EVENT_RETRYING,
    EVENT_STARTED,
    EVENT_SUCCEEDED,
    EVENT_TIMED_OUT,
    EVENT_WAITING,
)
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.messages import MessagesRepo
from moorline.db.repos.parking import ParkingRepo
from moorline.db.repos.queue import Claim
from moorline.db.repos.records import Fence
from moorline.db.repos.steps import StepsRepo
from moorline.db.repos.usage import UsageRepo
from moorline.engine.checkpoints import Checkpoints, DeferredStart, Started
from moorline.engine.children import DEFAULT_MAX_CHILDREN, ChildEnds, Children
from moorline.engine.conversations import bounded
from moorline.engine.events import (
    BUFFERED_EVENT_TYPES,
    EVENT_PERMISSION_REQUEST,
    EVENT_PERMISSION_RESOLVED,
    EVENT_STEP_FINISHED,
    EVENT_STEP_STARTED,
    EventWriter,
)
from moorline.engine.metering import CURRENT_STEP, Metering
from moorline.engine.metering import NotInStep as NotInStep  # re-exported (old home)
from moorline.engine.permissions import DEFAULT_INTERRUPT_POLL_S, Permissions
from moorline.engine.progress import StepProgress
from moorline.engine.registry import Moorline
from moorline.engine.steps import (
    backoff_delay_s,
    call_hash,
    call_step_function,
    check_retry_policy,
    function_name,
    to_json,
)
from moorline.engine.streaming import StepStream
from moorline.engine.waits import Waits
from moorline.errors import (
    AttemptStopped,
    BackendUnavailable,
    CancelRequested,
    LeaseLost,
    RunParked,
)
from moorline.llm.models import ModelsProvider
from moorline.llm.usage import metering
from moorline.observability import tracing
from moorline.runtime.base import RuntimeStore, StoreShutdown
from moorline.types import Attempt, JSONObject, JSONValue, RunId, TenantId

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_STEP_BACKOFF_S = 1.0
"""Pause after a step's first failed try, in seconds; doubled after each further one."""

DEFAULT_PARK_AFTER_S = 2.0
"""Seconds a wait is awaited in memory before the run parks (``MOORLINE_PARK_AFTER``)."""

SYSTEM_EVENT_TYPES = frozenset(
    {
        EVENT_QUEUED,
        EVENT_STARTED,
        EVENT_RETRYING,
        EVENT_RECLAIMED,
        EVENT_SUCCEEDED,
        EVENT_FAILED,
        EVENT_CANCELLED,
        EVENT_RELEASED,
        EVENT_TIMED_OUT,
        EVENT_MESSAGE_RECEIVED,
        EVENT_WAITING,
        EVENT_RESUMED,
        EVENT_STEP_STARTED,
        EVENT_STEP_FINISHED,
        EVENT_PERMISSION_REQUEST,
        EVENT_PERMISSION_RESOLVED,
    }
)
"""Event types Moorline writes for run transitions; ``ctx.emit`` may not use them."""


class Cancelled(BaseException):
    """The run was cancelled: raised at the next step, message drain or permission request.

    A ``BaseException``, like ``asyncio.CancelledError``, so ``except Exception`` in workflow
    code cannot swallow it. Catch it only to clean up, then re-raise.
    """

    code = "cancelled"

    def __init__(self, run_id: RunId) -> None:
        super().__init__(f"run {run_id} was cancelled")
        self.run_id = run_id


class Context(Permissions, Waits, Children, Metering):
    """The first argument of every workflow: the run being executed, attempt by attempt.

    Built by the runner for one claim; workflows never construct it.
    """

    def __init__(
        self,
        claim: Claim,
        *,
        steps: StepsRepo,
        events: EventWriter,
        interrupts: InterruptsRepo,
        messages: MessagesRepo,
        parking: ParkingRepo,
        store: RuntimeStore,
        children: ChildrenRepo | None = None,
        workflows: Moorline | None = None,
        max_children: int = DEFAULT_MAX_CHILDREN,
        permission_timeout_s: float,
        park_after_s: float = DEFAULT_PARK_AFTER_S,
        step_start_after_s: float = 0.0,
        lease_held: Callable[[], bool] | None = None,
        deadline_s: float | None = None,
        interrupt_poll_s: float = DEFAULT_INTERRUPT_POLL_S,
        models: ModelsProvider | None = None,
        usage: UsageRepo | None = None,
        on_enqueued: Callable[[set[str]], object] | None = None,
        child_ends: ChildEnds | None = None,
    ) -> None:
        self._fence: Fence = claim.fence
        self._run = claim.run
        self._checkpoints = Checkpoints(claim.fence, steps)
        self._events = events
        self._interrupts = interrupts
        self._messages = messages
        self._store = store
        self._permission_timeout_s = permission_timeout_s
        self._interrupt_poll_s = interrupt_poll_s
        self._parking = parking
        self._children = children
        self._workflows = workflows
        self._max_children = max_children
        self._on_enqueued = on_enqueued
        self._child_ends = child_ends
        self._park_after_s = park_after_s
        self._step_start_after_s = step_start_after_s
        self._lease_held = lease_held
        """The worker's own clock's word on the lease (its self-fence): the only check a new
        step's function gets before it is called when its start is deferred."""
        self._deadline_s = deadline_s
        self._permissions = 0
        self._drains = 0
        self._timers = 0
        self._message_waits = 0
        self._parked: RunParked | None = None
        self._emit_calls = 0
        """``ctx.emit`` calls outside steps so far, the skipped ones included."""
        self._skip_emits = claim.run.emits
        """Calls the run made before it last parked: recorded already, so not written again."""
        self._models = models
        self._usage = usage
        self._saved = {}
        """What this attempt's replayed steps saved, not yet written (see :meth:`flush_saved`)."""
        self._lost: LeaseLost | None = None
        self._is_cancelled = False
        self._cancel_delivered = False
        """The workflow code was told (a check raised Cancelled, a wait returned a cancelled
        decision, it read ``cancelled``): only then does a cancel outrank its return value."""

    @property
    def run_id(self) -> RunId:
        """The run's id, the same on every attempt."""
        return self._fence.run_id

    @property
    def attempt(self) -> Attempt:
        """This attempt's number (1 for the first claim); the run's fencing token."""
        return self._fence.attempt

    @property
    def tenant_id(self) -> TenantId:
        """The tenant that owns the run."""
        return self._run.tenant_id

    @property
    def conversation_id(self) -> str | None:
        """The conversation the run belongs to, if any."""
        return self._run.conversation_id

    @property
    def cancelled(self) -> bool:
        """Whether the run's cancellation was seen.

        The RuntimeStore is asked at every step boundary, wait, ``emit`` and
        ``drain_messages``, and the runner sets it as soon as the store's signal or the
        worker's heartbeat reports the cancel; this property reports the latest answer
        without a round trip. A True answer tells the workflow: after that, returning does
        not save the run from its cancel.
        """
        if self._is_cancelled:
            self._cancel_delivered = True
        return self._is_cancelled

    # --- steps -------------------------------------------------------------------------------

    async def step(
        self,
        key: str,
        fn: Callable[..., Any],
        *args: Any,
        retries: int = 0,
        backoff: float = DEFAULT_STEP_BACKOFF_S,
        **kwargs: Any,
    ) -> JSONValue:
        """Run ``fn(*args, **kwargs)`` once per run, checkpointed under ``key``.

        When step ``key`` already succeeded in this run its stored result is returned and
        ``fn`` is not called. A sync ``fn`` runs in a thread; an async one is awaited. A
        generator function (sync or async) streams each item it yields as a ``delta`` event
        and its items, joined, are the result (:mod:`moorline.engine.streaming`).

        Args:
            key: The step's key, unique within the run (``f"llm:{i}"`` in loops).
            fn: The function; its result must be JSON-serialisable.
            *args: Positional arguments of ``fn`` (JSON-serialisable).
            retries: Further tries after a failed one, within this attempt.
            backoff: Seconds before the first retry, doubled for each further one.
            **kwargs: Keyword arguments of ``fn`` (JSON-serialisable).

        Returns:
            ``fn``'s result as stored (JSON: tuples come back as lists).

        Raises:
            Cancelled: The run was cancelled before the step started (a step replayed from its
                checkpoint returns without checking: it runs nothing).
            StepMismatch: ``key`` already succeeded for a different call (the workflow's
                code changed between attempts); fails the run.
            TypeError: The arguments or the result are not JSON-serialisable.
            LeaseLost: This attempt no longer holds the run.
        """
        check_retry_policy(key, retries, backoff)
        function = function_name(fn)
        digest = call_hash(function, args, kwargs)
        # A replayed step runs and writes nothing, so it skips the cancel check's store round
        # trip (one per step made a 200-step replay over Redis several times slower); a cancel
        # is raised at the first step that runs, or the next wait, instead.
        self._check_lease()
        replayed = await self._checkpoints.replayed(key, function, digest)
        if replayed is not None:
            self._note_saved(replayed.usage)
            return replayed.output
        failures = 0
        while True:
            await self._check_boundary()
            await self.flush_saved()
            defer = self._defers_start()
            start = await self._fenced(self._checkpoints.start(key, function, digest, defer=defer))
            if start.replay:
                self._note_saved(start.usage)
                return start.output
            token = CURRENT_STEP.set((self.run_id, key))
            progress = StepProgress(self._events, key, failures + 1)
            await progress.started()
            deferred = self._deferred(start, key, function, digest)
            failed: BaseException | None = None
            with metering() as calls:
                try:
                    with tracing.step_span(
                        key=key, function=function, run_id=self.run_id, attempt=failures + 1
                    ):
                        result = await call_step_function(
                            fn, args, kwargs, lambda: self._step_stream(key)
                        )
                    output = to_json(result, f"the result of step {key!r}")
                except (Exception, AttemptStopped) as exc:
                    failed = exc
                except BaseException:
                    if deferred is not None:
                        deferred.close()
                    raise
                finally:
                    CURRENT_STEP.reset(token)
            charge = await self._charge(calls)
            if failed is not None:
                # AttemptStopped too, as when it was an Exception: the fail write then meets
                # the same lost lease and raises it again. The calls the failed try made are
                # counted with its failure: the provider billed them.
                error = f"{type(failed).__name__}: {failed}"
                await progress.finished(error)
                if deferred is not None:
                    await self._fenced(deferred.ensure_started())
                await self._fenced(self._checkpoints.fail(key, error, charge))
                failures += 1
                if failures > retries or isinstance(failed, TypeError):
                    raise failed
                delay_s = backoff_delay_s(backoff, failures)
                logger.info(
                    "run %s step %r failed (try %d of %d), retrying in %.2fs: %r",
                    self.run_id,
                    key,
                    failures,
                    retries + 1,
                    delay_s,
                    failed,
                    extra=self._log_extra(),
                )
                await self._pause(delay_s)
                continue
            await progress.finished(None)
            if deferred is None:
                await self._fenced(self._checkpoints.succeed(key, output, charge))
            else:
                await self._fenced(deferred.succeed(output, charge))
            return output

    def _defers_start(self) -> bool:
        """Whether a new step's start may wait: deferring is on and the lease is held."""
        held = self._lease_held
        return self._step_start_after_s > 0 and held is not None and held()

    def _deferred(
        self, start: Started, key: str, function: str, digest: str
    ) -> DeferredStart | None:
        """A new step's start, written only if it outlasts ``step_start_after`` (or None)."""
        if start.unwritten is None:
            return None
        return DeferredStart(
            self._checkpoints,
            key,
            function,
            digest,
            seq=start.unwritten,
            after_s=self._step_start_after_s,
            on_cancel=self._mark_cancelled,  # raised at the next boundary
            alone=self._events.exclusive,
        )

    def idempotency_key(self) -> str:
        """``"<run id>:<step key>"`` of the step running now, the same on every attempt.

        Raises:
            NotInStep: Called outside ``ctx.step``.
        """
        current = CURRENT_STEP.get()
        if current is None or current[0] != self.run_id:
            raise NotInStep("ctx.idempotency_key() is only available inside a step (ctx.step)")
        return f"{current[0]}:{current[1]}"

    # --- events and messages -----------------------------------------------------------------

    async def emit(self, type: str, data: JSONObject) -> None:
        """Record an event of the run and stream it to live subscribers.

        ``delta`` events are buffered and written in batches, in the background (within
        :data:`~moorline.engine.events.DEFAULT_FLUSH_INTERVAL_S`, and before anything else the
        attempt writes); every other type is written at once, after the buffered ones.

        Raises:
            ValueError: ``type`` is empty or one Moorline uses for run transitions.
            TypeError: ``data`` is not a JSON object.
            LeaseLost: This attempt no longer holds the run; nothing was written.
        """
        if not type or type in SYSTEM_EVENT_TYPES:
            raise ValueError(f"event type {type!r} is reserved or empty")
        payload = to_json(data, f"the data of event {type!r}")
        if not isinstance(payload, dict):
            raise TypeError(f"the data of event {type!r} must be a JSON object")
        self._check_lease()
        if CURRENT_STEP.get() is None:
            # Outside a step, a replay after a park repeats the calls made before it: they
            # are recorded already (a step's own emits replay with the step, not at all).
            self._emit_calls += 1
            if self._emit_calls <= self._skip_emits:
                return
        try:
            if type in BUFFERED_EVENT_TYPES:
                # No store round trip per delta: the cancel flag is read at the next boundary.
                await self._events.add(type, payload)
                return
            await self._refresh_cancelled()
            await self._events.write(type, payload)
        except LeaseLost as exc:
            self._lost = exc
            raise

    async def drain_messages(self) -> list[str]:
        """Take every message injected into the run since the last drain, oldest first.

        Each drain is a checkpoint: a replay of this attempt (after a crash) gets the same
        messages back from the same drain, and a message is never returned by two drains.

        Raises:
            Cancelled: The run was cancelled; the messages stay queued.
            LeaseLost: This attempt no longer holds the run; nothing was taken.
        """
        await self._check_boundary()
        return await self._drain(None)

    async def _drain(self, limit: int | None) -> list[str]:
        """Take up to ``limit`` waiting messages (all when None) as the run's next drain."""
        self._drains += 1
        try:
            # Buffered events first, and this drain's message_received events published in
            # their place.
            async with self._events.exclusive():
                drained = await self._messages.drain(self._fence, self._drains, limit=limit)
                await self._events.publish(drained.events)
        except LeaseLost as exc:
            self._lost = exc
            raise
        try:
            # The database is the record; the store's signals of these messages are spent.
            await self._store.drain_messages(self.run_id)
        except BackendUnavailable as exc:
            logger.warning("run %s: message signals not cleared: %r", self.run_id, exc)
        return [message.content for message in drained.messages]

    # --- the attempt's state -----------------------------------------------------------------

    def raise_if_stopped(self, *, returned: bool = False) -> None:
        """Raise the stop this attempt saw (lease lost, cancelled), even if it was swallowed.

        Args:
            returned: The workflow returned. Its value then outranks a cancel it was never
                told of: the code ran to its end, every side effect done, so the run ends
                with what it returned (a lost lease still stops it: the attempt is stale).
        """
        self._check_lease()
        if self._is_cancelled and (self._cancel_delivered or not returned):
            raise Cancelled(self.run_id)

    def _check_lease(self) -> None:
        if self._parked is not None:
            # The run is waiting: whatever the workflow does after swallowing RunParked.
            raise self._parked
        if self._lost is not None:
            raise LeaseLost(self._fence, "nothing more")

    def _deliver_cancel(self) -> Cancelled:
        """The cancel, as it is raised into the workflow code (which is thereby told)."""
        self._is_cancelled = self._cancel_delivered = True
        return Cancelled(self.run_id)

    def _step_stream(self, key: str) -> StepStream:
        """How a generator step of ``key`` streams: deltas through the writer, stop checks."""
        return StepStream(key, send=self._events.add, check=self._check_stop, to_json=to_json)

    def _check_stop(self) -> None:
        """Before each streamed item: raise the lost lease or the cancel seen so far."""
        self._check_lease()
        if self._is_cancelled:
            raise self._deliver_cancel()

    async def _fenced(self, write: Coroutine[Any, Any, T]) -> T:
        """Await a fenced write, after the buffered events (which keep their place before it)."""
        try:
            try:
                await self._events.flush_before_checkpoint()
            except BaseException:
                write.close()
                raise
            return await write
        except LeaseLost as exc:
            self._lost = exc
            raise
        except CancelRequested:
            # The database has the request even though the store did not say so (yet).
            raise self._deliver_cancel() from None

    def _mark_cancelled(self) -> None:
        """The runner learnt of the run's cancel (store signal or heartbeat): remember it."""
        self._is_cancelled = True

    async def _refresh_cancelled(self) -> bool:
        if not self._is_cancelled:
            try:
                # Bounded like the attempt's other store calls: behind a network that drops
                # packets the client's own timeouts would hold the step for about 20 s.
                self._is_cancelled = await bounded(self._store.is_cancelled(self.run_id))
            except BackendUnavailable as exc:
                # A lost cancel check costs latency only: the cancel is seen at a later one.
                logger.warning("run %s: cancel flag unreadable: %r", self.run_id, exc)
        return self._is_cancelled

    async def _check_boundary(self) -> None:
        self._check_lease()
        if await self._refresh_cancelled():
            raise self._deliver_cancel()

    async def _pause(self, delay_s: float) -> None:
        """Sleep ``delay_s`` between two tries of a step; raise :class:`Cancelled` on cancel."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + delay_s
        try:
            if await self._store.wait_cancelled(self.run_id, delay_s):
                raise self._deliver_cancel()
        except StoreShutdown:
            # The worker is going away and will cancel this attempt; until then, just sleep.
            await asyncio.sleep(max(0.0, deadline - loop.time()))

    def _log_extra(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "attempt": self.attempt, "tenant_id": self.tenant_id}
