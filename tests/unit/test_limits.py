"""AttemptGuard: soft and hard time limits and the cancel grace, on a bare event loop."""

import asyncio

import pytest

from moorline.engine.limits import AttemptGuard
from moorline.errors import SoftTimeLimitExceeded, TimeLimitExceeded

FOREVER_S = 3600.0


class Stop(BaseException):
    """What the tests' cancel grace raises."""


async def test_the_soft_limit_is_raised_at_the_current_await_and_can_be_caught() -> None:
    seen: list[str] = []

    async def workflow() -> str:
        try:
            await asyncio.sleep(FOREVER_S)
        except SoftTimeLimitExceeded as exc:
            seen.append(str(exc))
            # The task is not left cancelled: the cleanup can await freely.
            await asyncio.sleep(0.01)
            return "cleaned up"
        return "unreachable"

    guard = AttemptGuard(hard_limit_s=FOREVER_S, soft_limit_s=0.05)
    assert await asyncio.wait_for(guard.run(workflow()), 5) == "cleaned up"
    assert seen == ["the attempt reached its soft time limit of 0.05s"]
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0
    assert guard.stop_error is None


async def test_an_uncaught_soft_limit_escapes_as_itself() -> None:
    async def workflow() -> None:
        await asyncio.Event().wait()

    with pytest.raises(SoftTimeLimitExceeded):
        await asyncio.wait_for(AttemptGuard(hard_limit_s=5, soft_limit_s=0.05).run(workflow()), 5)


async def test_the_soft_limit_cancels_what_the_workflow_awaited() -> None:
    inner_cancelled = asyncio.Event()

    async def inner() -> None:
        try:
            await asyncio.sleep(FOREVER_S)
        except asyncio.CancelledError:
            inner_cancelled.set()
            raise

    async def workflow() -> bool:
        try:
            await asyncio.create_task(inner())
        except SoftTimeLimitExceeded:
            await asyncio.wait_for(inner_cancelled.wait(), 5)
            return True
        return False

    assert await AttemptGuard(hard_limit_s=5, soft_limit_s=0.05).run(workflow())


async def test_the_hard_limit_stops_the_workflow_even_when_it_swallows_the_cancel() -> None:
    swallowed: list[bool] = []

    async def workflow() -> str:
        try:
            await asyncio.sleep(FOREVER_S)
        except asyncio.CancelledError:
            swallowed.append(True)
        return "ignored the cancel"

    loop = asyncio.get_running_loop()
    started = loop.time()
    guard = AttemptGuard(hard_limit_s=0.1, soft_limit_s=None)
    with pytest.raises(TimeLimitExceeded, match=r"time limit of 0\.1s"):
        await guard.run(workflow())
    assert loop.time() - started >= 0.1
    assert swallowed == [True]
    assert isinstance(guard.stop_error, TimeLimitExceeded)
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0


async def test_a_soft_limit_not_below_the_hard_one_never_fires() -> None:
    async def workflow() -> None:
        await asyncio.sleep(FOREVER_S)

    with pytest.raises(TimeLimitExceeded):
        await AttemptGuard(hard_limit_s=0.05, soft_limit_s=0.05).run(workflow())


async def test_the_cancel_grace_stops_a_workflow_that_never_checks() -> None:
    loop = asyncio.get_running_loop()
    guard = AttemptGuard(hard_limit_s=FOREVER_S)

    async def workflow() -> None:
        guard.cancel_after(0.1, Stop("cancelled"))
        guard.cancel_after(FOREVER_S, Stop("only the first grace counts"))
        await asyncio.sleep(FOREVER_S)

    started = loop.time()
    with pytest.raises(Stop, match=r"^cancelled$"):
        await guard.run(workflow())
    assert 0.1 <= loop.time() - started < 2


async def test_a_grace_given_before_the_run_starts_with_it() -> None:
    guard = AttemptGuard(hard_limit_s=FOREVER_S)
    guard.cancel_after(0.0, Stop("early"))
    with pytest.raises(Stop, match="early"):
        await guard.run(asyncio.sleep(FOREVER_S))


async def test_someone_elses_cancel_passes_through_unchanged() -> None:
    entered = asyncio.Event()

    async def workflow() -> None:
        entered.set()
        await asyncio.sleep(FOREVER_S)

    guard = AttemptGuard(hard_limit_s=FOREVER_S, soft_limit_s=FOREVER_S / 2)
    task = asyncio.create_task(guard.run(workflow()))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert guard.stop_error is None


async def test_a_foreign_cancel_wins_over_a_simultaneous_soft_limit() -> None:
    """The soft limit and a lost lease land in the same loop iteration: the cancel wins."""
    entered = asyncio.Event()
    seen: list[str] = []

    async def workflow() -> None:
        entered.set()
        try:
            await asyncio.sleep(FOREVER_S)
        except SoftTimeLimitExceeded:
            seen.append("soft")
            raise

    guard = AttemptGuard(hard_limit_s=FOREVER_S, soft_limit_s=FOREVER_S / 2)
    task = asyncio.create_task(guard.run(workflow()))
    await entered.wait()
    guard._raise_soft_limit(1.0)  # what the soft limit's timer does
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == []


async def test_a_workflow_that_ends_in_time_is_untouched() -> None:
    async def workflow() -> int:
        await asyncio.sleep(0)
        return 7

    guard = AttemptGuard(hard_limit_s=5, soft_limit_s=1)
    assert await guard.run(workflow()) == 7
    with pytest.raises(RuntimeError, match="one coroutine"):
        await guard.run(workflow())


@pytest.mark.parametrize(("hard", "soft"), [(0.0, None), (-1.0, None), (1.0, 0.0), (1, -2)])
def test_limits_must_be_positive(hard: float, soft: float | None) -> None:
    with pytest.raises(ValueError, match="positive"):
        AttemptGuard(hard_limit_s=hard, soft_limit_s=soft)
