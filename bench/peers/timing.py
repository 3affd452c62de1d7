"""How every system is timed, the same way: imported by Moorline's driver and the peers' drivers.

Plain Python with no dependency, so it runs in either venv.

- **Enqueue**: one producer submits the tasks one call at a time, each call returning once the
  system has accepted the task (durably or not: see each system's conditions); a bulk enqueue is
  one producer handing ``batch`` tasks a call to the system's documented bulk call. A warm-up of
  ``WARM_UP`` tasks goes first, outside the clock (connections, prepared statements, imports).
- **Drain**: the tasks wait in the queue while no worker runs; then one worker process starts
  and the completions are counted by polling (every ``POLL_S``). The clock runs from the moment
  ``WARM_UP_SHARE`` (10 %) of the tasks are done to the last one: the worker's start-up
  (interpreter, imports, connecting) is never inside it, nor its first, cold tasks.
- **Latency**: one task at a time, each sent when the worker is idle (after the previous one
  started and a random pause of ``PAUSE_S``): from just before the enqueue call to the task's
  start, in milliseconds; the first ``WARM_UP`` are left out.
"""

import random
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

WARM_UP = 10
POLL_S = 0.02
DEADLINE_S = 300.0
WARM_UP_SHARE = 0.1
"""Completions before the drain clock starts, as a share of all tasks."""
PAUSE_S = (0.005, 0.03)
"""Random pause between a task's start and the next enqueue (latency)."""


@dataclass(frozen=True)
class Drain:
    """The drain measurement: tasks counted, over how long, after how long a start-up."""

    counted: int
    window_s: float
    startup_s: float
    """From starting the worker process to the first completion seen (not in the rate)."""

    def as_dict(self, name: str = "drain") -> dict[str, float]:
        return {
            name: self.counted / self.window_s,
            f"{name}_window_s": self.window_s,
            f"{name}_startup_s": self.startup_s,
        }


class DrainClock:
    """Fed the completed count at every poll; says the :class:`Drain` once all are done.

    Args:
        total: Every task queued, warm-up included.
        started_at: ``time.perf_counter()`` when the worker process was started.
        before: Tasks already counted done before this drain (an earlier phase's).
    """

    poll_s = POLL_S

    def __init__(self, total: int, started_at: float, before: int = 0) -> None:
        self.total = total
        self.before = before
        self.started_at = started_at
        self.warm = max(1, int(total * WARM_UP_SHARE))
        self.first: float | None = None
        self.clock: tuple[float, int] | None = None
        self.deadline = time.perf_counter() + DEADLINE_S

    def see(self, counted: int) -> Drain | None:
        done = counted - self.before
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


def measure_drain(
    total: int, completed: Callable[[], int], started_at: float, before: int = 0
) -> Drain:
    """Poll ``completed()`` until it reaches ``before + total`` (a blocking loop)."""
    clock = DrainClock(total, started_at, before)
    while True:
        measured = clock.see(completed())
        if measured is not None:
            return measured
        time.sleep(POLL_S)


def rate(count: int, started: float) -> float:
    """Tasks per second since ``started`` (``time.perf_counter()``)."""
    return count / (time.perf_counter() - started)


def percentile(values: list[float], share: float) -> float:
    """The ``share`` quantile (0..1) of ``values``, nearest-rank (as Moorline's benches)."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(share * len(ordered)) - 1))
    return ordered[index]


def latency_figures(latencies_ms: list[float]) -> dict[str, float]:
    """p50 and p99 of the measured latencies (the warm-up already left out)."""
    return {
        "latency_p50": percentile(latencies_ms, 0.5),
        "latency_p99": percentile(latencies_ms, 0.99),
    }


def pause() -> float:
    """Seconds to wait before the next latency probe (so the worker is idle, not batching)."""
    return random.uniform(*PAUSE_S)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM the worker processes, and SIGKILL any still running after 30 s."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
