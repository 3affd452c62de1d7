"""The seam between dispatch and the engine: one attempt of a run is one ``Runner.run`` call.

The worker claims a run, holds its lease, and calls the runner once; whatever the runner
returns is the run's output and whatever it raises decides retry or failure. The runner never
writes the run's status: that is the worker's fenced completion. Cancelling the call (the lease
was lost, the worker is shutting down) must stop the workflow at its next ``await``.
"""

from typing import Protocol

from moorline.db.repos.queue import Claim
from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.types import JSONValue


class Runner(Protocol):
    """Executes one attempt of a claimed run."""

    async def run(self, claim: Claim) -> JSONValue:
        """Run the claimed run's workflow once and return its output (JSON)."""
        ...


class WorkflowRunner:
    """Runs the workflows registered on a :class:`~moorline.engine.registry.Moorline` app."""

    def __init__(self, app: Moorline) -> None:
        self._app = app

    async def run(self, claim: Claim) -> JSONValue:
        """Call the run's workflow with a fresh :class:`Context` and its stored input.

        Raises:
            WorkflowNotFound: this worker's app does not have the run's workflow (a
                configuration error: it fails the run at once instead of retrying).
        """
        run = claim.run
        definition = self._app.get(run.workflow)
        arguments = definition.bind(run.input if isinstance(run.input, dict) else {})
        ctx = Context(
            run_id=run.run_id,
            attempt=claim.fence.attempt,
            tenant_id=run.tenant_id,
            conversation_id=run.conversation_id,
        )
        output: JSONValue = await definition.fn(ctx, **arguments)
        return output
