"""Suspension figures (issue 16): resume of a parked run, timer lateness, replay cost.

Each figure says which path it measures:

- **resume** (public path): runs ask for permission and park after ``MOORLINE_PARK_AFTER``
  (default 2 s); then, one at a time, ``moorline.Client.approve`` posts the decision to the
  HTTP API (:mod:`~moorline.benchmarks.serving`: the real routes, in-process) and the time
  until ``request_permission`` returns in the workflow's replay is taken: the decision's
  commit (which re-queues the run), the lane's wake-up, the claim, and the replay. p50 and p99
  of ``--parked`` runs; the API's answer time beside it. Targets: p50 <= 10 ms SQLite +
  memory, <= 20 ms PostgreSQL + Redis.
- **timers** (public path): ``--sleepers`` runs triggered through the API sleep until
  instants five a second apart, each far enough ahead to park; the timer sweep (leader
  elected, every ``MOORLINE_TIMER_INTERVAL`` = 1 s) re-queues them and the lateness is taken in
  the workflow when ``ctx.sleep_until`` returns (wall clock, past the instant asked for).
  Target: p99 <= interval + 200 ms.
- **bytes per parked run** (public path): what the ``--parked`` runs added to the database
  (run row, its events, the interrupt, with indexes), divided by their number. PostgreSQL:
  ``pg_total_relation_size`` deltas; SQLite: page count deltas; MariaDB: InnoDB's estimates
  after ``ANALYZE TABLE``.
- **replay** (internal path: :class:`~moorline.engine.runner.WorkflowRunner` called on a
  claimed run, with the backend's store): a run that finished ``n`` no-op steps and parked
  is approved and claimed again; the figure is the whole attempt (context, checkpoint read,
  ``n`` replayed steps, the decision read, the workflow's end), for n = 2 and n = 200.
  Target: 200 steps <= 20 ms.

The claim and drain figures with waiting runs stored are in
:mod:`~moorline.benchmarks.waiting_load`. ``bench/suspension.py`` prints all of them per
backend; ``moorline bench --benchmarks parked_resume`` reports the resume latency.
"""

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import partial

from sqlalchemy import func, select

from moorline.benchmarks.common import on_fresh_database, percentile, seed_tenant
from moorline.benchmarks.serving import REDIS_URL, Served, delete_keys, serving
from moorline.benchmarks.sizes import stored_bytes
from moorline.benchmarks.waiting_load import QUICK as LOAD_QUICK
from moorline.benchmarks.waiting_load import LoadSizes, load_round
from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.queue import Claim, QueueRepo
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.db.schema import runs
from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.engine.runner import WorkflowRunner
from moorline.errors import RunParked
from moorline.runtime.base import RuntimeStore
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.runtime.redis import RedisRuntimeStore
from moorline.settings import Settings
from moorline.types import RunStatus

WAIT_TIMEOUT_S = 120.0
"""Longest any phase may take before the benchmark gives up (a bug, not a slow machine)."""

SLEEP_AHEAD_S = 5.0
"""How far ahead the first sleeper's instant is: time to trigger them all and park."""

SLEEPERS_PER_S = 5.0
"""The sleepers' instants are spread evenly at this rate, so they fall at every phase of the
sweep and each pass re-queues a few: the figure is the timer's precision, not how fast one
process replays a burst (100 runs due in the same second wait for each other's replays)."""

REPLAY_LANE = "bench_replay"


@dataclass
class Marks:
    """What the benchmark workflows note as they run (perf_counter of this process)."""

    continued: dict[str, float] = field(default_factory=dict)
    """Run id → when ``request_permission`` returned in the replay."""
    lateness_ms: list[float] = field(default_factory=list)
    """Per sleeper: ms between the instant asked for and ``sleep_until`` returning."""
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def note(self, run_id: str) -> None:
        self.continued[run_id] = time.perf_counter()
        self.arrived.set()


def make_app(marks: Marks) -> Moorline:
    """The benchmark workflows, noting into ``marks``."""
    app = Moorline()

    @app.workflow("approval")
    async def approval(ctx: Context) -> None:
        """Asks once; parks after the default ``park_after``."""
        await ctx.request_permission("bench", {}, timeout=3600)
        marks.note(ctx.run_id)

    @app.workflow("nap")
    async def nap(ctx: Context, until: str) -> None:
        """Sleeps until ``until`` (far enough ahead to park) and notes how late it woke."""
        when = datetime.fromisoformat(until)
        await ctx.sleep_until(when)
        marks.lateness_ms.append((datetime.now(UTC) - when).total_seconds() * 1000)
        marks.arrived.set()

    @app.workflow("replay")
    async def replay(ctx: Context, count: int) -> None:
        """``count`` no-op steps, then a permission that parks at once."""
        for index in range(count):
            await ctx.step(f"noop:{index}", _nothing)
        await ctx.request_permission("bench", {}, timeout=3600, park_after=0)

    return app


async def _nothing() -> None:
    """The no-op step."""


async def until(
    check: Callable[[], Awaitable[bool]], what: str, marks: Marks | None = None
) -> None:
    """Wait until ``check()``: woken by ``marks.arrived`` when given, else polling every 20 ms."""
    try:
        async with asyncio.timeout(WAIT_TIMEOUT_S):
            while not await check():
                if marks is None:
                    await asyncio.sleep(0.02)
                    continue
                marks.arrived.clear()
                if not await check():
                    await marks.arrived.wait()
    except TimeoutError:
        raise TimeoutError(f"gave up after {WAIT_TIMEOUT_S:.0f} s waiting for {what}") from None


async def all_waiting(db: DatabaseManager, run_ids: list[str]) -> bool:
    """Whether every run of ``run_ids`` is ``waiting`` (setup, read from the database)."""
    async with db.connect() as conn:
        found = await conn.execute(
            select(func.count())
            .select_from(runs)
            .where(runs.c.id.in_(run_ids), runs.c.status == RunStatus.WAITING.value)
        )
        return found.scalar_one() == len(run_ids)


@dataclass(frozen=True)
class ResumeFigures:
    """Latencies in ms of approvals of parked runs, and the bytes each parked run stored."""

    continued_ms: list[float]
    answered_ms: list[float]
    cpu_ms: float
    """CPU time of this process (client, API and worker) per approval, until it continued."""
    bytes_per_parked_run: float


async def resume_latencies(served: Served, marks: Marks, count: int) -> ResumeFigures:
    """Park ``count`` runs, then approve them one at a time through the API."""
    client = served.client
    before = await stored_bytes(served.db)
    run_ids = [(await client.trigger("approval")).run_id for _ in range(count)]
    await until(lambda: all_waiting(served.db, run_ids), "every approval run parked")
    parked = await stored_bytes(served.db)
    continued, answered = [], []
    cpu_began = time.process_time()
    for run_id in run_ids:
        began = time.perf_counter()
        await client.approve(run_id)
        answered.append((time.perf_counter() - began) * 1000)
        await until(_returned(marks, run_id), f"run {run_id} to continue", marks)
        continued.append((marks.continued[run_id] - began) * 1000)
    return ResumeFigures(
        continued_ms=continued,
        answered_ms=answered,
        cpu_ms=(time.process_time() - cpu_began) * 1000 / count,
        bytes_per_parked_run=(parked - before) / count,
    )


def _returned(marks: Marks, run_id: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return run_id in marks.continued

    return check


async def timer_lateness(served: Served, marks: Marks, count: int) -> list[float]:
    """Lateness in ms of ``count`` parked sleeps, woken by the timer sweep."""
    first = datetime.now(UTC) + timedelta(seconds=SLEEP_AHEAD_S)
    step = 1 / SLEEPERS_PER_S
    for index in range(count):
        when = first + timedelta(seconds=index * step)
        await served.client.trigger("nap", {"until": when.isoformat()})

    async def all_woke() -> bool:
        return len(marks.lateness_ms) >= count

    await until(all_woke, "every sleeper to wake", marks)
    return list(marks.lateness_ms)


async def public_round(url: str, store: str, *, parked: int, sleepers: int) -> dict[str, float]:
    """One round of the public-path figures over ``store`` on the empty database at ``url``."""
    marks = Marks()
    async with serving(url, store, make_app(marks)) as served:
        resumed = await resume_latencies(served, marks, parked)
        figures = {
            "parked_resume_p50": percentile(resumed.continued_ms, 0.5),
            "parked_resume_p99": percentile(resumed.continued_ms, 0.99),
            "resume_answer_p50": percentile(resumed.answered_ms, 0.5),
            "resume_cpu": resumed.cpu_ms,
            "bytes_per_parked_run": resumed.bytes_per_parked_run,
        }
        if sleepers:
            late = await timer_lateness(served, marks, sleepers)
            figures["timer_late_p50"] = percentile(late, 0.5)
            figures["timer_late_p99"] = percentile(late, 0.99)
        return figures


async def resume_round(url: str, store: str, *, parked: int) -> dict[str, float]:
    """The ``moorline bench`` figure: parked-run resume latency only (p50, p99)."""
    found = await public_round(url, store, parked=parked, sleepers=0)
    return {key: found[key] for key in ("parked_resume_p50", "parked_resume_p99")}


# --- replay (internal path) -----------------------------------------------------------------


async def replay_ms(
    db: DatabaseManager, store: RuntimeStore, app: Moorline, steps: int, samples: int
) -> list[float]:
    """Durations in ms of the resumed attempt of ``samples`` runs that finished ``steps`` steps."""
    runner = WorkflowRunner(app, db=db, store=store, settings=Settings())
    queue, interrupts = QueueRepo(db), InterruptsRepo(db)
    tenant = await seed_tenant(db)
    caps = {"bench": 1_000_000}
    durations = []
    for _ in range(samples):
        new = NewRun(tenant_id=tenant, workflow="replay", input={"count": steps}, lane=REPLAY_LANE)
        await RunsRepo(db).submit_many([new])
        first = await _claim_one(queue, caps)
        try:
            await runner.run(first)
            raise AssertionError("the replay workflow did not park")
        except RunParked:
            pass
        run_id = first.fence.run_id
        [pending] = await interrupts.pending_for_run(run_id)
        await interrupts.resolve(
            run_id, pending.interrupt_id, approved=True, reason="approved", data=None
        )
        again = await _claim_one(queue, caps)
        assert again.fence.run_id == run_id
        began = time.perf_counter()
        await runner.run(again)
        durations.append((time.perf_counter() - began) * 1000)
        await runner.release(again)
    return durations


async def _claim_one(queue: QueueRepo, caps: dict[str, int]) -> Claim:
    [claim] = await queue.claim_batch(
        REPLAY_LANE, "bench", limit=1, lease_ttl_s=600.0, tenant_caps=caps
    )
    return claim


async def replay_round(url: str, store: str, *, samples: int) -> dict[str, float]:
    """Median resumed-attempt time with 2 and with 200 finished steps, on ``url``, ``store``."""
    db = DatabaseManager(Settings(database_url=url))
    await upgrade(db)
    await db.initialize()
    prefix = f"bench_replay_{uuid.uuid4().hex[:10]}"
    runtime = RedisRuntimeStore(REDIS_URL, prefix=prefix) if store == "redis" else None
    try:
        app = make_app(Marks())
        found: dict[str, float] = {}
        for steps in (2, 200):
            durations = await replay_ms(db, runtime or InMemoryRuntimeStore(), app, steps, samples)
            found[f"replay_{steps}"] = statistics.median(durations)
        return found
    finally:
        await db.dispose()
        if runtime is not None:
            await runtime.close()
            await delete_keys(prefix)


# --- the report -----------------------------------------------------------------------------

STORE_OF = {"sqlite": "memory", "postgresql": "redis", "mysql": "redis"}
"""Backend → the runtime store it is deployed with (the embedded and scaled-out setups)."""

FIGURES = ("resume", "load", "replay")


@dataclass(frozen=True)
class SuspensionSizes:
    """How much work one round of each suspension figure does."""

    parked: int = 50
    sleepers: int = 50
    replay_runs: int = 10
    load: LoadSizes = field(default_factory=LoadSizes)


QUICK = SuspensionSizes(parked=10, sleepers=20, replay_runs=3, load=LOAD_QUICK)

# (key, label, unit, path, target): the path is public, internal or setup (see above).
LINES: tuple[tuple[str, str, str, str, str], ...] = (
    ("parked_resume_p50", "resume of a parked run p50", " ms", "public", ""),
    ("parked_resume_p99", "resume of a parked run p99", " ms", "public", ""),
    ("resume_answer_p50", "  approve answered (HTTP) p50", " ms", "public", ""),
    ("resume_cpu", "  CPU of this process per resume", " ms", "public", ""),
    ("timer_late_p50", "timer lateness p50", " ms", "public", ""),
    ("timer_late_p99", "timer lateness p99", " ms", "public", "<= 1200 ms"),
    ("bytes_per_parked_run", "bytes per parked run (all tables)", " B", "public", ""),
    ("claim_p50_0", "claim p50, 0 waiting", " ms", "internal", ""),
    ("claim_p50_n", "claim p50, N waiting", " ms", "internal", ""),
    ("claim_p99_0", "claim p99, 0 waiting", " ms", "internal", ""),
    ("claim_p99_n", "claim p99, N waiting", " ms", "internal", ""),
    ("claim_ratio", "claim p50 ratio (0 / N)", "", "internal", ""),
    ("drain_0", "drain rate, 0 waiting", " runs/s", "internal", ""),
    ("drain_n", "drain rate, N waiting", " runs/s", "internal", ""),
    ("drain_ratio", "drain ratio (N / 0)", "", "internal", ">= 0.9"),
    ("drain_cpu_0", "drain CPU per run, 0 waiting", " ms", "internal", ""),
    ("drain_cpu_n", "drain CPU per run, N waiting", " ms", "internal", ""),
    ("drain_cpu_ratio", "drain CPU ratio (0 / N)", "", "internal", ">= 0.9"),
    ("bytes_per_waiting_row", "bytes per waiting row (runs table)", " B", "setup", ""),
    ("replay_2", "resumed attempt, 2 steps", " ms", "internal", ""),
    ("replay_200", "resumed attempt, 200 steps", " ms", "internal", "<= 20 ms"),
)

RESUME_TARGET_MS = {"sqlite": 10.0, "postgresql": 20.0}


def _rounds(
    count: int, backend: str, measure: Callable[[str], Awaitable[dict[str, float]]]
) -> dict[str, list[float]]:
    figures: dict[str, list[float]] = {}
    for _ in range(count):
        found = asyncio.run(on_fresh_database(backend, measure))
        for key, value in found.items():
            figures.setdefault(key, []).append(value)
    return figures


def _load_rounds(count: int, backend: str, sizes: LoadSizes) -> dict[str, list[float]]:
    """Rounds without and with the waiting rows, alternated so both see the same machine."""
    figures: dict[str, list[float]] = {}
    for _ in range(count):
        without = asyncio.run(
            on_fresh_database(backend, partial(load_round, waiting=0, sizes=sizes))
        )
        with_rows = asyncio.run(
            on_fresh_database(backend, partial(load_round, waiting=sizes.waiting_rows, sizes=sizes))
        )
        for key in ("claim_p50", "claim_p99", "drain", "drain_cpu"):
            figures.setdefault(f"{key}_0", []).append(without[key])
            figures.setdefault(f"{key}_n", []).append(with_rows[key])
        figures.setdefault("bytes_per_waiting_row", []).append(with_rows["bytes_per_waiting_row"])
        figures.setdefault("claim_ratio", []).append(without["claim_p50"] / with_rows["claim_p50"])
        figures.setdefault("drain_ratio", []).append(with_rows["drain"] / without["drain"])
        cpu_ratio = without["drain_cpu"] / with_rows["drain_cpu"]
        figures.setdefault("drain_cpu_ratio", []).append(cpu_ratio)
    return figures


def measure_backend(
    backend: str, figures: set[str], sizes: SuspensionSizes, rounds: int
) -> dict[str, list[float]]:
    """Every chosen figure of ``backend``, ``rounds`` times."""
    found: dict[str, list[float]] = {}
    store = STORE_OF[backend]
    if "resume" in figures:
        public = partial(public_round, store=store, parked=sizes.parked, sleepers=sizes.sleepers)
        found.update(_rounds(rounds, backend, public))
    if "load" in figures:
        found.update(_load_rounds(rounds, backend, sizes.load))
    if "replay" in figures:
        found.update(
            _rounds(rounds, backend, partial(replay_round, store=store, samples=sizes.replay_runs))
        )
    return found


def _target(key: str, backend: str, target: str) -> str:
    if key == "parked_resume_p50" and backend in RESUME_TARGET_MS:
        return f"<= {RESUME_TARGET_MS[backend]:.0f} ms"
    return target


def _verdict(values: list[float], target: str) -> str:
    if not target:
        return ""
    bound = float(target.split()[1])
    median = statistics.median(values)
    ok = median <= bound if target.startswith("<=") else median >= bound
    return f"  [target {target}: {'met' if ok else 'MISSED'}]"


def print_backend(backend: str, found: dict[str, list[float]]) -> None:
    """One block of the report: a line per figure, median (min, max) of the rounds."""
    print(f"{backend} + {STORE_OF[backend]} store")
    for key, label, unit, path, target in LINES:
        values = found.get(key)
        if not values:
            continue
        median, low, high = statistics.median(values), min(values), max(values)
        digits = 2 if median < 100 else 0
        shown = f"{median:10.{digits}f}{unit} (min {low:.{digits}f}, max {high:.{digits}f})"
        verdict = _verdict(values, _target(key, backend, target))
        print(f"  {label:38} {shown:42} [{path}]{verdict}")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    """``python bench/suspension.py``: every figure per backend, median of the rounds."""
    defaults = SuspensionSizes()
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default="sqlite,postgresql,mysql")
    parser.add_argument("--figures", default=",".join(FIGURES), help="of resume,load,replay")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument(
        "--full", action="store_true", help="100,000 waiting rows (the issue's size)"
    )
    parser.add_argument("--waiting-rows", type=int, default=None)
    parser.add_argument("--parked", type=int, default=defaults.parked)
    parser.add_argument("--sleepers", type=int, default=defaults.sleepers)
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else SuspensionSizes(parked=args.parked, sleepers=args.sleepers)
    rows = 100_000 if args.full else args.waiting_rows
    if rows is not None:
        sizes = replace(sizes, load=replace(sizes.load, waiting_rows=rows))
    chosen = set(args.figures.split(","))
    if chosen - set(FIGURES):
        parser.error(f"unknown figures: {', '.join(sorted(chosen - set(FIGURES)))}")
    backends = args.backends.split(",")
    if set(backends) - set(STORE_OF):
        parser.error(f"unknown backends: {', '.join(sorted(set(backends) - set(STORE_OF)))}")
    load = sizes.load
    print(
        f"suspension: median of {args.rounds} rounds (min, max), each on a fresh database; "
        f"{sizes.parked} parked runs approved one by one; {sizes.sleepers} sleepers; "
        f"N = {load.waiting_rows:,} waiting rows; {load.claims} claims; drain of "
        f"{load.drain_runs} no-op runs with {load.slots} slots; replay of "
        f"{sizes.replay_runs} runs per size. Paths: public = HTTP API via moorline.Client "
        "(in-process ASGI) to a Worker at default settings; internal = repositories, Worker or "
        "runner called directly; setup = bulk insert, not timed."
    )
    sys.stdout.flush()
    for backend in backends:
        print_backend(backend, measure_backend(backend, chosen, sizes, args.rounds))
