"""What ``moorline bench`` measures, on which targets, and how its reports are written.

A *benchmark* is measured on *targets*: a database (SQLite, PostgreSQL, MariaDB) for the
dispatch figures and the step overhead, or a runtime store with the database it is deployed
with (memory+SQLite, the embedded setup; Redis+PostgreSQL, the scaled-out one) for the figures
that go through the store. Every round runs on a fresh database, and each figure is reported
as the median of the rounds with min and max beside it.
"""

import json
import os
import platform
import statistics
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from moorline.benchmarks import dispatch, engine, suspension

DATABASES = ("sqlite", "postgresql", "mysql")
STORES = ("memory", "redis")
STORE_DATABASE = engine.PAIRINGS
"""Store → the database it is measured with."""


@dataclass(frozen=True)
class Metric:
    """One figure of the report."""

    key: str
    label: str
    unit: str
    higher_is_better: bool


METRICS = {
    metric.key: metric
    for metric in (
        Metric("enqueue", "Enqueue rate", "runs/s", True),
        Metric("drain", "Drain rate", "runs/s", True),
        Metric("latency_p50", "Dispatch latency p50", "ms", False),
        Metric("latency_p99", "Dispatch latency p99", "ms", False),
        Metric("step", "Step overhead", "ms", False),
        Metric("resolve_resume", "Resolve → resume", "ms", False),
        Metric("signal_resume", "Signal → resume", "ms", False),
        Metric("parked_resume_p50", "Approve → parked run resumes p50", "ms", False),
        Metric("parked_resume_p99", "Approve → parked run resumes p99", "ms", False),
        Metric("events_x1", "Events/s, 1 reader (SSE)", "events/s", True),
        Metric("events_x100", "Events/s, each of 100 readers (SSE)", "events/s", True),
    )
}

PARKED = 20
PARKED_QUICK = 5
"""Runs parked (after the default 2 s) then approved one by one in a ``parked_resume`` round."""

Measure = Callable[[str, str | None, bool], Awaitable[dict[str, float]]]
"""(database url, store kind or None, quick) → the figures of one round."""


async def _enqueue(url: str, store: str | None, quick: bool) -> dict[str, float]:
    return await dispatch.enqueue_round(url, dispatch.QUICK if quick else dispatch.DispatchSizes())


async def _drain(url: str, store: str | None, quick: bool) -> dict[str, float]:
    return await dispatch.drain_round(url, dispatch.QUICK if quick else dispatch.DispatchSizes())


async def _latency(url: str, store: str | None, quick: bool) -> dict[str, float]:
    return await dispatch.latency_round(url, dispatch.QUICK if quick else dispatch.DispatchSizes())


async def _step(url: str, store: str | None, quick: bool) -> dict[str, float]:
    return await engine.step_round(url, engine.QUICK if quick else engine.EngineSizes())


async def _resume(url: str, store: str | None, quick: bool) -> dict[str, float]:
    assert store is not None
    return await engine.resume_round(url, store, engine.QUICK if quick else engine.EngineSizes())


async def _parked_resume(url: str, store: str | None, quick: bool) -> dict[str, float]:
    assert store is not None
    parked = PARKED_QUICK if quick else PARKED
    return await suspension.resume_round(url, store, parked=parked)


async def _events(url: str, store: str | None, quick: bool) -> dict[str, float]:
    assert store is not None
    return await engine.events_round(url, store, engine.QUICK if quick else engine.EngineSizes())


@dataclass(frozen=True)
class Benchmark:
    """A measurement giving one or more figures per round."""

    name: str
    description: str
    measure: Measure
    through_store: bool
    """Measured per store (with its paired database) rather than per database."""


BENCHMARKS = {
    b.name: b
    for b in (
        Benchmark(
            "enqueue", "concurrent producers through the group-commit Submitter", _enqueue, False
        ),
        Benchmark("drain", "pre-enqueued no-op runs executed by one worker", _drain, False),
        Benchmark("latency", "submit → start at a steady arrival rate", _latency, False),
        Benchmark("step", "one checkpointed no-op step", _step, False),
        Benchmark("resume", "interrupt resolved as the API does → workflow resumes", _resume, True),
        Benchmark(
            "parked_resume",
            "approve through the HTTP API (moorline.Client, in-process) → a run parked after "
            "MOORLINE_PARK_AFTER continues; a Worker at default settings",
            _parked_resume,
            True,
        ),
        Benchmark("events", "ctx.emit → EventStream readers (what SSE reads)", _events, True),
    )
}


@dataclass(frozen=True)
class Target:
    """Where one benchmark is measured: a database, and a store for the store benchmarks."""

    database: str
    store: str | None = None

    @property
    def label(self) -> str:
        return self.database if self.store is None else f"{self.store}+{self.database}"


def targets(benchmark: Benchmark, databases: Sequence[str], stores: Sequence[str]) -> list[Target]:
    """The targets of ``benchmark`` among the chosen databases and stores.

    A store benchmark runs for a chosen store only when the database it is paired with is
    chosen too, so ``--backends sqlite`` never touches PostgreSQL.
    """
    if not benchmark.through_store:
        return [Target(database) for database in databases]
    return [
        Target(STORE_DATABASE[store], store)
        for store in stores
        if STORE_DATABASE[store] in databases
    ]


@dataclass
class Result:
    """One figure on one target over all rounds."""

    benchmark: str
    metric: str
    label: str
    target: str
    unit: str
    higher_is_better: bool
    median: float
    min: float
    max: float
    values: list[float]


@dataclass
class Report:
    """Every figure of one ``moorline bench`` run, with the conditions it ran under."""

    rounds: int
    quick: bool
    started_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())
    machine: dict[str, Any] = field(
        default_factory=lambda: {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        }
    )
    results: list[Result] = field(default_factory=list)

    def add(self, benchmark: str, target: Target, figures: dict[str, list[float]]) -> None:
        for key, values in figures.items():
            metric = METRICS[key]
            self.results.append(
                Result(
                    benchmark=benchmark,
                    metric=key,
                    label=metric.label,
                    target=target.label,
                    unit=metric.unit,
                    higher_is_better=metric.higher_is_better,
                    median=statistics.median(values),
                    min=min(values),
                    max=max(values),
                    values=values,
                )
            )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, ensure_ascii=False) + "\n"

    def to_markdown(self) -> str:
        """One table: a row per figure, a column per target; each cell median (min-max)."""
        columns = list(dict.fromkeys(result.target for result in self.results))
        rows: dict[str, dict[str, Result]] = {}
        for result in self.results:
            rows.setdefault(result.metric, {})[result.target] = result
        size = "quick sizes" if self.quick else "full sizes"
        lines = [
            "# Moorline benchmark report",
            "",
            f"{self.started_at}; {self.machine['platform']}, {self.machine['cpus']} CPUs, "
            f"Python {self.machine['python']}; {size}; median of {self.rounds} rounds "
            "(min-max), each round on a fresh database.",
            "",
            "| Figure | " + " | ".join(columns) + " |",
            "|---|" + "---:|" * len(columns),
        ]
        for key, by_target in rows.items():
            metric = METRICS[key]
            better = "higher" if metric.higher_is_better else "lower"
            cells = [_cell(by_target.get(column)) for column in columns]
            lines.append(
                f"| {metric.label} ({metric.unit}, {better} is better) | "
                + " | ".join(cells)
                + " |"
            )
        lines += ["", "Benchmarks:", ""]
        for name in dict.fromkeys(result.benchmark for result in self.results):
            lines.append(f"- **{name}**: {BENCHMARKS[name].description}")
        return "\n".join(lines) + "\n"

    def write(self, markdown: Path, json_path: Path) -> None:
        markdown.write_text(self.to_markdown(), encoding="utf-8")
        json_path.write_text(self.to_json(), encoding="utf-8")


def _cell(result: Result | None) -> str:
    if result is None:
        return "-"
    return f"{_number(result.median)} ({_number(result.min)}-{_number(result.max)})"


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.2f}"


def plan(
    benchmarks: Sequence[str], databases: Sequence[str], stores: Sequence[str]
) -> Iterator[tuple[Benchmark, Target]]:
    """Every (benchmark, target) pair to measure, in a stable order."""
    for name in benchmarks:
        benchmark = BENCHMARKS[name]
        for target in targets(benchmark, databases, stores):
            yield benchmark, target
