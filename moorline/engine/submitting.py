"""Submitting runs from Python, in process: the values and the seam ``Moorline.submit`` uses.

``app.submit(...)`` stores a run through the same admission as ``POST
/v1/workflows/{workflow}/runs`` (rate limit, input, idempotency, conversation, quota, the
group-commit Submitter). Admission sits above the engine (it validates against the registry),
so the app object cannot build it by import: it holds a :class:`Submissions` (the Protocol
here), built on first use by :mod:`moorline.admission.local` (see ``Moorline._submissions``).

:class:`SyncPortal` is the sync wrapper: a private event loop in a thread of its own, for sync
code (a Django view, a script) that cannot ``await``.
"""

import asyncio
import threading
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol, TypeVar

from moorline.errors import MoorlineError
from moorline.types import RunId, RunStatus

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class Submission:
    """One run to submit, as ``app.submit_many`` takes it (and one item of the HTTP batch).

    Attributes:
        workflow: The registered workflow's name.
        input: Its arguments by parameter name (validated as a trigger's are).
        idempotency_key: The same key and input again returns the first run.
        conversation_id: At most one active run per conversation.
        delay: Seconds before the run may be claimed.
    """

    workflow: str
    input: Mapping[str, Any] = field(default_factory=dict)
    idempotency_key: str | None = None
    conversation_id: str | None = None
    delay: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Submitted:
    """A submitted run: what ``POST /v1/workflows/{workflow}/runs`` answers, in Python.

    Attributes:
        run_id: The run's id (the earlier run's, for a repeated idempotency key).
        created: False when the submission repeated an earlier one (same idempotency key and
            input): the HTTP route's 200 rather than 202.
        status: The run's status as stored (``queued``; the earlier run's for a repeat).
        workflow: The workflow's name.
        queue: The lane the run waits in.
        created_at: When the run was stored.
    """

    run_id: RunId
    created: bool
    status: RunStatus
    workflow: str
    queue: str
    created_at: datetime


class Submissions(Protocol):
    """Admits submissions for one app in one event loop (``moorline.admission.local``)."""

    async def submit(self, submission: Submission, *, tenant: str) -> Submitted:
        """Admit one submission of ``tenant`` (a tenant id).

        Raises:
            MoorlineError: the HTTP route's refusal, as its class (``WorkflowNotFound``,
                ``InvalidInput``, ``InvalidRequest``, ``IdempotencyConflict``,
                ``ConversationBusy``, ``QuotaExceeded``, ``RateLimited``, ``TenantNotFound``,
                ``BackendUnavailable``).
        """
        ...

    async def submit_many(
        self, submissions: list[Submission], *, tenant: str
    ) -> list[Submitted | MoorlineError]:
        """Admit each submission on its own; each one's run, or its refusal, in order."""
        ...

    async def close(self) -> None:
        """Finish the submissions in flight, then close the connections."""
        ...


class SyncPortal:
    """An event loop in a daemon thread, running coroutines for sync callers.

    What ``submit_sync`` needs: the app's connections, locks and the Submitter's writer task
    belong to one event loop, and sync code has none (or one it must not block on). One
    portal per app, started on first use and stopped by :meth:`close`.
    """

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the portal's loop and wait for its result here.

        Raises:
            RuntimeError: called from the portal's own thread (it would wait for itself).
        """
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError("a sync submit cannot be called from the portal's own loop")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def close(self) -> None:
        """Stop the loop and join its thread (after whatever :meth:`run` ran last)."""
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
