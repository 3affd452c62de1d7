"""One attempt's step checkpoints: what its run recorded, read once, and the attempt's writes.

``ctx.step`` asks :class:`Checkpoints` whether to call a step's function or replay its output.
The attempt reads its run's steps once, at its first step (a first attempt has none to read),
and notes its own writes, so:

* a step read ``succeeded`` for the same call is replayed without a database trip;
* a step it has never seen is started by one fenced statement
  (:meth:`~moorline.db.repos.steps.StepsRepo.insert_new`), or, under a worker's lease, not
  until it has run ``step_start_after`` (:class:`DeferredStart`): one that returns sooner is
  recorded by one statement (:meth:`~moorline.db.repos.steps.StepsRepo.record`);
* everything else (a step in flight at a crash, a failed step, a changed call, a key the
  database compares as equal to another, a key replayed twice) goes through
  :meth:`~moorline.db.repos.steps.StepsRepo.start`, which decides under the run's row lock.

Outputs are kept only until their step is replayed, and the attempt's own outputs not at all: a
long run holds its steps' keys, not every result it ever produced.

What was read stays true while the attempt holds its lease: only the holder writes the run's
steps, and a finished step is never overwritten. Once the lease is lost, the next write (any
new step, any finish) raises ``LeaseLost``; replays until then write nothing and return what
was recorded, as they would have anyway.
"""

import asyncio
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

from moorline.db.repos.records import Fence
from moorline.db.repos.steps import StepsRepo
from moorline.db.repos.usage import Charge
from moorline.errors import CancelRequested
from moorline.types import JSONValue, StepStatus
from moorline.usage import StepUsage


@dataclass(frozen=True, slots=True, kw_only=True)
class Recorded:
    """A step read ``succeeded`` at the attempt's first step, kept until it is replayed."""

    function: str
    call_hash: str
    output: JSONValue
    usage: StepUsage


@dataclass(frozen=True, slots=True, kw_only=True)
class Started:
    """What :meth:`Checkpoints.start` decided.

    Attributes:
        replay: The step already succeeded for this call: return ``output``, do not call the
            function. Otherwise the step is running under this attempt: call it.
        output: The recorded output of a replay.
        usage: The model calls the replayed step made when it ran (what the replay saved).
    """

    replay: bool
    output: JSONValue = None
    usage: StepUsage = field(default_factory=dict)
    unwritten: int | None = None
    """Not None: the step is new and nothing is written yet (``start(..., defer=True)``); its
    ``seq``, for the :class:`DeferredStart` that writes it."""


RUN = Started(replay=False)


class Checkpoints:
    """The step checkpoints of one attempt (see the module docstring)."""

    def __init__(self, fence: Fence, steps: StepsRepo) -> None:
        self._fence = fence
        self._steps = steps
        # The first claim of a run comes before any of its steps: there is nothing to read.
        # (Were it wrong, insert_new would find the row and start() would decide.)
        self._keys: set[str] | None = set() if fence.attempt == 1 else None
        """Keys of the run's steps that have a row, as far as this attempt knows."""
        self._last_seq = 0
        """The largest step number (``seq``) of the run this attempt knows of: its new steps
        are numbered after it, in the order they start, with no read of the database."""
        self._replays: dict[str, Recorded] = {}

    async def start(
        self, key: str, function: str, call_hash: str, *, defer: bool = False
    ) -> Started:
        """Start step ``key`` for this call, or find it already succeeded for it.

        With ``defer``, a step the run has never recorded is not written: the answer carries
        its number (``unwritten``), and a :class:`DeferredStart` writes it.

        Raises:
            LeaseLost: The fence no longer holds; nothing was written.
            CancelRequested: The run's cancel is recorded; nothing was written.
            StepMismatch: The step already succeeded for a different call.
        """
        keys = await self._recorded_keys()
        if key not in keys:
            # Taken before the write: steps started together are numbered in call order.
            self._last_seq += 1
            seq = self._last_seq
            if defer:
                keys.add(key)
                return Started(replay=False, unwritten=seq)
            if await self._steps.insert_new(self._fence, key, function, call_hash, seq=seq):
                keys.add(key)
                return RUN
        elif (recorded := self._replays.get(key)) is not None and (
            recorded.function,
            recorded.call_hash,
        ) == (function, call_hash):
            del self._replays[key]
            return Started(replay=True, output=recorded.output, usage=recorded.usage)
        started = await self._steps.start(self._fence, key, function, call_hash)
        self._last_seq = max(self._last_seq, started.step.seq or 0)
        keys.add(key)
        if not started.replay:
            return RUN
        return Started(replay=True, output=started.step.output, usage=started.step.usage)

    async def replayed(self, key: str, function: str, call_hash: str) -> Started | None:
        """Step ``key``'s recorded output if it succeeded for this call, else None.

        Answered from what the attempt read (one read at its first step), never by a write:
        None sends the step through :meth:`start`, which decides everything else.
        """
        await self._recorded_keys()
        recorded = self._replays.get(key)
        if recorded is None or (recorded.function, recorded.call_hash) != (function, call_hash):
            return None
        del self._replays[key]
        return Started(replay=True, output=recorded.output, usage=recorded.usage)

    async def was_recorded(self, key: str) -> bool:
        """Whether step ``key`` has a row that an earlier attempt (or this one) wrote."""
        return key in await self._recorded_keys()

    async def write_start(
        self,
        key: str,
        function: str,
        call_hash: str,
        *,
        seq: int,
        elapsed_s: float,
        refuse: bool = True,
    ) -> bool:
        """Write the start of step ``key``, left unwritten by ``start(..., defer=True)``.

        Args:
            key: The step's key.
            function: The step function's name.
            call_hash: SHA-256 hex of the function name and its arguments.
            seq: The step's number, taken by :meth:`start`.
            elapsed_s: How long the function has run: the start is dated that long ago.
            refuse: Whether a recorded cancel refuses the write (CancelRequested).

        Returns:
            False when a row with the key exists: :meth:`start` decides.

        Raises:
            LeaseLost: The fence no longer holds; nothing was written.
            CancelRequested: With ``refuse``, the run's cancel is recorded; nothing was written.
        """
        return await self._steps.insert_new(
            self._fence,
            key,
            function,
            call_hash,
            seq=seq,
            elapsed_s=elapsed_s,
            refuse_cancelled=refuse,
        )

    async def record(
        self,
        key: str,
        function: str,
        call_hash: str,
        output: JSONValue,
        *,
        seq: int,
        elapsed_s: float,
        charge: Charge | None = None,
    ) -> bool:
        """Record step ``key``, never written, as succeeded; True when the cancel is recorded.

        Raises:
            LeaseLost: The fence no longer holds; nothing was written.
            StepMismatch: A recorded step's key compares as equal to this one's.
        """
        return await self._steps.record(
            self._fence,
            key,
            function,
            call_hash,
            output,
            seq=seq,
            elapsed_s=elapsed_s,
            charge=charge,
        )

    async def succeed(self, key: str, output: JSONValue, charge: Charge | None = None) -> None:
        """Record that step ``key`` (running under this attempt) returned ``output``.

        ``charge``, the model calls it made, is written in the same transaction.
        """
        await self._steps.succeed(self._fence, key, output, charge=charge)

    async def fail(self, key: str, error: str, charge: Charge | None = None) -> None:
        """Record that step ``key`` (running under this attempt) raised ``error``."""
        await self._steps.fail(self._fence, key, error, charge=charge)

    async def _recorded_keys(self) -> set[str]:
        if self._keys is None:
            recorded = await self._steps.list(self._fence.run_id)
            self._keys = {step.key for step in recorded}
            self._last_seq = max((step.seq or 0 for step in recorded), default=0)
            self._replays = {
                step.key: Recorded(
                    function=step.function,
                    call_hash=step.call_hash,
                    output=step.output,
                    usage=step.usage,
                )
                for step in recorded
                if step.status is StepStatus.SUCCEEDED
            }
        return self._keys


class DeferredStart:
    """A new step whose start is written only if its function outlasts ``after_s``.

    A step that returns sooner is recorded succeeded by one statement
    (:meth:`~moorline.db.repos.steps.StepsRepo.record`) instead of a start and a finish. What
    the start write guarded before the call is kept where it matters: the function is called
    only while the worker's self-fence vouches for the lease, every write stays fenced, and a
    recorded cancel is found by the first write (the record, or the start written late), which
    refuses and then writes anyway, since the function has run, and reports the cancel
    (``on_cancel``): after a cancel whose signal the runtime store lost, at most this one step
    runs (docs/reliability.md E8).
    """

    def __init__(
        self,
        checkpoints: Checkpoints,
        key: str,
        function: str,
        call_hash: str,
        *,
        seq: int,
        after_s: float,
        on_cancel: Callable[[], None],
        alone: Callable[[], AbstractAsyncContextManager[None]],
    ) -> None:
        """Call the step's function right after this.

        Args:
            checkpoints: The attempt's checkpoints.
            key: The step's key.
            function: The step function's name.
            call_hash: SHA-256 hex of the function name and its arguments.
            seq: The step's number, taken by ``Checkpoints.start(..., defer=True)``.
            after_s: Seconds the function may run before its start is written.
            on_cancel: Called when a write finds the run's cancel recorded.
            alone: Keeps the attempt's other writes (its buffered events) out while the start
                is written, so that an attempt holds one database connection at a time.
        """
        self._checkpoints = checkpoints
        self._alone = alone
        self._key, self._function, self._call_hash, self._seq = key, function, call_hash, seq
        self._on_cancel = on_cancel
        loop = asyncio.get_running_loop()
        self._called = loop.time()
        self._writing: asyncio.Task[None] | None = None
        self._timer = loop.call_later(after_s, self._write_start_soon)

    async def succeed(self, output: JSONValue, charge: Charge | None = None) -> None:
        """Record that the step returned ``output`` (and ``charge``, the calls it made).

        Raises:
            LeaseLost: The fence no longer holds; nothing was written.
            StepMismatch: A recorded step's key compares as equal to this one's.
        """
        if await self._started():
            await self._checkpoints.succeed(self._key, output, charge)
            return
        cancelled = await self._checkpoints.record(
            self._key,
            self._function,
            self._call_hash,
            output,
            seq=self._seq,
            elapsed_s=self._elapsed_s(),
            charge=charge,
        )
        if cancelled:
            self._on_cancel()

    async def ensure_started(self) -> None:
        """Write the start now if it is not written (before the step's failure is).

        Raises:
            LeaseLost: The fence no longer holds; nothing was written.
        """
        if not await self._started():
            await self._write_start()

    def close(self) -> None:
        """Drop the timer, and a start write still in flight (the attempt is stopping)."""
        self._timer.cancel()
        if self._writing is not None and not self._writing.done():
            self._writing.cancel()

    def _elapsed_s(self) -> float:
        return asyncio.get_running_loop().time() - self._called

    def _write_start_soon(self) -> None:
        self._writing = asyncio.create_task(self._write_start_alone())

    async def _write_start_alone(self) -> None:
        async with self._alone():
            await self._write_start()

    async def _write_start(self) -> None:
        key, function, call_hash, seq = self._key, self._function, self._call_hash, self._seq
        try:
            written = await self._checkpoints.write_start(
                key, function, call_hash, seq=seq, elapsed_s=self._elapsed_s()
            )
        except CancelRequested:
            # The function runs already: its start is written all the same, the cancel seen.
            self._on_cancel()
            written = await self._checkpoints.write_start(
                key, function, call_hash, seq=seq, elapsed_s=self._elapsed_s(), refuse=False
            )
        if not written:
            # A row with this key after all: start() decides under the run's lock.
            await self._checkpoints.start(key, function, call_hash)

    async def _started(self) -> bool:
        """Whether the start is written: the timer is stopped, or the write it began awaited."""
        self._timer.cancel()
        if self._writing is None:
            return False
        await self._writing
        return True
