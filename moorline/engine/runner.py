"""The seam between dispatch and the engine: one attempt of a run is one ``Runner.run`` call.

The worker claims a run, holds its lease, and calls the runner once; whatever the runner
returns is the run's output and whatever it raises decides the attempt's outcome. The runner
never writes the run's status: that is the worker's fenced completion. Cancelling the call (the
lease was lost, the worker is shutting down) must stop the workflow at its next ``await``.

Besides the workflow's own result or error, an attempt ends in one of three stops:

* :class:`~moorline.errors.LeaseLost` — a fenced write found the run taken over: the
  worker writes nothing more;
* :class:`~moorline.engine.context.Cancelled` — the run was cancelled: the worker ends it
  ``cancelled``;
* :class:`~moorline.errors.TimeLimitExceeded` — the attempt ran past its hard time limit: the
  worker ends it ``timed_out``.

The runner raises the first two even when the workflow caught and swallowed them. While the
workflow runs (from :data:`CANCEL_WATCH_DELAY_S` into the attempt), a watcher task waits for the
run's cancel, from the RuntimeStore's signal (milliseconds after the request) or from the
worker's heartbeat (``cancel_requested``, set when the database reports the request: a lost
signal costs one heartbeat interval). It marks the context cancelled, so the workflow's next
check raises ``Cancelled``, and gives the workflow ``MOORLINE_CANCEL_GRACE`` seconds to reach
one before an :class:`~moorline.engine.limits.AttemptGuard` cancels it outright.

Around the workflow call the runner keeps the attempt's runtime state
(:mod:`moorline.engine.conversations`): the conversation lease is taken before the workflow
starts and released by :meth:`Runner.release` once the worker has written the outcome; the
interactive window is open while the workflow code runs (from its first write at the latest:
the conversations module says how). Between the workflow's end and
the outcome, the buffered events are written, so the terminal outcome is the last record.
"""

import asyncio
import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from moorline.concurrency import cancel_and_wait
from moorline.db.manager import DatabaseManager
from moorline.db.repos.children import ChildrenRepo
from moorline.db.repos.events import EventsRepo
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.messages import MessagesRepo
from moorline.db.repos.parking import ParkingRepo
from moorline.db.repos.queue import Claim
from moorline.db.repos.records import Run
from moorline.db.repos.runs import RunsRepo
from moorline.db.repos.steps import StepsRepo
from moorline.db.repos.usage import UsageRepo
from moorline.engine.children import DEFAULT_MAX_CHILDREN, ChildEnds
from moorline.engine.context import Cancelled, Context
from moorline.engine.conversations import Conversations
from moorline.engine.events import DEFAULT_BATCH_SIZE, DEFAULT_FLUSH_INTERVAL_S, EventWriter
from moorline.engine.limits import AttemptGuard
from moorline.engine.outages import OutageLog
from moorline.engine.registry import Moorline, WorkflowDefinition
from moorline.engine.steps import to_json
from moorline.errors import AttemptStopped, BackendUnavailable
from moorline.llm.governance import Caller, CallHook, governing
from moorline.llm.models import ModelsProvider
from moorline.observability import tracing
from moorline.runtime.base import RuntimeStore, StoreShutdown
from moorline.settings import Settings
from moorline.types import JSONObject, JSONValue, RunId

logger = logging.getLogger(__name__)

CANCEL_WATCH_DELAY_S = 0.1
"""Seconds into an attempt before its cancel watcher starts. Most attempts of a busy worker
are shorter, and a watcher (a task and a store wait) would cost each of them a noticeable
share of its run time for nothing: their own checks see a cancel, and ``finish_many`` ends a
run with a recorded cancel ``cancelled`` unless it succeeded. Longer attempts learn of a
cancel this much later at most, next to a grace of seconds."""

CANCEL_WATCH_SLICE_S = 300.0
"""Longest single wait of the cancel watcher on the store; it then simply waits again."""

CANCEL_WATCH_RETRY_S = 1.0
"""Pause of the cancel watcher after the store failed to answer, before it asks again."""


class Runner(Protocol):
    """Executes one attempt of a claimed run."""

    async def run(
        self,
        claim: Claim,
        *,
        cancel_requested: asyncio.Event | None = None,
        trailing: list[tuple[str, JSONObject]] | None = None,
        lease_held: Callable[[], bool] | None = None,
    ) -> JSONValue:
        """Run the claimed run's workflow once and return its output (JSON).

        Args:
            claim: The run and the fence of this attempt.
            cancel_requested: Set by the worker when its heartbeat finds the run's cancel
                recorded in the database.
            trailing: Where a workflow that returned leaves its last progress events, for
                the caller to write with the outcome; None writes them before returning.
            lease_held: Whether the worker still holds the run's lease by its own clock (its
                self-fence); with it, a new step's function may be called before its start
                is written (``step_start_after``). None: every start is written first.
        """
        ...

    async def renew(self, claims: Sequence[Claim]) -> None:
        """Keep the runtime state of these live attempts alive (called by every heartbeat).

        Never raises for one attempt's trouble: the store is coordination that may be lost.
        """
        ...

    async def release(self, claim: Claim) -> None:
        """The attempt is over and its outcome written (or abandoned): release its state."""
        ...

    def children_ended(self, parent_ids: Iterable[str]) -> None:
        """Children of these parents ended, their outcomes written: wake joins waiting here."""
        ...


class WorkflowRunner:
    """Runs the workflows registered on a :class:`~moorline.engine.registry.Moorline` app."""

    def __init__(
        self,
        app: Moorline,
        *,
        db: DatabaseManager,
        store: RuntimeStore,
        settings: Settings,
        event_batch_size: int = DEFAULT_BATCH_SIZE,
        event_flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        call_hook: CallHook | None = None,
        models: ModelsProvider | None = None,
        on_enqueued: Callable[[set[str]], object] | None = None,
    ) -> None:
        """Create a runner.

        Args:
            app: The workflows this worker can run.
            db: The database (steps, events, interrupts and message drains are written
                there, fenced).
            store: The RuntimeStore (cancel flags, conversation leases, interactive windows,
                message signals, interrupt wake-ups, live events).
            settings: Read for ``permission_timeout``, ``lease_ttl``, ``execution_timeout``
                (the hard time limit of workflows that set none) and ``cancel_grace``.
            event_batch_size: Buffered ``delta`` events written in one transaction.
            event_flush_interval_s: Longest a buffered ``delta`` event waits to be written.
            call_hook: Governs the model calls of the workflows (budgets, provider limits;
                :mod:`moorline.llm.governance`); None: calls are not governed.
            models: The models file's prices (shared with the process's governor); None:
                read from ``settings``.
            on_enqueued: Told the lanes a workflow queued runs in (its child runs), so their
                workers are woken (the process's wake-ups); None: they find them by polling.
        """
        self._on_enqueued = on_enqueued
        self._child_ends = ChildEnds()
        self._app = app
        self._call_hook = call_hook
        self._store = store
        self._settings = settings
        self._steps = StepsRepo(db)
        self._events = EventsRepo(db)
        self._interrupts = InterruptsRepo(db)
        self._messages = MessagesRepo(db)
        self._parking = ParkingRepo(db)
        self._children = ChildrenRepo(db)
        self._usage = UsageRepo(db)
        # Read now: a bad models file stops the worker at start, with the file's error.
        self._models = models if models is not None else ModelsProvider(settings)
        self._conversations = Conversations(store, RunsRepo(db), lease_ttl_s=settings.lease_ttl)
        # Every running attempt's watcher retries each second while the store is down: one
        # warning per outage. It cannot tell when the store is back (a wait that succeeds
        # lasts minutes), so an outage ends after a quiet minute.
        self._cancel_watch_failures = OutageLog(logger, "the runtime store's cancel watch")
        self._event_batch_size = event_batch_size
        self._event_flush_interval_s = event_flush_interval_s

    def context(
        self,
        claim: Claim,
        events: EventWriter | None = None,
        *,
        lease_held: Callable[[], bool] | None = None,
    ) -> Context:
        """A fresh :class:`Context` for one attempt of the claimed run (see :meth:`run`)."""
        workflow = claim.run.workflow
        definition = self._app.get(workflow) if workflow in self._app else None
        return Context(
            claim,
            steps=self._steps,
            events=events if events is not None else self.event_writer(claim),
            interrupts=self._interrupts,
            messages=self._messages,
            parking=self._parking,
            store=self._store,
            permission_timeout_s=self._settings.permission_timeout,
            park_after_s=self._settings.park_after,
            step_start_after_s=self._settings.step_start_after,
            lease_held=lease_held,
            deadline_s=None if definition is None else definition.deadline_s,
            children=self._children,
            workflows=self._app,
            max_children=DEFAULT_MAX_CHILDREN if definition is None else definition.max_children,
            models=self._models,
            usage=self._usage,
            on_enqueued=self._on_enqueued,
            child_ends=self._child_ends,
        )

    def hard_limit_s(self, definition: WorkflowDefinition, run: Run) -> float:
        """An attempt's hard time limit: the run's own, else its workflow's, else the default."""
        for limit_s in (run.timeout_s, definition.timeout_s):
            if limit_s is not None:
                return limit_s
        return self._settings.execution_timeout

    def event_writer(self, claim: Claim) -> EventWriter:
        """The event writer of one attempt of the claimed run."""
        return EventWriter(
            claim.fence,
            events=self._events,
            store=self._store,
            batch_size=self._event_batch_size,
            flush_interval_s=self._event_flush_interval_s,
            opened=functools.partial(self._conversations.opened, claim),
        )

    async def run(
        self,
        claim: Claim,
        *,
        cancel_requested: asyncio.Event | None = None,
        trailing: list[tuple[str, JSONObject]] | None = None,
        lease_held: Callable[[], bool] | None = None,
    ) -> JSONValue:
        """Call the run's workflow with a fresh :class:`Context` and its stored input.

        Args:
            claim: The run and the fence of this attempt.
            cancel_requested: Set by the worker when its heartbeat finds the run's cancel
                recorded in the database; None when only the RuntimeStore's signal counts.
            trailing: When the workflow returns with only progress events buffered (a
                step's ``step_started`` and ``step_finished``), they go here instead of into a
                transaction of their own: the worker writes them with the outcome, before its
                terminal event (one transaction less per run). Streams read them from the
                database with the terminal event, which is not published live either.
            lease_held: The worker's self-fence, asked before a new step's start is deferred
                (see the :class:`Runner` protocol).

        Raises:
            WorkflowNotFound: this worker's app does not have the run's workflow (a
                configuration error: it fails the run at once instead of retrying).
            ConversationBusy: another live run of the conversation holds its lease (a
                retryable failure).
            LeaseLost: the attempt lost its lease; the worker writes nothing.
            Cancelled: the run was cancelled.
            TimeLimitExceeded: the attempt ran past its hard time limit.
            SoftTimeLimitExceeded: the workflow let its soft time limit escape.
            TypeError: the workflow's result is not JSON-serialisable.
        """
        run = claim.run
        with tracing.attempt_span(
            run_id=run.run_id,
            workflow=run.workflow,
            attempt=claim.fence.attempt,
            lane=run.lane,
            trace_context=run.trace_context,
        ):
            return await self._run(claim, cancel_requested, trailing, lease_held)

    async def _run(
        self,
        claim: Claim,
        cancel_requested: asyncio.Event | None,
        trailing: list[tuple[str, JSONObject]] | None,
        lease_held: Callable[[], bool] | None,
    ) -> JSONValue:
        run = claim.run
        definition = self._app.get(run.workflow)
        arguments = definition.bind(run.input if isinstance(run.input, dict) else {})
        events = self.event_writer(claim)
        ctx = self.context(claim, events, lease_held=lease_held)
        guard = AttemptGuard(
            hard_limit_s=self.hard_limit_s(definition, run),
            soft_limit_s=definition.soft_timeout_s,
        )
        heard = cancel_requested if cancel_requested is not None else asyncio.Event()
        watchers: list[asyncio.Task[None]] = []

        def watch() -> None:
            name = f"cancel-watch:{run.run_id}"
            watchers.append(asyncio.create_task(self._watch_cancel(ctx, guard, heard), name=name))

        await self._conversations.enter(claim)
        starting = asyncio.get_running_loop().call_later(CANCEL_WATCH_DELAY_S, watch)
        try:
            # The run's model calls answer to the hook, as its tenant at its plan's priority.
            # A long wait for provider capacity parks the run (ctx) instead.
            caller = Caller(tenant_id=run.tenant_id, weight=run.priority)
            with governing(self._call_hook, caller, parking=ctx):
                output = await guard.run(definition.fn(ctx, **arguments))
            await ctx.flush_saved()
        except (Exception, AttemptStopped) as exc:
            # AttemptStopped (LeaseLost) takes this way too, as when it was an Exception:
            # winding down raises it again from the buffered events' write.
            try:
                await self._flush_saved_quietly(ctx)
                await self._wind_down(claim, events)
                # A workflow that caught LeaseLost or Cancelled and failed some other way was
                # stopped all the same.
                ctx.raise_if_stopped()
            except BaseException as stop:
                raise stop from exc
            raise
        except BaseException:
            # Cancelled (lease lost, shutdown) or stopped: nothing more is written.
            events.abandon()
            await asyncio.shield(self._conversations.leave(claim))
            raise
        finally:
            starting.cancel()
            await self._stop_watchers(run.run_id, watchers)
        await self._wind_down(claim, events, trailing)
        ctx.raise_if_stopped(returned=True)
        return to_json(output, f"the result of workflow {run.workflow!r}")

    @staticmethod
    async def _flush_saved_quietly(ctx: Context) -> None:
        """Write what the failed attempt's replays saved; a failure to is only logged.

        The attempt's own error is what the worker must see, not a second one of the
        database; a lost lease (a BaseException) still stops everything.
        """
        try:
            await ctx.flush_saved()
        except Exception as exc:
            logger.warning("run %s: saved usage not written: %r", ctx.run_id, exc)

    async def _stop_watchers(self, run_id: RunId, watchers: list[asyncio.Task[None]]) -> None:
        if not watchers:
            return
        await cancel_and_wait(watchers)
        for watcher in watchers:
            failure = None if watcher.cancelled() else watcher.exception()
            if failure is not None:
                logger.error("run %s: cancel watcher failed", run_id, exc_info=failure)

    async def _watch_cancel(self, ctx: Context, guard: AttemptGuard, heard: asyncio.Event) -> None:
        """Until cancelled with the attempt: learn of the run's cancel and act on it."""
        signalled = asyncio.create_task(self._store_cancelled(ctx.run_id))
        heartbeat = asyncio.create_task(heard.wait())
        try:
            done, _ = await asyncio.wait(
                [signalled, heartbeat], return_when=asyncio.FIRST_COMPLETED
            )
            if signalled in done and not signalled.result():
                await heartbeat  # the store shut down: only the heartbeat can tell now
            from_store = signalled.done() and signalled.result()
        finally:
            await cancel_and_wait([signalled, heartbeat])
        logger.info(
            "run %s attempt %d: cancel seen (%s); %.1fs grace before it is stopped",
            ctx.run_id,
            ctx.attempt,
            "runtime store" if from_store else "heartbeat",
            self._settings.cancel_grace,
            extra={"run_id": ctx.run_id, "attempt": ctx.attempt, "tenant_id": ctx.tenant_id},
        )
        ctx._mark_cancelled()
        guard.cancel_after(self._settings.cancel_grace, Cancelled(ctx.run_id))
        if not from_store:
            # Learnt from the database: the store's flag was lost (or never set). Set it again
            # so the workflow's waits on the store (permission waits, step retry pauses) wake.
            try:
                await self._store.request_cancel(ctx.run_id)
            except BackendUnavailable as exc:
                logger.warning("run %s: cancel flag not restored: %r", ctx.run_id, exc)

    async def _store_cancelled(self, run_id: RunId) -> bool:
        """True once the store reports the run's cancel; False when the store shut down."""
        while True:
            try:
                if await self._store.wait_cancelled(run_id, CANCEL_WATCH_SLICE_S):
                    return True
            except StoreShutdown:
                return False
            except BackendUnavailable as exc:
                self._cancel_watch_failures.failed(
                    "run %s: cancel flag unreadable: %r", run_id, exc, extra={"run_id": run_id}
                )
                await asyncio.sleep(CANCEL_WATCH_RETRY_S)

    async def _wind_down(
        self,
        claim: Claim,
        events: EventWriter,
        trailing: list[tuple[str, JSONObject]] | None = None,
    ) -> None:
        """The workflow returned or raised: close its window, then write its last events.

        With ``trailing``, buffered progress events are handed over there rather than written
        (see :meth:`run`).

        Raises:
            LeaseLost: The buffered events could not be written; the attempt is over.
        """
        await self._conversations.leave(claim)
        try:
            if trailing is not None and (taken := events.take_progress()) is not None:
                trailing.extend(taken)
                return
            await events.flush()
        except BaseException:
            events.abandon()
            raise

    async def renew(self, claims: Sequence[Claim]) -> None:
        """Renew the conversation leases and interactive windows of live attempts."""
        await self._conversations.renew(claims)

    def children_ended(self, parent_ids: Iterable[str]) -> None:
        self._child_ends.ended(parent_ids)

    async def release(self, claim: Claim) -> None:
        """Close the attempt's window and release its conversation lease."""
        await self._conversations.release(claim)
