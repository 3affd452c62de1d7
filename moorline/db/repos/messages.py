"""Injected messages: the durable side of posting a message and of ``ctx.drain_messages``.

The database holds every message; the RuntimeStore only signals them.

* :meth:`MessagesRepo.post` is one write transaction: it locks the run's row (the run must be
  the tenant's and ``running``), counts the run's waiting messages against the cap, and
  inserts the message at the run's next ``seq``. The row lock serialises the posters of a run
  with each other and with the run's fenced writes (every fenced write updates that row), so
  ``seq`` is safe and a drain sees a post whole or not at all.
* :meth:`MessagesRepo.drain` is a checkpoint, fenced by the attempt like a step. The *k*-th
  drain of a run is recorded as the step ``moorline.drain:<k>``, whose output lists the
  ``seq`` of every message it took; in the same transaction those messages are marked
  delivered by the attempt and one ``message_received`` event is appended per message. A later
  attempt replaying drain *k* finds the step and gets the same messages back, in the same
  order, and a message that arrived meanwhile waits for drain *k + 1*. A worker that dies
  between a drain and its next checkpoint therefore neither loses nor repeats a message, and
  a replay takes the same path as the attempt it repeats. Every drain is recorded, an empty
  one too: otherwise a replay could hand a newer message to a drain that returned nothing the
  first time.

Step keys starting with ``moorline.`` are the engine's; a workflow step reusing one fails with
:class:`~moorline.db.repos.steps.StepMismatch` rather than returning a drain's record.
"""

import builtins
import hashlib
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import RowMapping, case, exists, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.backends import Backend
from moorline.db.manager import DatabaseManager
from moorline.db.repos.events import EVENT_MESSAGE_RECEIVED, append_fenced_events_txn
from moorline.db.repos.fences import hold_fence_txn
from moorline.db.repos.parking import ResumeReason, lock_wait_state_txn, resume_txn
from moorline.db.repos.records import Event, Fence, Message
from moorline.db.repos.steps import StepMismatch
from moorline.db.schema import messages, steps
from moorline.errors import LimitExceeded, RunNotFound, RunNotInteractive
from moorline.types import Attempt, JSONObject, RunId, RunStatus, StepStatus, TenantId

DRAIN_STEP_PREFIX = "moorline.drain:"
"""Step key of the n-th drain of a run: ``moorline.drain:<n>`` (persisted; contract)."""

DRAIN_FUNCTION = "moorline.drain_messages"
"""The ``function`` recorded on drain steps."""

DEFAULT_MAX_WAITING = 1000
"""Undelivered messages a run may hold before further posts are refused."""

DEFAULT_LIST_LIMIT = 1000


@dataclass(frozen=True, slots=True, kw_only=True)
class Drain:
    """What one drain of a run took.

    Attributes:
        messages: The messages, in ``seq`` order (the same ones on every replay).
        events: The ``message_received`` events this call appended (none on a replay).
        replay: The drain was recorded before, by this or an earlier attempt.
    """

    messages: builtins.list[Message]
    events: builtins.list[Event]
    replay: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Posted:
    """A stored message, and the lane of the waiting run it re-queued (None if none)."""

    message: Message
    resumed_lane: str | None


def drain_step_key(position: int) -> str:
    """The step key of a run's ``position``-th drain (counting from 1)."""
    return f"{DRAIN_STEP_PREFIX}{position}"


def _drain_call_hash(position: int) -> str:
    return hashlib.sha256(f"{DRAIN_FUNCTION}:{position}".encode()).hexdigest()


class MessagesRepo:
    """Messages of runs: posted by clients, drained by the run's attempt under its fence."""

    def __init__(self, db: DatabaseManager, *, max_waiting: int = DEFAULT_MAX_WAITING) -> None:
        """Create the repository.

        Args:
            db: The database.
            max_waiting: Undelivered messages a run may hold; a post beyond it is refused.
        """
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {max_waiting}")
        self._db = db
        self._backend: Backend = db.backend
        self._max_waiting = max_waiting

    async def post(self, tenant_id: TenantId, run_id: RunId, content: str) -> "Posted":
        """Store ``content`` as the run's next message, while the run runs or waits for one.

        A run ``waiting`` for a message is re-queued in the same transaction.

        Not wrapped in ``with_retry``: a post is not idempotent, and a retry after a lost
        commit acknowledgement would store the message twice.

        Returns:
            The message as stored, and the lane of the run it re-queued (if it did).

        Raises:
            RunNotFound: No run ``run_id`` of ``tenant_id`` (another tenant's run included).
            RunNotInteractive: The run is neither running nor waiting for a message.
            LimitExceeded: The run already holds ``max_waiting`` undelivered messages.
        """
        backend = self._backend
        async with self._db.write_transaction() as conn:
            run = await lock_wait_state_txn(conn, backend, run_id, tenant_id)
            if run is None:
                raise RunNotFound(f"no run {run_id}")
            status = run["status"]
            waited: Any = run["waiting_for"] or {}
            parked = status == RunStatus.WAITING.value and waited.get("kind") == "message"
            if status != RunStatus.RUNNING.value and not parked:
                raise RunNotInteractive(
                    f"run {run_id} is {status}: messages are accepted only while it runs "
                    "or waits for a message"
                )
            waiting = func.coalesce(
                func.sum(case((messages.c.delivered_attempt.is_(None), 1), else_=0)), 0
            )
            last_seq = func.coalesce(func.max(messages.c.seq), 0)
            state = select(waiting, last_seq, backend.now()).where(messages.c.run_id == run_id)
            waiting_now, last_seq, now = (await conn.execute(state)).one()
            if waiting_now >= self._max_waiting:
                raise LimitExceeded(
                    f"run {run_id} already has {waiting_now} messages waiting to be drained"
                )
            seq = int(last_seq) + 1
            await conn.execute(
                insert(messages).values(run_id=run_id, seq=seq, content=content, created_at=now)
            )
            if parked:
                # Under the run's row lock, as a park reads the messages: see parking.py.
                await resume_txn(conn, backend, run, ResumeReason.MESSAGE, now=now)
        message = Message(
            run_id=run_id,
            seq=seq,
            content=content,
            created_at=now,
            delivered_attempt=None,
            delivered_at=None,
        )
        return Posted(message=message, resumed_lane=run["lane"] if parked else None)

    async def drain(self, fence: Fence, position: int, *, limit: int | None = None) -> Drain:
        """Take the run's waiting messages as its ``position``-th drain, or replay that drain.

        Idempotent (a retry after a lost commit acknowledgement finds its own record), so it
        is wrapped in ``with_retry``.

        Args:
            fence: The attempt's fence.
            position: Which drain of the run this is, counting from 1 in every attempt.
            limit: Most messages to take (``ctx.wait_for_message`` takes one); None for all.

        Returns:
            The drained messages, oldest first; the recorded ones when this drain happened
            before.

        Raises:
            LeaseLost: The fence no longer holds; nothing was written.
            StepMismatch: The drain's step key was recorded for something else.
        """
        if position < 1:
            raise ValueError(f"drains count from 1, got {position}")

        async def attempt() -> Drain:
            async with self._db.write_transaction() as conn:
                await hold_fence_txn(conn, self._backend.name, fence, f"drain {position}")
                return await self._drain_txn(conn, fence, position, limit)

        return await self._db.with_retry(attempt)

    async def _drain_txn(
        self, conn: AsyncConnection, fence: Fence, position: int, limit: int | None
    ) -> Drain:
        key = drain_step_key(position)
        digest = _drain_call_hash(position)
        find = select(steps).where(steps.c.run_id == fence.run_id, steps.c.key == key)
        recorded = (await conn.execute(find)).mappings().first()
        if recorded is not None:
            return await self._replay_txn(conn, fence, key, digest, recorded)
        now: datetime = (await conn.execute(self._backend.select_now())).scalar_one()
        waiting = (
            select(messages)
            .where(messages.c.run_id == fence.run_id, messages.c.delivered_attempt.is_(None))
            .order_by(messages.c.seq)
            .limit(limit)
        )
        rows = (await conn.execute(waiting)).mappings().all()
        seqs = [row["seq"] for row in rows]
        if seqs:
            result = await conn.execute(
                update(messages)
                .where(
                    messages.c.run_id == fence.run_id,
                    messages.c.seq.in_(seqs),
                    messages.c.delivered_attempt.is_(None),
                )
                .values(delivered_attempt=fence.attempt, delivered_at=now)
            )
            # The run's row lock keeps posters out, and only a fenced drain delivers.
            if result.rowcount != len(seqs):  # pragma: no cover - would be a locking bug
                raise AssertionError(f"delivered {result.rowcount} of {len(seqs)} messages")
        output: JSONObject = {"seqs": list(seqs)}
        await conn.execute(
            insert(steps).values(
                run_id=fence.run_id,
                key=key,
                status=StepStatus.SUCCEEDED.value,
                attempt=fence.attempt,
                function=DRAIN_FUNCTION,
                call_hash=digest,
                output=output,
                started_at=now,
                finished_at=now,
            )
        )
        taken = [
            _message_from_row({**row, "delivered_attempt": fence.attempt, "delivered_at": now})
            for row in rows
        ]
        received: builtins.list[tuple[str, JSONObject]] = [
            (EVENT_MESSAGE_RECEIVED, {"seq": message.seq, "content": message.content})
            for message in taken
        ]
        events = await append_fenced_events_txn(conn, self._backend.name, fence, received)
        return Drain(messages=taken, events=events, replay=False)

    async def _replay_txn(
        self, conn: AsyncConnection, fence: Fence, key: str, digest: str, recorded: RowMapping
    ) -> Drain:
        if (recorded["key"], recorded["function"], recorded["call_hash"]) != (
            key,
            DRAIN_FUNCTION,
            digest,
        ) or recorded["status"] != StepStatus.SUCCEEDED.value:
            raise StepMismatch(
                fence.run_id,
                key,
                recorded_key=recorded["key"],
                recorded_function=recorded["function"],
                recorded_call_hash=recorded["call_hash"],
                function=DRAIN_FUNCTION,
                call_hash=digest,
            )
        output: Any = recorded["output"]
        seqs = [int(seq) for seq in output["seqs"]]
        if not seqs:
            return Drain(messages=[], events=[], replay=True)
        stmt = (
            select(messages)
            .where(messages.c.run_id == fence.run_id, messages.c.seq.in_(seqs))
            .order_by(messages.c.seq)
        )
        rows = (await conn.execute(stmt)).mappings().all()
        return Drain(messages=[_message_from_row(row) for row in rows], events=[], replay=True)

    async def is_drained(self, run_id: RunId, position: int) -> bool:
        """Whether the run's ``position``-th drain is recorded (a replay must repeat it)."""
        recorded = select(steps.c.key).where(
            steps.c.run_id == run_id, steps.c.key == drain_step_key(position)
        )

        async def read() -> bool:
            async with self._db.connect() as conn:
                return (await conn.execute(recorded)).first() is not None

        return await self._db.with_retry(read)

    async def has_waiting(self, run_id: RunId) -> bool:
        """Whether the run has a message no drain has taken yet."""
        waiting = select(
            exists().where(messages.c.run_id == run_id, messages.c.delivered_attempt.is_(None))
        )

        async def read() -> bool:
            async with self._db.connect() as conn:
                return bool((await conn.execute(waiting)).scalar())

        return await self._db.with_retry(read)

    async def list(
        self, run_id: RunId, *, after_seq: int = 0, limit: int = DEFAULT_LIST_LIMIT
    ) -> builtins.list[Message]:
        """The run's messages with ``seq`` above ``after_seq``, in ``seq`` order.

        Args:
            run_id: The run (the caller checked the tenant); an unknown run has none.
            after_seq: Return only messages after this one.
            limit: Most messages to return; page on with the last ``seq`` returned.
        """
        if limit < 1:
            return []
        stmt = (
            select(messages)
            .where(messages.c.run_id == run_id, messages.c.seq > after_seq)
            .order_by(messages.c.seq)
            .limit(limit)
        )

        async def read() -> builtins.list[Message]:
            async with self._db.connect() as conn:
                rows = (await conn.execute(stmt)).mappings().all()
            return [_message_from_row(row) for row in rows]

        return await self._db.with_retry(read)


def _message_from_row(row: Any) -> Message:
    attempt = row["delivered_attempt"]
    return Message(
        run_id=RunId(row["run_id"]),
        seq=row["seq"],
        content=row["content"],
        created_at=row["created_at"],
        delivered_attempt=None if attempt is None else Attempt(attempt),
        delivered_at=row["delivered_at"],
    )
