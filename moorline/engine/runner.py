"""The seam between dispatch and the engine: one attempt of a run is one ``Runner.run`` call.

The worker claims a run, holds its lease, and calls the runner once; whatever the runner
returns is the run's output and whatever it raises decides retry or failure. The runner never
writes the run's status: that is the worker's fenced completion. Cancelling the call (the lease
was lost, the worker is shutting down) must stop the workflow at its next ``await``.

Two stops are not failures and must make the worker write nothing for the attempt:
:class:`~moorline.db.repos.steps.LeaseLost` (a fenced write found the run taken over) and
:class:`~moorline.engine.context.Cancelled` (the run was cancelled). The runner raises them
even when the workflow caught and swallowed them.
"""

from typing import Protocol

from moorline.db.manager import DatabaseManager
from moorline.db.repos.events import EventsRepo
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.queue import Claim
from moorline.db.repos.steps import StepsRepo
from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.engine.steps import to_json
from moorline.runtime.base import RuntimeStore
from moorline.settings import Settings
from moorline.types import JSONValue


class Runner(Protocol):
    """Executes one attempt of a claimed run."""

    async def run(self, claim: Claim) -> JSONValue:
        """Run the claimed run's workflow once and return its output (JSON)."""
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
    ) -> None:
        """Create a runner.

        Args:
            app: The workflows this worker can run.
            db: The database (steps, events and interrupts are written there, fenced).
            store: The RuntimeStore (cancel flags, injected messages, interrupt wake-ups,
                live events).
            settings: Read for ``permission_timeout``.
        """
        self._app = app
        self._store = store
        self._settings = settings
        self._steps = StepsRepo(db)
        self._events = EventsRepo(db)
        self._interrupts = InterruptsRepo(db)

    def context(self, claim: Claim) -> Context:
        """A fresh :class:`Context` for one attempt of the claimed run."""
        return Context(
            claim,
            steps=self._steps,
            events=self._events,
            interrupts=self._interrupts,
            store=self._store,
            permission_timeout_s=self._settings.permission_timeout,
        )

    async def run(self, claim: Claim) -> JSONValue:
        """Call the run's workflow with a fresh :class:`Context` and its stored input.

        Raises:
            WorkflowNotFound: this worker's app does not have the run's workflow (a
                configuration error: it fails the run at once instead of retrying).
            LeaseLost: the attempt lost its lease; the worker writes nothing.
            Cancelled: the run was cancelled; the worker writes nothing.
            TypeError: the workflow's result is not JSON-serialisable.
        """
        run = claim.run
        definition = self._app.get(run.workflow)
        arguments = definition.bind(run.input if isinstance(run.input, dict) else {})
        ctx = self.context(claim)
        try:
            output = await definition.fn(ctx, **arguments)
        except Exception as exc:
            # A workflow that caught LeaseLost and failed some other way still lost its lease.
            try:
                ctx.raise_if_stopped()
            except BaseException as stop:
                raise stop from exc
            raise
        ctx.raise_if_stopped()
        return to_json(output, f"the result of workflow {run.workflow!r}")
