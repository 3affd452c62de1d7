"""Moorline against peers on the same no-op workload, in one run: enqueue and drain rates.

Peers run in their own venv, ``bench/peers/.venv``, created on first use with Celery (Redis
broker) and Procrastinate (PostgreSQL) from PyPI; Moorline's own environment is never touched.
Each figure is the median of ``--rounds`` rounds; Moorline's are measured in the same run, on
PostgreSQL, by :mod:`moorline.benchmarks.dispatch` (a fresh database per round).

Conditions (printed with the table):

- one worker process each. Moorline: one process, async slots (``--slots``); Celery: one
  process, ``--pool solo`` (its fastest for no-op tasks: no IPC to a child); Procrastinate: one
  process, ``--concurrency 16`` (async);
- the same work: a task that does nothing; Celery's increments a Redis counter so "done" means
  it ran, Procrastinate's completion is its ``succeeded`` row;
- durability differs and is stated: Moorline and Procrastinate commit every submission and
  every outcome to PostgreSQL; Celery's Redis broker acks a task when a worker takes it (before
  it runs), and nothing of the outcome is stored;
- warm-up excluded: interpreter start and imports happen before the clock starts for Moorline
  and for the enqueue figures; a peer's drain includes its worker's start-up (about a second),
  so it is measured over ``--runs`` large enough to make that small.

    .venv/bin/python bench/peers/run.py [--runs 5000] [--rounds 3] [--peers celery,procrastinate]
"""

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import venv
from functools import partial
from pathlib import Path

from moorline.benchmarks.common import on_fresh_database
from moorline.benchmarks.dispatch import DispatchSizes, drain_round, enqueue_round

HERE = Path(__file__).resolve().parent
VENV = HERE / ".venv"
PEER_PACKAGES = ["celery[redis]>=5.3", "procrastinate>=2.0", "psycopg[binary]>=3.1"]


def peers_python() -> Path:
    """The peers' interpreter, creating their venv and installing them on first use."""
    python = VENV / "bin" / "python"
    stamp = VENV / ".installed"
    if not stamp.exists():
        print(f"creating {VENV} with {', '.join(PEER_PACKAGES)} (once)", file=sys.stderr)
        venv.create(VENV, with_pip=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", *PEER_PACKAGES], check=True)
        stamp.touch()
    return python


def peer_round(python: Path, peer: str, runs: int) -> dict[str, float]:
    done = subprocess.run(
        [str(python), str(HERE / "peer_driver.py"), peer, str(runs)],
        check=True,
        capture_output=True,
        text=True,
        timeout=900,
    )
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def moorline_round(runs: int, slots: int) -> dict[str, float]:
    sizes = DispatchSizes(enqueue_runs=runs, drain_runs=runs, slots=slots, producers=16)
    figures = asyncio.run(on_fresh_database("postgresql", partial(enqueue_round, sizes=sizes)))
    figures |= asyncio.run(on_fresh_database("postgresql", partial(drain_round, sizes=sizes)))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--peers", default="celery,procrastinate")
    args = parser.parse_args()
    python = peers_python()
    measured: dict[str, dict[str, list[float]]] = {}
    systems = ["moorline", *args.peers.split(",")]
    for _ in range(args.rounds):
        for system in systems:
            if system == "moorline":
                found = moorline_round(args.runs, args.slots)
            else:
                found = peer_round(python, system, args.runs)
            for key, value in found.items():
                measured.setdefault(system, {}).setdefault(key, []).append(value)
    print(f"no-op tasks, {args.runs} per round, one worker process each, median of {args.rounds}")
    print("| System | Enqueue (tasks/s) | Drain (tasks/s) | Moorline / it (enqueue, drain) |")
    print("|---|---:|---:|---:|")
    ours = {key: statistics.median(values) for key, values in measured["moorline"].items()}
    for system in systems:
        median = {key: statistics.median(values) for key, values in measured[system].items()}
        ratios = (
            f"{ours['enqueue'] / median['enqueue']:.2f}x, {ours['drain'] / median['drain']:.2f}x"
        )
        print(f"| {system} | {median['enqueue']:,.0f} | {median['drain']:,.0f} | {ratios} |")


if __name__ == "__main__":
    main()
