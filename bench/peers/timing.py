"""How every system is timed, the same way: imported by Moorline's driver and the peers' driver.

Plain Python with no dependency, so it runs in either venv.

- **Enqueue**: ``producers`` concurrent producers submit the tasks, each call returning once the
  system has accepted the task (durably or not: see each system's conditions). A warm-up of
  ``WARM_UP_PER_PRODUCER`` tasks per producer goes first, outside the clock (connections,
  prepared statements, imports).
- **Drain**: the tasks wait in the queue while no worker runs; then the worker processes start
  and the completions are counted by polling (every ``POLL_S``). The clock runs from the moment
  ``WARM_UP_SHARE`` (10 %) of the tasks are done to the last one: the workers' start-up
  (interpreter, imports, connecting) is never inside it, nor their first, cold tasks.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

WARM_UP_PER_PRODUCER = 10
POLL_S = 0.02
DEADLINE_S = 900.0
WARM_UP_SHARE = 0.1
"""Completions before the drain clock starts, as a share of all tasks."""


@dataclass(frozen=True)
class Drain:
    """The drain measurement: tasks counted, over how long, after how long a start-up."""

    counted: int
    window_s: float
    startup_s: float
    """From starting the worker processes to the first completion seen (not in the rate)."""

    def as_dict(self) -> dict[str, float]:
        return {
            "drain": self.counted / self.window_s,
            "drain_window_s": self.window_s,
            "startup_s": self.startup_s,
        }


class DrainClock:
    """Fed the completed count at every poll; says the :class:`Drain` once all are done.

    Args:
        total: Every task queued, warm-up included.
        started_at: ``time.perf_counter()`` when the worker processes were started.
    """

    poll_s = POLL_S

    def __init__(self, total: int, started_at: float) -> None:
        self.total = total
        self.started_at = started_at
        self.warm = max(1, int(total * WARM_UP_SHARE))
        self.first: float | None = None
        self.clock: tuple[float, int] | None = None
        self.deadline = time.perf_counter() + DEADLINE_S

    def see(self, done: int) -> Drain | None:
        now = time.perf_counter()
        if self.first is None and done > 0:
            self.first = now
        if self.clock is None and done >= self.warm:
            if done >= self.total:
                raise SystemExit("drain: all tasks done before the clock started: raise --runs")
            self.clock = (now, done)
        if self.clock is not None and done >= self.total:
            assert self.first is not None
            return Drain(
                counted=done - self.clock[1],
                window_s=now - self.clock[0],
                startup_s=self.first - self.started_at,
            )
        if now > self.deadline:
            raise SystemExit(f"drain: {done} of {self.total} tasks done in {DEADLINE_S:.0f} s")
        return None


def measure_drain(total: int, completed: Callable[[], int], started_at: float) -> Drain:
    """Poll ``completed()`` until it reaches ``total`` (a blocking loop, for sync clients)."""
    clock = DrainClock(total, started_at)
    while True:
        measured = clock.see(completed())
        if measured is not None:
            return measured
        time.sleep(POLL_S)
