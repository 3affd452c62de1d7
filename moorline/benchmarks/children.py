"""Child-run figures (issue 17): fan out and join 1,000 children against 1,000 triggers.

Both sides go through the public path of one in-process ``moorline serve``
(:mod:`~moorline.benchmarks.serving`: the real API routes, one Worker at default settings,
the reaper and the timer sweep) over the backend's database and runtime store:

- **fan-out and join** (public path): one ``fanout`` run is triggered through
  ``moorline.Client``; it starts ``--children`` no-op children with ``ctx.map`` (a fenced,
  idempotent insert each) and joins them. The figure is the wall time from the trigger call
  to the parent's ``ctx.map`` returning (noted in the workflow). Targets for 1,000 children:
  <= 1 s SQLite + memory, <= 2 s PostgreSQL + Redis.
- **top-level baseline** (public path): as many no-op runs triggered through
  ``moorline.Client`` (``TRIGGER_CONCURRENCY`` requests in flight) and awaited: wall time
  from the first trigger to the last run's workflow returning. The ratio is baseline /
  fan-out (target >= 1.0: children no slower than the same number of triggers).
- **CPU per child**: CPU time of this process (API, worker and client) during the fan-out,
  divided by the number of children; the same per run for the baseline beside it.
- **resume after the last child**: from the last child's workflow returning to the parent's
  join returning (the child's outcome write, the parent's wake-up or in-memory poll, its
  replay). p50 over the rounds' fan-outs and ``--resumes`` small fan-outs of
  ``RESUME_CHILDREN`` children each.

A join waits in memory for ``MOORLINE_PARK_AFTER`` (2 s) before it parks, so a fan-out that
ends sooner is joined by the in-memory poll (every ``JOIN_POLL_S``); a longer one parks and is
re-queued by the worker that writes the last child's end.
"""

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

from moorline.benchmarks.common import on_fresh_database, percentile
from moorline.benchmarks.serving import Served, serving
from moorline.engine.context import Context
from moorline.engine.registry import Moorline

WAIT_TIMEOUT_S = 120.0
"""Longest any phase may take before the benchmark gives up (a bug, not a slow machine)."""

TRIGGER_CONCURRENCY = 16
"""Trigger requests in flight at once for the top-level baseline."""

RESUME_CHILDREN = 10
"""Children of each small fan-out that samples the resume latency."""

STORE_OF = {"sqlite": "memory", "postgresql": "redis", "mysql": "redis"}
"""Backend → the runtime store it is deployed with (the embedded and scaled-out setups)."""

FANOUT_TARGET_MS = {"sqlite": 1000.0, "postgresql": 2000.0}


@dataclass
class Marks:
    """What the benchmark workflows note as they run (perf_counter of this process)."""

    ended: dict[str, float] = field(default_factory=dict)
    """Run id of a no-op run (child or top-level) → when its workflow returned."""
    joined: dict[str, float] = field(default_factory=dict)
    """Run id of a parent → when its ``ctx.map`` returned."""
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


def make_app(marks: Marks) -> Moorline:
    """The benchmark workflows, noting into ``marks``."""
    app = Moorline()

    @app.workflow("noop")
    async def noop(ctx: Context) -> None:
        """Does nothing; notes when it returned."""
        marks.ended[ctx.run_id] = time.perf_counter()
        marks.arrived.set()

    @app.workflow("fanout")
    async def fanout(ctx: Context, count: int) -> int:
        """Starts ``count`` no-op children and joins them."""
        outputs = await ctx.map("noop", [{}] * count, key="noop")
        marks.joined[ctx.run_id] = time.perf_counter()
        marks.arrived.set()
        return len(outputs)

    return app


async def until(check: Callable[[], bool], what: str, marks: Marks) -> None:
    """Wait until ``check()``, woken by the workflows' notes, with a deadline."""
    try:
        async with asyncio.timeout(WAIT_TIMEOUT_S):
            while not check():
                marks.arrived.clear()
                if not check():
                    await marks.arrived.wait()
    except TimeoutError:
        raise TimeoutError(f"gave up after {WAIT_TIMEOUT_S:.0f} s waiting for {what}") from None


@dataclass(frozen=True)
class FanOut:
    """One parent's fan-out and join."""

    total_ms: float
    cpu_ms: float
    resume_ms: float


async def fan_out(served: Served, marks: Marks, count: int) -> FanOut:
    """Trigger a parent of ``count`` children and wait for its join."""
    seen = set(marks.ended)
    cpu_began = time.process_time()
    began = time.perf_counter()
    parent = (await served.client.trigger("fanout", {"count": count})).run_id
    await until(lambda: parent in marks.joined, f"parent {parent} to join", marks)
    joined = marks.joined[parent]
    cpu_ms = (time.process_time() - cpu_began) * 1000
    # Only this fan-out's children ended meanwhile: the benchmark runs one phase at a time.
    children = [at for run_id, at in marks.ended.items() if run_id not in seen]
    assert len(children) == count, f"{len(children)} children ended, expected {count}"
    return FanOut(
        total_ms=(joined - began) * 1000,
        cpu_ms=cpu_ms,
        resume_ms=(joined - max(children)) * 1000,
    )


async def top_level(served: Served, marks: Marks, count: int) -> tuple[float, float]:
    """Wall and CPU ms to trigger ``count`` no-op runs through the API and see them end."""
    gate = asyncio.Semaphore(TRIGGER_CONCURRENCY)

    async def trigger() -> str:
        async with gate:
            return (await served.client.trigger("noop")).run_id

    cpu_began = time.process_time()
    began = time.perf_counter()
    run_ids = await asyncio.gather(*(trigger() for _ in range(count)))
    await until(lambda: all(r in marks.ended for r in run_ids), "every top-level run", marks)
    ended = max(marks.ended[run_id] for run_id in run_ids)
    return (ended - began) * 1000, (time.process_time() - cpu_began) * 1000


async def children_round(
    url: str, store: str, *, children: int, resumes: int
) -> dict[str, list[float]]:
    """One round over ``store`` on the empty database at ``url``: fan-out, baseline, resumes."""
    marks = Marks()
    async with serving(url, store, make_app(marks)) as served:
        await fan_out(served, marks, RESUME_CHILDREN)  # warm-up: connections, compiled queries
        big = await fan_out(served, marks, children)
        baseline_ms, baseline_cpu_ms = await top_level(served, marks, children)
        resumed = [big.resume_ms]
        for _ in range(resumes):
            resumed.append((await fan_out(served, marks, RESUME_CHILDREN)).resume_ms)
    return {
        "fanout_ms": [big.total_ms],
        "toplevel_ms": [baseline_ms],
        "ratio": [baseline_ms / big.total_ms],
        "cpu_per_child": [big.cpu_ms / children],
        "cpu_per_run": [baseline_cpu_ms / children],
        "resume": resumed,
    }


# --- the report -----------------------------------------------------------------------------

# (key, label, unit, target)
LINES: tuple[tuple[str, str, str, str], ...] = (
    ("fanout_ms", "fan out and join N children", " ms", ""),
    ("toplevel_ms", "trigger and await N top-level runs", " ms", ""),
    ("ratio", "ratio (top-level / children)", "", ">= 1.0"),
    ("cpu_per_child", "CPU per child", " ms", ""),
    ("cpu_per_run", "CPU per top-level run", " ms", ""),
    ("resume_p50", "parent resume after last child p50", " ms", ""),
)


def _target(key: str, backend: str, target: str) -> str:
    if key == "fanout_ms" and backend in FANOUT_TARGET_MS:
        return f"<= {FANOUT_TARGET_MS[backend]:.0f} ms"
    return target


def _verdict(value: float, target: str) -> str:
    if not target:
        return ""
    bound = float(target.split()[1])
    ok = value <= bound if target.startswith("<=") else value >= bound
    return f"  [target {target}: {'met' if ok else 'MISSED'}]"


def measure_backend(
    backend: str, *, rounds: int, children: int, resumes: int
) -> dict[str, list[float]]:
    """Every figure of ``backend``, one value per round (resume: every sample)."""
    found: dict[str, list[float]] = {}
    work: Callable[[str], Awaitable[dict[str, list[float]]]] = partial(
        children_round, store=STORE_OF[backend], children=children, resumes=resumes
    )
    for _ in range(rounds):
        for key, values in asyncio.run(on_fresh_database(backend, work)).items():
            found.setdefault(key, []).extend(values)
    found["resume_p50"] = [percentile(found.pop("resume"), 0.5)]
    return found


def print_backend(backend: str, found: dict[str, list[float]]) -> None:
    """One block of the report: a line per figure, median (min, max) of the rounds."""
    print(f"{backend} + {STORE_OF[backend]} store")
    for key, label, unit, target in LINES:
        values = found[key]
        median, low, high = statistics.median(values), min(values), max(values)
        digits = 2 if median < 100 else 0
        shown = f"{median:10.{digits}f}{unit} (min {low:.{digits}f}, max {high:.{digits}f})"
        print(f"  {label:38} {shown:42}{_verdict(median, _target(key, backend, target))}")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    """``python bench/children.py``: every figure per backend, median of the rounds."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default="sqlite,postgresql,mysql")
    parser.add_argument("--children", type=int, default=1000)
    parser.add_argument("--resumes", type=int, default=10)
    args = parser.parse_args(argv)
    backends = args.backends.split(",")
    if set(backends) - set(STORE_OF):
        parser.error(f"unknown backends: {', '.join(sorted(set(backends) - set(STORE_OF)))}")
    print(
        f"children: median of {args.rounds} rounds (min, max), each on a fresh database; "
        f"N = {args.children}; public path = HTTP API via moorline.Client (in-process ASGI) "
        f"to one Worker at default settings; resume p50 over the rounds' fan-outs and "
        f"{args.resumes} fan-outs of {RESUME_CHILDREN} children per round."
    )
    sys.stdout.flush()
    for backend in backends:
        found = measure_backend(
            backend, rounds=args.rounds, children=args.children, resumes=args.resumes
        )
        print_backend(backend, found)
