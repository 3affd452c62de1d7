"""``moorline bench``: run the benchmark suite and write a Markdown and a JSON report.

The measuring code is :mod:`moorline.benchmarks` (see there why it is in the package); this
module only picks what to run, shows progress, and writes the reports.
"""

import asyncio
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from moorline.benchmarks.common import on_fresh_database
from moorline.benchmarks.suite import (
    BENCHMARKS,
    DATABASES,
    STORES,
    Measure,
    Report,
    Target,
    plan,
)
from moorline.errors import ConfigError


def register(cli: typer.Typer) -> None:
    """Add ``bench`` to the ``moorline`` command tree."""
    cli.command("bench")(bench)


def bench(
    benchmarks: Annotated[
        str,
        typer.Option(
            "--benchmarks",
            metavar="NAME,...",
            help=f"Benchmarks to run, among {', '.join(BENCHMARKS)}.",
        ),
    ] = ",".join(BENCHMARKS),
    backends: Annotated[
        str,
        typer.Option(
            "--backends",
            metavar="DB,...",
            help="Databases to measure on, among sqlite, postgresql, mysql (MariaDB). The "
            "servers are the local test ones (127.0.0.1, databases created and dropped).",
        ),
    ] = ",".join(DATABASES),
    stores: Annotated[
        str,
        typer.Option(
            "--stores",
            metavar="STORE,...",
            help="Runtime stores for the resume, parked_resume and events benchmarks, among "
            "memory (with "
            "SQLite) and redis (with PostgreSQL); each needs its database in --backends.",
        ),
    ] = ",".join(STORES),
    rounds: Annotated[int, typer.Option(min=1, help="Rounds per figure (median, min, max).")] = 3,
    quick: Annotated[
        bool, typer.Option("--quick", help="Small sizes: a smoke run in seconds, not figures.")
    ] = False,
    markdown: Annotated[
        Path, typer.Option("--markdown", help="Where to write the Markdown report.")
    ] = Path("bench-report.md"),
    json_path: Annotated[
        Path, typer.Option("--json", help="Where to write the JSON report.")
    ] = Path("bench-report.json"),
) -> None:
    """Measure enqueue, drain, dispatch latency, step overhead, resume and event stream rates.

    Each figure is the median of `--rounds` rounds, each on a fresh database, per backend.
    """
    chosen = _choose("--benchmarks", benchmarks, tuple(BENCHMARKS))
    databases = _choose("--backends", backends, DATABASES)
    chosen_stores = _choose("--stores", stores, STORES)
    work = list(plan(chosen, databases, chosen_stores))
    if not work:
        raise ConfigError("nothing to measure: no chosen benchmark runs on the chosen backends")
    report = Report(rounds=rounds, quick=quick)
    console = Console(stderr=True)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        overall = progress.add_task("all", total=len(work) * rounds)
        for benchmark, target in work:
            current = progress.add_task(f"{benchmark.name} on {target.label}", total=rounds)
            figures: dict[str, list[float]] = {}
            for _ in range(rounds):
                for key, value in _one_round(benchmark.measure, target, quick).items():
                    figures.setdefault(key, []).append(value)
                progress.advance(current)
                progress.advance(overall)
            report.add(benchmark.name, target, figures)
    report.write(markdown, json_path)
    Console(soft_wrap=True, highlight=False).print(
        report.to_markdown() + f"\nWritten to {markdown} and {json_path}"
    )


def _one_round(measure: Measure, target: Target, quick: bool) -> dict[str, float]:
    """One round on a fresh database, in its own event loop (as the scripts do)."""
    return asyncio.run(
        on_fresh_database(target.database, lambda url: measure(url, target.store, quick))
    )


def _choose(option: str, given: str, known: tuple[str, ...]) -> list[str]:
    names = [name.strip() for name in given.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ConfigError(
            f"{option}: unknown {', '.join(unknown) or 'empty list'}; choose among "
            f"{', '.join(known)}"
        )
    return list(dict.fromkeys(names))
