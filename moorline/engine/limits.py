"""Stopping an attempt from outside its workflow: time limits and the cancel grace period.

A workflow is ordinary ``async`` code, so Moorline can act on it only at its ``await``s. An
:class:`AttemptGuard` runs one attempt's workflow and stops it in three ways, all timed on the
worker's monotonic clock (the event loop's ``loop.time()``) from the attempt's start, so that
neither a wall-clock jump nor another machine's clock moves them:

* **soft time limit** — :class:`~moorline.errors.SoftTimeLimitExceeded` is raised inside the
  workflow, once, at the ``await`` it is suspended in; the workflow may catch it and clean up.
* **hard time limit** — the workflow is cancelled at its current ``await`` (an
  ``asyncio.CancelledError``, as under ``asyncio.timeout``) and the attempt raises
  :class:`~moorline.errors.TimeLimitExceeded`, even if the workflow swallowed the cancellation.
* **cancel grace** — :meth:`AttemptGuard.cancel_after` gives a cancelled run's workflow some
  seconds to reach one of its own checks (which raise ``Cancelled`` there); after them it is
  cancelled outright the same way, and the attempt raises the error it was given.

asyncio can cancel a task but cannot raise an arbitrary exception in it. The workflow's
coroutine is therefore driven through :class:`_Interruptible`, a transparent awaitable that
passes every value and exception between the task and the coroutine. To raise the soft limit,
the guard cancels the task; the wrapper receives that ``CancelledError`` at its ``yield``, takes
the cancellation back (``Task.uncancel``) and throws ``SoftTimeLimitExceeded`` into the
coroutine instead. Whatever the workflow was awaiting is cancelled, exactly as under
``asyncio.timeout``. A cancellation requested by anyone else (a lost lease, a shutdown) shows in
``Task.cancelling()`` and always passes through unchanged.
"""

import asyncio
import math
from collections.abc import Coroutine, Generator
from typing import Any, Generic, TypeVar

from moorline.errors import SoftTimeLimitExceeded, TimeLimitExceeded

T = TypeVar("T")


class AttemptGuard:
    """Runs one attempt's workflow under its time limits, and stops it after a cancel's grace.

    Args:
        hard_limit_s: Seconds after which the attempt ends ``timed_out``.
        soft_limit_s: Seconds after which ``SoftTimeLimitExceeded`` is raised in the workflow;
            None (or not below the hard limit) for none.
    """

    def __init__(self, *, hard_limit_s: float, soft_limit_s: float | None = None) -> None:
        for name, value in (("hard_limit_s", hard_limit_s), ("soft_limit_s", soft_limit_s)):
            if value is not None and not (value > 0 and not math.isnan(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        self._hard_limit_s = hard_limit_s
        self._soft_limit_s = soft_limit_s
        self._task: asyncio.Task[Any] | None = None
        self._baseline = 0
        """``Task.cancelling()`` when the guard started: cancellations from before are not ours."""
        self._owed = 0
        """Cancellations the guard requested and has not taken back yet."""
        self._handles: list[asyncio.TimerHandle] = []
        self._grace: tuple[float, BaseException] | None = None
        self._injection: BaseException | None = None
        self._stop: BaseException | None = None

    @property
    def stop_error(self) -> BaseException | None:
        """What the attempt raises because the guard stopped it; None while it has not."""
        return self._stop

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` in the current task under the limits.

        Returns:
            What ``coro`` returned.

        Raises:
            TimeLimitExceeded: The hard limit stopped the workflow (whatever it raised then).
            BaseException: The error given to :meth:`cancel_after`, when the grace expired.
            Exception: Whatever ``coro`` raised otherwise, ``SoftTimeLimitExceeded`` included.
        """
        task = asyncio.current_task()
        if task is None or self._task is not None:
            coro.close()
            raise RuntimeError("an AttemptGuard runs one coroutine, inside a task")
        self._task = task
        self._baseline = task.cancelling()
        loop = asyncio.get_running_loop()
        started = loop.time()
        self._handles.append(loop.call_at(started + self._hard_limit_s, self._halt_at_hard_limit))
        soft_s = self._soft_limit_s
        if soft_s is not None and soft_s < self._hard_limit_s:
            self._handles.append(loop.call_at(started + soft_s, self._raise_soft_limit, soft_s))
        if self._grace is not None:
            self._arm_grace(*self._grace)
        try:
            result = await _Interruptible(coro, self)
        except BaseException as exc:
            foreign = self._settle()
            if self._stop is None or (foreign and isinstance(exc, asyncio.CancelledError)):
                raise
            raise self._stop from exc
        finally:
            for handle in self._handles:
                handle.cancel()
        if self._settle() or self._stop is None:
            return result
        # The workflow swallowed the cancellation and returned: it is stopped all the same.
        raise self._stop

    def cancel_after(self, grace_s: float, error: BaseException) -> None:
        """Cancel the workflow outright in ``grace_s`` seconds; the attempt then raises ``error``.

        Only the first call counts. Called before :meth:`run`, the grace starts with it.
        """
        if self._grace is not None:
            return
        self._grace = (grace_s, error)
        if self._task is not None:
            self._arm_grace(grace_s, error)

    def _arm_grace(self, grace_s: float, error: BaseException) -> None:
        loop = asyncio.get_running_loop()
        self._handles.append(loop.call_later(max(0.0, grace_s), self._halt, error))

    def _halt_at_hard_limit(self) -> None:
        # The error is made only when the limit is reached: a run that ends in time (nearly
        # all of them) does not pay for an exception and its message.
        self._halt(TimeLimitExceeded(self._hard_limit_s))

    def _halt(self, error: BaseException) -> None:
        """Cancel the workflow at its current ``await``; the attempt will raise ``error``."""
        if self._stop is not None or self._task is None or self._task.done():
            return
        self._stop = error
        self._owed += 1
        self._task.cancel()

    def _raise_soft_limit(self, limit_s: float) -> None:
        if self._stop is not None or self._task is None or self._task.done():
            return
        self._injection = SoftTimeLimitExceeded(limit_s)
        self._owed += 1
        self._task.cancel()

    def _substitute(self, exc: BaseException) -> BaseException:
        """What to throw into the workflow for ``exc``, which reached its task.

        The soft limit replaces the cancellation the guard requested to deliver it; anything
        else passes unchanged.
        """
        if self._injection is None or not isinstance(exc, asyncio.CancelledError):
            return exc
        assert self._task is not None
        injection, self._injection = self._injection, None
        self._owed -= 1
        if self._task.uncancel() > self._baseline:
            return exc  # another cancellation is pending (the hard limit's or anyone's): it wins
        return injection

    def _settle(self) -> bool:
        """Take back the guard's own cancellations; whether someone else's is still pending."""
        assert self._task is not None
        while self._owed > 0:
            self._owed -= 1
            self._task.uncancel()
        return self._task.cancelling() > self._baseline


class _Interruptible(Generic[T]):
    """Awaits a coroutine as ``await coro`` would, letting the guard swap what is thrown in."""

    __slots__ = ("_coro", "_guard")

    def __init__(self, coro: Coroutine[Any, Any, T], guard: AttemptGuard) -> None:
        self._coro = coro
        self._guard = guard

    def __await__(self) -> Generator[Any, Any, T]:
        coro = self._coro
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                if error is None:
                    yielded = coro.send(value)
                else:
                    thrown, error = error, None
                    yielded = coro.throw(thrown)
            except StopIteration as stop:
                result: T = stop.value
                return result
            try:
                value = yield yielded
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:
                value = None
                error = self._guard._substitute(exc)
