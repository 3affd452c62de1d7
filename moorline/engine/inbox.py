"""Injecting messages into running runs: what ``POST /v1/runs/{id}/messages`` calls.

A message is accepted only while the run's workflow code is executing (its interactive window
is open, see :mod:`moorline.engine.conversations`), then

1. stored in the database at the run's next ``seq``
   (:meth:`~moorline.db.repos.messages.MessagesRepo.post`, which re-checks in its transaction
   that the run is the tenant's and running), and only then
2. signalled through the RuntimeStore (``push_message``, idempotent per ``seq``).

The database is the record: the workflow's ``ctx.drain_messages`` takes messages from it, as a
fenced checkpoint, so each is delivered exactly once and in order even across a worker crash.
A signal lost with the store (or never sent, when the poster died between the two steps)
therefore delays nothing; the drain clears the signals it has consumed.
"""

import logging
from collections.abc import Awaitable, Callable

from moorline.db.manager import DatabaseManager
from moorline.db.repos.messages import DEFAULT_LIST_LIMIT, DEFAULT_MAX_WAITING, MessagesRepo
from moorline.db.repos.records import Message
from moorline.db.repos.runs import RunsRepo
from moorline.engine.conversations import window_key
from moorline.errors import (
    BackendUnavailable,
    InvalidInput,
    LimitExceeded,
    RunNotFound,
    RunNotInteractive,
)
from moorline.runtime.base import RuntimeStore
from moorline.types import RunId, RunStatus, TenantId

logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 32_768
"""Longest message accepted, in characters."""


class Inbox:
    """Posts messages to running runs and lists them, for their tenants.

    Args:
        db: The database.
        store: The RuntimeStore (interactive windows, message signals).
        max_waiting: Undelivered messages a run may hold before posts are refused.
        max_chars: Longest message accepted, in characters.
        wake: Wakes the workers of these lanes (a ``Notifier.notify``): told the lane of a
            waiting run a message re-queued.
    """

    def __init__(
        self,
        db: DatabaseManager,
        store: RuntimeStore,
        *,
        max_waiting: int = DEFAULT_MAX_WAITING,
        max_chars: int = MAX_MESSAGE_CHARS,
        wake: Callable[[set[str]], Awaitable[None]] | None = None,
    ) -> None:
        self._messages = MessagesRepo(db, max_waiting=max_waiting)
        self._runs = RunsRepo(db)
        self._store = store
        self._max_chars = max_chars
        self._wake = wake

    async def post_message(self, tenant_id: TenantId, run_id: RunId, content: str) -> Message:
        """Store a message for the run's workflow, then signal it.

        Returns:
            The message as stored, with its ``seq``.

        Raises:
            InvalidInput: ``content`` is empty or longer than ``max_chars``.
            RunNotFound: No such run for this tenant.
            RunNotInteractive: The run's workflow is not executing now (queued, between
                attempts, finishing or finished); nothing was stored.
            LimitExceeded: The run already holds ``max_waiting`` undelivered messages.
            BackendUnavailable: The database or the store could not be asked.
        """
        if not isinstance(content, str) or not content:
            raise InvalidInput("a message must be a non-empty string")
        if len(content) > self._max_chars:
            raise InvalidInput(
                f"a message may have at most {self._max_chars} characters, not {len(content)}"
            )
        run = await self._runs.get(run_id)
        if run is None or run.tenant_id != tenant_id:
            raise RunNotFound(f"no run {run_id}")
        # A waiting run has no window: the post itself checks that it waits for a message.
        if run.status is not RunStatus.WAITING and not await self._store.is_interactive(
            window_key(run), run_id
        ):
            raise RunNotInteractive(
                f"run {run_id} is {run.status.value} and its workflow is not executing now: "
                "messages are accepted only while it is, or while it waits for a message"
            )
        posted = await self._messages.post(tenant_id, run_id, content)
        message = posted.message
        if posted.resumed_lane is not None and self._wake is not None:
            await self._wake({posted.resumed_lane})
        try:
            await self._store.push_message(run_id, message.seq, content)
        except (BackendUnavailable, LimitExceeded) as exc:
            # Stored is delivered: the drain reads the database, not the signal.
            logger.warning(
                "run %s: message %d stored but not signalled: %r",
                run_id,
                message.seq,
                exc,
                extra={"run_id": run_id, "tenant_id": tenant_id},
            )
        return message

    async def list_messages(
        self,
        tenant_id: TenantId,
        run_id: RunId,
        *,
        after_seq: int = 0,
        limit: int = DEFAULT_LIST_LIMIT,
    ) -> list[Message]:
        """The run's messages after ``after_seq``, oldest first, delivered or waiting.

        Raises:
            RunNotFound: No such run for this tenant.
        """
        run = await self._runs.get(run_id)
        if run is None or run.tenant_id != tenant_id:
            raise RunNotFound(f"no run {run_id}")
        return await self._messages.list(run_id, after_seq=after_seq, limit=limit)
