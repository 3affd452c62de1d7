"""Child runs from a workflow: ``ctx.start_child``, ``ctx.join``, ``ctx.gather``, ``ctx.map``.

A child is a run of its own (any worker may claim it), started durably by the parent's
attempt: ``(parent, key)`` is unique, so a parent replayed after a crash gets the child it
started, never a second one, and no checkpoint is needed beside the child's row. Joining reads
the children's statuses; while some have not ended the parent waits in memory for
``park_after`` seconds, then parks (``waiting`` for ``children``, holding no slot) until the
last awaited child ends. A child that ended while the parent executed is seen without parking.
A joined child's output is read from its run, which no longer changes once it ended, so a
replayed join returns what the first one returned.

An in-memory join reads its children every ``JOIN_POLL_S``; once few are left
(``LOCAL_WAKE_BELOW``), a child ending in the same process wakes it at once
(:class:`ChildEnds`, which the worker tells after writing each batch of ends), so the parent
resumes without waiting out the poll. Ends elsewhere are seen by the poll.

``Children`` is a base class of :class:`~moorline.engine.context.Context`, kept in its own
module as :class:`~moorline.engine.waits.Waits` is.
"""

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from moorline.db.repos.children import ChildrenRepo, NewChild
from moorline.db.repos.parking import Wait, WaitKind
from moorline.db.repos.records import Fence, Run
from moorline.engine.registry import Moorline
from moorline.errors import ChildFailed, InvalidInput
from moorline.types import JSONObject, JSONValue, RunId, RunStatus

T = TypeVar("T")

DEFAULT_MAX_CHILDREN = 1_000
"""Children one run may start (a workflow's ``max_children``)."""

DEFAULT_MAX_DEPTH = 5
"""How deep children may nest below a top-level run."""

MAP_BATCH = 500
"""Children ``ctx.map`` starts in one transaction."""

JOIN_POLL_S = 0.05
"""How often an in-memory join reads its children's statuses, in seconds."""

LOCAL_WAKE_BELOW = 64
"""Unfinished children at or under which each end in this process wakes the join: above, the
poll's reads are enough (a wake per end would read the count once per child)."""


class ChildEnds:
    """The parents joining in memory in this process, woken when their children end here."""

    def __init__(self) -> None:
        self._joining: dict[str, asyncio.Event] = {}

    @contextlib.contextmanager
    def joining(self, parent_id: str) -> Iterator[asyncio.Event]:
        """An event set whenever a child of ``parent_id`` ends in this process, while held."""
        event = self._joining.setdefault(parent_id, asyncio.Event())
        try:
            yield event
        finally:
            self._joining.pop(parent_id, None)

    def ended(self, parent_ids: Iterable[str]) -> None:
        """Children of these parents ended (their outcomes are written): wake the joins."""
        for parent_id in parent_ids:
            event = self._joining.get(parent_id)
            if event is not None:
                event.set()


@dataclass(frozen=True, slots=True)
class ChildHandle:
    """A child run started by ``ctx.start_child``; ``await handle.result()`` joins it."""

    run_id: RunId
    key: str
    workflow: str
    _ctx: "Children"

    async def result(self) -> JSONValue:
        """The child's output once it ended; ``ChildFailed`` if it did not succeed."""
        return await self._ctx.join(self)


class Children:
    """Starting and joining child runs (a base of ``Context``)."""

    # Set by Context.__init__.
    _fence: Fence
    _run: Run
    _children: ChildrenRepo | None
    _workflows: Moorline | None
    _max_children: int
    _on_enqueued: Callable[[set[str]], object] | None
    _child_ends: ChildEnds | None
    _park_after_s: float

    if TYPE_CHECKING:
        # Provided by the class these are mixed into; declared for the type checker only,
        # so no stub here can shadow the real method in the MRO.
        async def _fenced(self, write: Coroutine[Any, Any, T]) -> T:
            raise NotImplementedError

        async def _check_boundary(self) -> None:
            raise NotImplementedError

        async def _pause(self, delay_s: float) -> None:
            raise NotImplementedError

        async def _park(self, wait: Wait) -> None:
            raise NotImplementedError

    async def start_child(
        self, workflow: str, input: JSONObject, *, key: str, detached: bool = False
    ) -> ChildHandle:
        """Start a child run of ``workflow``, once per ``key`` for this run.

        Args:
            workflow: The child's workflow (this worker's app must have it).
            input: Its arguments by parameter name, validated as a trigger's are.
            key: The child's key among this run's children (``f"section:{i}"`` in loops).
            detached: The child outlives this run's failure or timeout; a cancel of this run
                still cancels it.

        Raises:
            WorkflowNotFound: No workflow ``workflow`` here.
            InvalidInput: ``input`` does not fit the workflow's parameters.
            ChildLimitExceeded: Past the workflow's ``max_children`` or the depth limit.
            Cancelled: The run was cancelled.
        """
        [handle] = await self._start_children([(workflow, input, key)], detached=detached)
        return handle

    async def _start_children(
        self, specs: Sequence[tuple[str, JSONObject, str]], *, detached: bool = False
    ) -> list[ChildHandle]:
        """Start children ``(workflow, input, key)`` in one fenced transaction."""
        await self._check_boundary()
        if self._workflows is None or self._children is None:
            raise RuntimeError("this context cannot start child runs (built without them)")
        new = []
        for workflow, child_input, key in specs:
            if not key:
                raise InvalidInput("ctx.start_child: key must not be empty")
            definition = self._workflows.get(workflow)
            new.append(
                NewChild(
                    key=key,
                    workflow=workflow,
                    input=definition.validate_input(child_input),
                    max_attempts=definition.max_attempts,
                    timeout_s=definition.timeout_s,
                    detached=detached,
                )
            )
        started = await self._fenced(
            self._children.start_many(
                self._fence,
                self._run,
                new,
                max_children=self._max_children,
                max_depth=DEFAULT_MAX_DEPTH,
            )
        )
        if started and self._on_enqueued is not None:
            # The children wait in the parent's lane: wake its workers now, not at their poll.
            self._on_enqueued({self._run.lane})
        return [
            ChildHandle(child.run_id, child.child_key or "", child.workflow, self)
            for child in started
        ]

    async def join(self, handle: ChildHandle) -> JSONValue:
        """``handle``'s output once the child ended (the run parks if that takes long).

        Raises:
            ChildFailed: The child ended ``failed``, ``cancelled`` or ``timed_out``.
            RunParked: The run parked until the child ends; let it through.
        """
        [output] = await self.gather(handle)
        return output

    @overload
    async def gather(
        self, *handles: ChildHandle, return_exceptions: Literal[False] = False
    ) -> list[JSONValue]: ...

    @overload
    async def gather(
        self, *handles: ChildHandle, return_exceptions: bool
    ) -> list[JSONValue | ChildFailed]: ...

    async def gather(
        self, *handles: ChildHandle, return_exceptions: bool = False
    ) -> list[JSONValue] | list[JSONValue | ChildFailed]:
        """The outputs of ``handles``, in order, once every one ended.

        Args:
            *handles: The children to wait for.
            return_exceptions: Return a child's ``ChildFailed`` in its place instead of
                raising the first one.

        Raises:
            ChildFailed: A child did not succeed (unless ``return_exceptions``).
            RunParked: The run parked until the children end; let it through.
        """
        await self._check_boundary()
        ids = [handle.run_id for handle in handles]
        parked_once = False
        while True:
            ended = await self._ended(ids)
            if ended is not None:
                return self._outcomes(handles, ended, return_exceptions)
            if parked_once:
                await self._pause(JOIN_POLL_S)
                continue
            if await self._poll_children(ids, self._park_after_s):
                continue
            parked_once = True
            await self._park(Wait(kind=WaitKind.CHILDREN, until=None, children=tuple(ids)))

    @overload
    async def map(
        self,
        workflow: str,
        inputs: Iterable[JSONObject],
        *,
        key: str | Callable[[int, JSONObject], str],
        return_exceptions: Literal[False] = False,
    ) -> list[JSONValue]: ...

    @overload
    async def map(
        self,
        workflow: str,
        inputs: Iterable[JSONObject],
        *,
        key: str | Callable[[int, JSONObject], str],
        return_exceptions: bool,
    ) -> list[JSONValue | ChildFailed]: ...

    async def map(
        self,
        workflow: str,
        inputs: Iterable[JSONObject],
        *,
        key: str | Callable[[int, JSONObject], str],
        return_exceptions: bool = False,
    ) -> list[JSONValue] | list[JSONValue | ChildFailed]:
        """Start a child of ``workflow`` per input, then gather them (fan-out and join).

        Args:
            workflow: The children's workflow.
            inputs: One child's arguments each.
            key: A prefix (child ``i`` is ``f"{key}:{i}"``) or a function of ``(i, input)``.
            return_exceptions: As for :meth:`gather`.
        """
        specs = [
            (workflow, child_input, key(index, child_input) if callable(key) else f"{key}:{index}")
            for index, child_input in enumerate(inputs)
        ]
        handles: list[ChildHandle] = []
        for offset in range(0, len(specs), MAP_BATCH):
            handles += await self._start_children(specs[offset : offset + MAP_BATCH])
        return await self.gather(*handles, return_exceptions=return_exceptions)

    async def _ended(self, ids: list[RunId]) -> dict[str, Run] | None:
        """The children by id when every one ended; None while one has not."""
        ended, _ = await self._read_children(ids)
        return ended

    async def _read_children(self, ids: list[RunId]) -> tuple[dict[str, Run] | None, int]:
        """The children by id when every one ended, else None; and how many have not."""
        if self._children is None:
            raise RuntimeError("this context cannot join child runs (built without them)")
        # A count while some run, the rows (their outputs) once all ended: a join of 1,000
        # children polled in memory reads a number, not 1,000 rows, each time.
        unfinished = await self._children.unfinished_count(self._fence.run_id, ids)
        if unfinished:
            return None, unfinished
        children = await self._children.get_many(self._fence.run_id, ids)
        found: dict[str, Run] = {run.run_id: run for run in children}
        for run_id in ids:
            child = found.get(run_id)
            if child is None:
                raise ChildFailed(run_id, "missing", "no such child of this run")
            if not child.status.is_terminal:
                return None, 1
        return found, 0

    async def _poll_children(self, ids: list[RunId], window_s: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + window_s
        unfinished = len(ids)
        with contextlib.ExitStack() as stack:
            ends = self._child_ends
            ended = None if ends is None else stack.enter_context(ends.joining(self._fence.run_id))
            while (left_s := deadline - loop.time()) > 0:
                if ended is not None and unfinished <= LOCAL_WAKE_BELOW:
                    await self._pause_until_set(ended, min(left_s, JOIN_POLL_S))
                    # Cleared before the read: an end written after it sets the event again.
                    ended.clear()
                else:
                    await self._pause(min(left_s, JOIN_POLL_S))
                found, unfinished = await self._read_children(ids)
                if found is not None:
                    return True
        return False

    async def _pause_until_set(self, event: asyncio.Event, delay_s: float) -> None:
        """:meth:`_pause` (a cancel ends it) that also ends when ``event`` is set."""
        if event.is_set():
            return
        woken = asyncio.ensure_future(event.wait())
        paused = asyncio.ensure_future(self._pause(delay_s))
        try:
            await asyncio.wait((woken, paused), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (woken, paused):
                task.cancel()
            await asyncio.gather(woken, paused, return_exceptions=True)
        if paused.done() and not paused.cancelled():
            paused.result()  # raises Cancelled when the pause found the run cancelled

    @staticmethod
    def _outcomes(
        handles: Sequence[ChildHandle], ended: dict[str, Run], return_exceptions: bool
    ) -> list[JSONValue | ChildFailed]:
        outcomes: list[JSONValue | ChildFailed] = []
        for handle in handles:
            run = ended[handle.run_id]
            if run.status is RunStatus.SUCCEEDED:
                outcomes.append(run.output)
                continue
            failure = ChildFailed(run.run_id, run.status.value, run.error)
            if not return_exceptions:
                raise failure
            outcomes.append(failure)
        return outcomes
