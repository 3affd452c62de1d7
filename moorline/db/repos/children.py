"""Child runs: started by a parent's attempt under its fence, joined, cascaded on cancel.

* :meth:`ChildrenRepo.start` inserts a child run (queued, in its parent's tenant and lane) in
  the transaction that proves the parent's fence, keyed by ``(parent, key)``: a parent replayed
  after a crash gets the child it started, never a second one. The child's ``queued`` event
  and the parent's ``child_started`` are written with it. Children are no triggers: they skip
  admission (the daily quota counts triggers), but count toward the tenant's concurrency cap
  while they run, as every run does.
* A parent waiting for children is parked (:mod:`moorline.db.repos.parking`, kind
  ``children``): the park marks the children it awaits. :meth:`ChildrenRepo.wake_parents`,
  called after children end, re-queues a waiting parent once none of its awaited children is
  left, writing its ``child_finished`` events; the timer sweep calls
  :meth:`ChildrenRepo.wake_ready_parents` as a backstop for children that ended on paths that
  did not call it (the reaper, a cancel, a deadline).
* :meth:`ChildrenRepo.unfinished_descendants` lists what a cancel of a parent must cancel, and
  :meth:`ChildrenRepo.orphans` the attached children whose parent already ended.
"""

import builtins
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.backends import Backend
from moorline.db.manager import DatabaseManager
from moorline.db.repos.events import EVENT_QUEUED, append_events_txn
from moorline.db.repos.fences import hold_fence_txn
from moorline.db.repos.new_runs import hash_input, new_run_id
from moorline.db.repos.parking import (
    ResumeReason,
    WaitKind,
    has_unfinished_awaited_txn,
    lock_wait_state_txn,
    resume_txn,
)
from moorline.db.repos.records import Fence, Run, run_from_row
from moorline.db.schema import runs
from moorline.errors import LimitExceeded
from moorline.observability import tracing
from moorline.types import TERMINAL_STATUSES, Attempt, JSONObject, RunId, RunStatus

EVENT_CHILD_STARTED = "child_started"
"""On the parent: a child was started (``{"run_id", "key", "workflow"}``)."""

EVENT_CHILD_FINISHED = "child_finished"
"""On the parent: an awaited child ended (``{"run_id", "key", "status"}``)."""

_TERMINAL = [status.value for status in TERMINAL_STATUSES]
_WAITING = RunStatus.WAITING.value


class ChildLimitExceeded(LimitExceeded):
    """A run tried to start more children than ``max_children``, or nest deeper than allowed."""

    code = "child_limit_exceeded"


@dataclass(frozen=True, slots=True, kw_only=True)
class NewChild:
    """A child run to start, as ``ctx.start_child`` describes it.

    Attributes:
        key: Its key among the parent's children (unique per parent).
        workflow: The child's workflow.
        input: Its arguments, validated by the caller.
        max_attempts: Its workflow's attempt budget.
        timeout_s: Its workflow's hard time limit, if any.
        detached: Whether it outlives its parent's failure.
    """

    key: str
    workflow: str
    input: JSONObject
    max_attempts: int
    timeout_s: float | None
    detached: bool = False


class ChildrenRepo:
    """Child runs of parents: started fenced, joined, woken, cascaded."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db
        self._backend: Backend = db.backend

    async def start(
        self, fence: Fence, parent: Run, child: NewChild, *, max_children: int, max_depth: int
    ) -> Run:
        """Start ``child`` of the fence's run, or return the one started before under its key.

        Raises:
            LeaseLost: The fence no longer holds; nothing was written.
            CancelRequested: The parent's cancel is recorded; nothing was written.
            ChildLimitExceeded: ``max_children`` children exist already, or the child would
                be deeper than ``max_depth``; nothing was written.
        """
        [started] = await self.start_many(
            fence, parent, [child], max_children=max_children, max_depth=max_depth
        )
        return started

    async def start_many(
        self,
        fence: Fence,
        parent: Run,
        children: Sequence[NewChild],
        *,
        max_children: int,
        max_depth: int,
    ) -> builtins.list[Run]:
        """Start ``children`` (keys unique) in one transaction; the ones started before return.

        A fan-out is one transaction, not one per child: the parent's row (the fence) is
        locked once, the keys are looked up in one read, and the new children and their
        events are inserted together.

        Raises:
            LeaseLost, CancelRequested, ChildLimitExceeded: As :meth:`start`; nothing written.
        """
        keys = [child.key for child in children]
        if len(set(keys)) != len(keys):
            raise ValueError("child keys must be unique within one call")

        async def attempt() -> builtins.list[Run]:
            async with self._db.write_transaction() as conn:
                action = f"{len(children)} children"
                await hold_fence_txn(conn, self._backend.name, fence, action, refuse_cancelled=True)
                found = await self._children_txn(conn, parent.run_id, keys)
                new = [child for child in children if child.key not in found]
                if new:
                    inserted = await self._insert_txn(
                        conn, fence, parent, new, max_children, max_depth
                    )
                    found.update((run.child_key or "", run) for run in inserted)
                return [found[key] for key in keys]

        return await self._db.with_retry(attempt)

    async def _children_txn(
        self, conn: AsyncConnection, parent_id: str, keys: builtins.list[str]
    ) -> dict[str, Run]:
        found: dict[str, Run] = {}
        for offset in range(0, len(keys), 500):
            stmt = select(runs).where(
                runs.c.parent_run_id == parent_id, runs.c.child_key.in_(keys[offset : offset + 500])
            )
            for row in (await conn.execute(stmt)).mappings():
                found[row["child_key"]] = run_from_row(row)
        return found

    async def _insert_txn(
        self,
        conn: AsyncConnection,
        fence: Fence,
        parent: Run,
        children: builtins.list[NewChild],
        max_children: int,
        max_depth: int,
    ) -> builtins.list[Run]:
        depth = parent.depth + 1
        if depth > max_depth:
            raise ChildLimitExceeded(
                f"run {parent.run_id} is at depth {parent.depth}: a child would be deeper than "
                f"the limit of {max_depth}"
            )
        count = select(func.count()).where(runs.c.parent_run_id == parent.run_id)
        started = int((await conn.execute(count)).scalar_one())
        if started + len(children) > max_children:
            raise ChildLimitExceeded(
                f"run {parent.run_id} already started {started} children; {len(children)} more "
                f"would pass its limit of {max_children}"
            )
        now: datetime = (await conn.execute(self._backend.select_now())).scalar_one()
        # A microsecond apart, in start order: listings and claims (FIFO) keep that order.
        rows = [
            self._row(parent, child, depth, now + timedelta(microseconds=index))
            for index, child in enumerate(children)
        ]
        for offset in range(0, len(rows), 200):
            await conn.execute(insert(runs), rows[offset : offset + 200])
        events: builtins.list[tuple[RunId, Attempt, str, JSONObject]] = [
            (RunId(row["id"]), Attempt(0), EVENT_QUEUED, {}) for row in rows
        ]
        events += [
            (
                fence.run_id,
                fence.attempt,
                EVENT_CHILD_STARTED,
                {"run_id": row["id"], "key": row["child_key"], "workflow": row["workflow"]},
            )
            for row in rows
        ]
        await append_events_txn(conn, self._backend.name, events, now=now)
        blank = dict.fromkeys(runs.c.keys())
        return [run_from_row({**blank, **row}) for row in rows]

    @staticmethod
    def _row(parent: Run, child: NewChild, depth: int, now: datetime) -> dict[str, Any]:
        return {
            "id": new_run_id(),
            "tenant_id": parent.tenant_id,
            "workflow": child.workflow,
            "status": RunStatus.QUEUED.value,
            "lane": parent.lane,
            "priority": parent.priority,
            "attempt": 0,
            "max_attempts": child.max_attempts,
            "not_before": now,
            "input_hash": hash_input(child.input),
            "input": child.input,
            "timeout_s": child.timeout_s,
            "created_at": now,
            "updated_at": now,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "resumes": 0,
            "parent_run_id": parent.run_id,
            "child_key": child.key,
            "depth": depth,
            "detached": int(child.detached),
            "awaited": 0,
            "emits": 0,
            # Made in the parent's attempt: the child's spans join the parent's trace.
            "trace_context": tracing.carrier(),
        }

    async def unfinished_count(self, parent_id: RunId, child_ids: Sequence[str]) -> int:
        """How many of the parent's children ``child_ids`` have not ended: one count query."""

        async def read() -> int:
            total = 0
            async with self._db.connect() as conn:
                for offset in range(0, len(child_ids), 500):
                    stmt = select(func.count()).where(
                        runs.c.parent_run_id == parent_id,
                        runs.c.id.in_(list(child_ids[offset : offset + 500])),
                        runs.c.status.not_in(_TERMINAL),
                    )
                    total += int((await conn.execute(stmt)).scalar_one())
            return total

        return await self._db.with_retry(read)

    async def get_many(self, parent_id: RunId, child_ids: Sequence[str]) -> builtins.list[Run]:
        """The parent's children with these ids, in no particular order."""

        async def read() -> builtins.list[Run]:
            found: builtins.list[Run] = []
            async with self._db.connect() as conn:
                for offset in range(0, len(child_ids), 500):
                    chunk = child_ids[offset : offset + 500]
                    stmt = select(runs).where(
                        runs.c.parent_run_id == parent_id, runs.c.id.in_(chunk)
                    )
                    rows = (await conn.execute(stmt)).mappings().all()
                    found.extend(run_from_row(row) for row in rows)
            return found

        return await self._db.with_retry(read)

    async def list(self, parent_id: RunId) -> builtins.list[Run]:
        """Every child of the parent, in the order they were started."""
        stmt = (
            select(runs)
            .where(runs.c.parent_run_id == parent_id)
            .order_by(runs.c.created_at, runs.c.id)
        )

        async def read() -> builtins.list[Run]:
            async with self._db.connect() as conn:
                rows = (await conn.execute(stmt)).mappings().all()
            return [run_from_row(row) for row in rows]

        return await self._db.with_retry(read)

    async def wake_parents(self, ended: builtins.list[Run]) -> set[str]:
        """Children ``ended`` reached a terminal status: wake their parents that wait for them.

        For each parent: its row is locked (as its park locks it), a ``child_finished`` event
        is written for each of these children, and a parent ``waiting`` for
        children none of which is left unfinished is re-queued.

        Returns:
            The lanes of the parents re-queued, to wake their workers.
        """
        by_parent: dict[str, builtins.list[Run]] = {}
        for child in ended:
            if child.parent_run_id is not None:
                by_parent.setdefault(child.parent_run_id, []).append(child)
        return await self._wake_each(by_parent)

    async def _wake_each(self, parents: dict[str, builtins.list[Run]]) -> set[str]:
        """:meth:`_wake_txn` for each parent (with its ended children), one transaction each."""
        lanes: set[str] = set()
        for parent_id, ended in parents.items():

            async def wake(
                parent_id: str = parent_id, ended: builtins.list[Run] = ended
            ) -> str | None:
                async with self._db.write_transaction() as conn:
                    return await self._wake_txn(conn, parent_id, ended)

            lane = await self._db.with_retry(wake)
            if lane is not None:
                lanes.add(lane)
        return lanes

    async def _wake_txn(
        self, conn: AsyncConnection, parent_id: str, ended: builtins.list[Run] | None = None
    ) -> str | None:
        row = await lock_wait_state_txn(conn, self._backend, parent_id)
        if row is None or row["status"] in _TERMINAL:
            return None
        if ended:
            finished: builtins.list[tuple[RunId, Attempt, str, JSONObject]] = [
                (
                    RunId(parent_id),
                    Attempt(row["attempt"]),
                    EVENT_CHILD_FINISHED,
                    {"run_id": c.run_id, "key": c.child_key, "status": c.status.value},
                )
                for c in ended
            ]
            await append_events_txn(conn, self._backend.name, finished)
        if row["status"] != _WAITING:
            return None
        waited: Any = row["waiting_for"] or {}
        if waited.get("kind") != WaitKind.CHILDREN.value:
            return None
        if await has_unfinished_awaited_txn(conn, parent_id):
            return None
        moved = await resume_txn(conn, self._backend, row, ResumeReason.CHILDREN)
        return None if moved is None else str(row["lane"])

    async def wake_ready_parents(self, *, limit: int = 500) -> set[str]:
        """Re-queue waiting parents none of whose awaited children is left (the backstop)."""
        child = runs.alias("child")
        pending = (
            select(child.c.id)
            .where(
                child.c.parent_run_id == runs.c.id,
                child.c.awaited == 1,
                child.c.status.not_in(_TERMINAL),
            )
            .exists()
        )
        awaiting = (
            select(child.c.id)
            .where(child.c.parent_run_id == runs.c.id, child.c.awaited == 1)
            .exists()
        )
        # wake_at is NULL for children waits only (see parking.NO_TIMER).
        stmt = (
            select(runs.c.id)
            .where(runs.c.status == _WAITING, runs.c.wake_at.is_(None), awaiting, ~pending)
            .limit(limit)
        )

        async def ready() -> builtins.list[str]:
            async with self._db.connect() as conn:
                return [str(i) for i in (await conn.execute(stmt)).scalars()]

        ready_ids = await self._db.with_retry(ready)
        return await self._wake_each({parent_id: [] for parent_id in ready_ids})

    async def unfinished_descendants(self, run_id: RunId) -> builtins.list[Run]:
        """Every descendant of ``run_id`` that has not ended, parents before their children."""
        found: builtins.list[Run] = []
        frontier = [str(run_id)]
        async with self._db.connect() as conn:
            while frontier:
                stmt = select(runs).where(runs.c.parent_run_id.in_(frontier[:500]))
                frontier = frontier[500:]
                rows = (await conn.execute(stmt)).mappings().all()
                for row in rows:
                    child = run_from_row(row)
                    frontier.append(child.run_id)
                    if not child.status.is_terminal:
                        found.append(child)
        return found

    async def orphans(self, *, limit: int = 500) -> builtins.list[Run]:
        """Unfinished attached children whose parent already ended (to be cancelled)."""
        parent = runs.alias("parent")
        stmt = (
            select(runs)
            .join(parent, parent.c.id == runs.c.parent_run_id)
            .where(
                # Children only (ix_runs_parent): top-level runs are never read.
                runs.c.parent_run_id.is_not(None),
                runs.c.detached == 0,
                runs.c.status.not_in(_TERMINAL),
                parent.c.status.in_(_TERMINAL),
            )
            .limit(limit)
        )

        async def read() -> builtins.list[Run]:
            async with self._db.connect() as conn:
                rows = (await conn.execute(stmt)).mappings().all()
            return [run_from_row(row) for row in rows]

        return await self._db.with_retry(read)
