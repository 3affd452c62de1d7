"""One attempt's step checkpoints: what its run recorded, read once, and the attempt's writes.

``ctx.step`` asks :class:`Checkpoints` whether to call a step's function or replay its output.
The attempt reads its run's steps once, at its first step (a first attempt has none to read),
and notes its own writes, so:

* a step read ``succeeded`` for the same call is replayed without a database trip;
* a step it has never seen is started by one fenced statement
  (:meth:`~moorline.db.repos.steps.StepsRepo.insert_new`) and finished by another, unless it
  follows a checkpoint closely (see "One write a step" below): then it runs at once and is
  recorded, finished, by one (:meth:`~moorline.db.repos.steps.StepsRepo.finish_new`);
* everything else (a step in flight at a crash, a failed step, a changed call, a key the
  database compares as equal to another, a key replayed twice) goes through
  :meth:`~moorline.db.repos.steps.StepsRepo.start`, which decides under the run's row lock.

Outputs are kept only until their step is replayed, and the attempt's own outputs not at all: a
long run holds its steps' keys, not every result it ever produced.

What was read stays true while the attempt holds its lease: only the holder writes the run's
steps, and a finished step is never overwritten. Once the lease is lost, the next write (any
new step, any finish) raises ``LeaseLost``; replays until then write nothing and return what
was recorded, as they would have anyway.

**One write a step.** A step's ``running`` row, written before its function runs, is the
database's word that the attempt still holds the run (invariant 2) and that no cancel is
recorded (D3) at that moment. Every step write makes the same two checks, in the same
statement, on the run's locked row; so when a step starts right after such a write, that
write's answer is as recent as a ``running`` row's would be, and the step skips it:

* *When.* :meth:`Checkpoints.is_checked`, asked as ``ctx.step`` begins: the attempt's last
  write (a start, a finish) found the fence holding and no cancel, the workflow has not yielded
  to the event loop since (a callback scheduled with the write expires it at the first
  yield), and at most :data:`FRESH_CHECK_S` passed. A workflow that awaits anything between
  two steps (a sleep, a request, an event) gets a ``running`` row for the next, as before; so
  does the attempt's first step. A tight loop of steps pays one write a step.
* *Fencing and cancellation.* The checks such a step relies on are at most
  :data:`FRESH_CHECK_S` old, with nothing awaited since; a ``running`` row's would be younger
  by that much. A lease lost or a cancel recorded in between is found by the step's own
  insert after its function ran, not before it (nothing is written for a lost lease). That is
  the same kind of gap a ``running`` row leaves between its commit and the function's call,
  which a paused process stretches just as much: a pause before the decision makes the check
  too old. A cancel found by any finish keeps the outcome (as a step running at a cancel
  keeps it) and the attempt raises ``Cancelled`` at the next step, so each step still meets
  the database's cancel check before its function runs, in its start or its predecessor's
  finish.
* *Crash and replay* (invariant 3, RELIABILITY.md E1/E4). A step is replayed only from a
  ``succeeded`` row, committed before ``ctx.step`` returns exactly as the ``UPDATE`` to
  ``succeeded`` was. A crash while the function runs or before the insert commits leaves no
  row instead of a ``running`` one; either way the next attempt finds the step unfinished and
  runs it again, with the same idempotency key (``"<run id>:<key>"``, no attempt in it). An
  insert whose acknowledgement was lost is retried and recognises its own row (E6).
* *Non-determinism* (E3). The ``succeeded`` row carries the function and call hash; replays
  compare them as before, and only a key the attempt has never seen takes this path. A key
  the database may compare as equal to a known one (MySQL/MariaDB collations, see
  :func:`_folded`) takes the ``running`` row path, so it is refused before its function runs;
  one this folding misses is refused by the insert with the same ``StepMismatch``.
* *Per-step retries.* A failed try is inserted ``failed`` under the attempt; the retry comes
  after a pause (a yield), takes the row over through
  :meth:`~moorline.db.repos.steps.StepsRepo.start` and finishes it there.

What changes is visibility: such a step appears in ``GET /v1/runs/{id}`` only once finished,
its ``started_at`` the time it was recorded. No event is written for steps either way.
"""

import asyncio
import unicodedata
from dataclasses import dataclass

from moorline.db.repos.records import Fence
from moorline.db.repos.steps import Finish, StepsRepo
from moorline.types import JSONValue, StepStatus


@dataclass(frozen=True, slots=True, kw_only=True)
class Recorded:
    """A step read ``succeeded`` at the attempt's first step, kept until it is replayed."""

    function: str
    call_hash: str
    output: JSONValue


@dataclass(frozen=True, slots=True, kw_only=True)
class Started:
    """What :meth:`Checkpoints.start` decided.

    Attributes:
        replay: The step already succeeded for this call: return ``output``, do not call the
            function. Otherwise the step is running under this attempt: call it.
        output: The recorded output of a replay.
    """

    replay: bool
    output: JSONValue = None
    recorded: bool = True
    """Whether the step has a row (``running`` under this attempt) to finish; when not, its
    outcome is recorded by one insert (:meth:`Checkpoints.succeed`)."""


RUN = Started(replay=False)
UNRECORDED = Started(replay=False, recorded=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Finished:
    """What :meth:`Checkpoints.succeed` and :meth:`Checkpoints.fail` recorded.

    Attributes:
        output: What ``ctx.step`` returns (the step's output, or, when a row for the call was
            found already succeeded, the recorded one).
        cancel_recorded: The run's cancel was found recorded: start nothing more.
    """

    output: JSONValue = None
    cancel_recorded: bool = False


FRESH_CHECK_S = 0.01
"""How long, in seconds, the fence and cancel checks of a checkpoint stand in for the next
step's own: only while the workflow has not awaited anything since (see the module
docstring)."""


def _folded(key: str) -> str:
    """``key`` as case- and accent-insensitive collations (MySQL/MariaDB) compare it."""
    decomposed = unicodedata.normalize("NFKD", key)
    bare = "".join(char for char in decomposed if not unicodedata.combining(char))
    return bare.casefold().rstrip(" ")


class Checkpoints:
    """The step checkpoints of one attempt (see the module docstring)."""

    def __init__(self, fence: Fence, steps: StepsRepo) -> None:
        self._fence = fence
        self._steps = steps
        # The first claim of a run comes before any of its steps: there is nothing to read.
        # (Were it wrong, insert_new or finish_new would find the row and start() decide.)
        self._keys: set[str] | None = set() if fence.attempt == 1 else None
        """Keys of the run's steps that have a row, as far as this attempt knows."""
        self._replays: dict[str, Recorded] = {}
        self._folded: set[str] = set()
        """:func:`_folded` of every key in ``_keys``."""
        self._checked_at: float | None = None
        """Loop time of the last write that found the fence holding and no cancel recorded;
        None once the workflow awaited anything after it."""
        self._checks = 0

    def is_checked(self) -> bool:
        """Whether a step starting now may rely on the last checkpoint's fence and cancel checks.

        Ask before the step awaits anything: true only while the workflow has not yielded to
        the event loop since that checkpoint, and for at most :data:`FRESH_CHECK_S`.
        """
        if self._checked_at is None:
            return False
        return asyncio.get_running_loop().time() - self._checked_at <= FRESH_CHECK_S

    async def start(self, key: str, function: str, call_hash: str, *, checked: bool) -> Started:
        """Start step ``key`` for this call, or find it already succeeded for it.

        Args:
            key: The step key.
            function: The step function's name.
            call_hash: The call's hash.
            checked: :meth:`is_checked`, asked as the step began: a step never recorded may
                then run without a ``running`` row (:data:`UNRECORDED`).

        Raises:
            LeaseLost: The fence no longer holds; nothing was written.
            CancelRequested: The run's cancel is recorded; nothing was written.
            StepMismatch: The step already succeeded for a different call.
        """
        keys = await self._recorded_keys()
        folded = _folded(key)
        if key not in keys:
            if checked and folded not in self._folded:
                self._note(key, folded)
                return UNRECORDED
            if await self._steps.insert_new(self._fence, key, function, call_hash):
                self._note(key, folded)
                self._checked()
                return RUN
        elif (recorded := self._replays.get(key)) is not None and (
            recorded.function,
            recorded.call_hash,
        ) == (function, call_hash):
            del self._replays[key]
            return Started(replay=True, output=recorded.output)
        started = await self._steps.start(self._fence, key, function, call_hash)
        self._note(key, folded)
        self._checked()
        return Started(replay=True, output=started.step.output) if started.replay else RUN

    async def succeed(
        self, key: str, started: Started, function: str, call_hash: str, output: JSONValue
    ) -> Finished:
        """Record that step ``key``, started as ``started``, returned ``output``.

        Raises:
            LeaseLost: The fence no longer holds; nothing was written.
            StepMismatch: The key collides with a recorded step of another call.
        """
        if started.recorded:
            found = await self._steps.succeed(self._fence, key, output)
        else:
            found = await self._steps.finish_new(
                self._fence, key, function, call_hash, StepStatus.SUCCEEDED, output
            )
            if found is Finish.EXISTS:
                return await self._judge(key, function, call_hash, StepStatus.SUCCEEDED, output)
        return self._finished(found, output)

    async def fail(
        self, key: str, started: Started, function: str, call_hash: str, error: str
    ) -> Finished:
        """Record that step ``key``, started as ``started``, raised ``error``.

        Raises:
            LeaseLost: The fence no longer holds; nothing was written.
            StepMismatch: The key collides with a recorded step of another call.
        """
        if started.recorded:
            found = await self._steps.fail(self._fence, key, error)
        else:
            found = await self._steps.finish_new(
                self._fence, key, function, call_hash, StepStatus.FAILED, error
            )
            if found is Finish.EXISTS:
                return await self._judge(key, function, call_hash, StepStatus.FAILED, error)
        return self._finished(found, error)

    async def _judge(
        self, key: str, function: str, call_hash: str, status: StepStatus, outcome: JSONValue
    ) -> Finished:
        """Record a step that ran unrecorded and whose key turned out to have a row.

        start() judges the row: a colliding key raises StepMismatch, the same call recorded
        succeeded is returned, a row left running or failed is taken over and this outcome
        recorded on it.
        """
        found = await self._steps.start(self._fence, key, function, call_hash)
        if found.replay:
            return Finished(output=found.step.output)
        if status is StepStatus.SUCCEEDED:
            await self._steps.succeed(self._fence, key, outcome)
        else:
            assert isinstance(outcome, str)
            await self._steps.fail(self._fence, key, outcome)
        return Finished(output=outcome)

    def _finished(self, found: Finish, outcome: JSONValue) -> Finished:
        if found is Finish.CHECKED:
            self._checked()
        return Finished(output=outcome, cancel_recorded=found is Finish.AFTER_CANCEL)

    def _checked(self) -> None:
        """A write just found the fence holding and no cancel recorded (see is_checked)."""
        loop = asyncio.get_running_loop()
        self._checks += 1
        self._checked_at = loop.time()
        # Runs as soon as the workflow yields to the loop: it awaited something else.
        loop.call_soon(self._expire, self._checks)

    def _expire(self, check: int) -> None:
        if check == self._checks:
            self._checked_at = None

    def _note(self, key: str, folded: str) -> None:
        assert self._keys is not None
        self._keys.add(key)
        self._folded.add(folded)

    async def _recorded_keys(self) -> set[str]:
        if self._keys is None:
            recorded = await self._steps.list(self._fence.run_id)
            self._keys = {step.key for step in recorded}
            self._folded = {_folded(step.key) for step in recorded}
            self._replays = {
                step.key: Recorded(
                    function=step.function, call_hash=step.call_hash, output=step.output
                )
                for step in recorded
                if step.status is StepStatus.SUCCEEDED
            }
        return self._keys
