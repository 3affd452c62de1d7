"""Moorline against peers on the same no-op workload, in one run: enqueue and drain rates.

Peers run in their own venv, ``bench/peers/.venv``, created on first use with Celery (Redis
broker) and Procrastinate (PostgreSQL) from PyPI; Moorline's own environment is never touched.
Every system runs through a driver process of its own (``moorline_driver.py``,
``peer_driver.py``), one after the other within each round, so each has the machine to itself;
each figure is the median of ``--rounds`` rounds, and Moorline's ratios are taken against the
peers' figures of the same run. Timing is the same for all (``timing.py``):

- **the same shape**: ``--producers`` concurrent producers in one process; ``--workers`` worker
  processes, each running ``--concurrency`` tasks at a time where the system allows it;
- **warm-up excluded**: each producer submits a few tasks before the enqueue clock starts; the
  drain clock starts once 10 % of the queued tasks are done, so the worker processes' start-up
  (interpreter, imports, connecting) and their first, cold tasks are outside it;
- **the same work**: a task that does nothing, and "done" read from the system's own record
  (Moorline's run status, Procrastinate's job status, a Redis counter the Celery task
  increments), polled every 20 ms;
- **durability differs, and is printed with the table** (``DURABILITY``).

    .venv/bin/python bench/peers/run.py [--quick] [--runs 5000] [--rounds 3] [--producers 16]
        [--workers 2] [--concurrency 16] [--peers celery,celery-acks-late,procrastinate]
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV = HERE / ".venv"
PEER_PACKAGES = ["celery[redis]>=5.3", "procrastinate>=2.0", "psycopg[binary]>=3.1"]
PEERS = ("celery", "celery-acks-late", "procrastinate")

DURABILITY = {
    "moorline": (
        "PostgreSQL, synchronous_commit on: a submission returns once its run is committed; "
        "a claim takes a lease, the outcome is committed after the run; a killed worker's run "
        "is run again after its lease (never lost)"
    ),
    "celery": (
        "Redis broker without persistence (a Redis restart loses the queue); acks a task when "
        "a worker takes it, BEFORE running it (acks_late off, the default): a killed worker "
        "loses its tasks; no result stored"
    ),
    "celery-acks-late": (
        "as celery, but acks after running (acks_late on): a killed worker's tasks are "
        "delivered again after the visibility timeout"
    ),
    "procrastinate": (
        "PostgreSQL, synchronous_commit on: a defer returns once its job is committed; the "
        "job is 'doing' while it runs and its outcome is committed after"
    ),
}


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


def one_round(system: str, python: Path, shape: list[str]) -> dict[str, float]:
    """One measurement of ``system`` by its driver; the driver's last line is its JSON."""
    if system == "moorline":
        command = [sys.executable, str(HERE / "moorline_driver.py"), *shape]
    else:
        command = [str(python), str(HERE / "peer_driver.py"), system, *shape]
    done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=1800)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def table(systems: list[str], measured: dict[str, dict[str, list[float]]]) -> list[str]:
    median = {
        system: {key: statistics.median(values) for key, values in measured[system].items()}
        for system in systems
    }
    ours = median["moorline"]
    lines = [
        "| System | Enqueue (tasks/s) | Drain (tasks/s) | Moorline ÷ it: enqueue | drain |"
        " Worker start-up (s, excluded) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for system in systems:
        it = median[system]
        lines.append(
            f"| {system} | {it['enqueue']:,.0f} | {it['drain']:,.0f} | "
            f"{ours['enqueue'] / it['enqueue']:.2f}x | {ours['drain'] / it['drain']:.2f}x | "
            f"{it['startup_s']:.1f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="500 tasks, 1 round: a smoke run")
    parser.add_argument("--runs", type=int, default=None, help="tasks per round (5000)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds, median taken (3)")
    parser.add_argument("--producers", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2, help="worker processes per system")
    parser.add_argument("--concurrency", type=int, default=16, help="tasks at once per worker")
    parser.add_argument("--peers", default=",".join(PEERS))
    args = parser.parse_args()
    runs = args.runs or (500 if args.quick else 5000)
    rounds = args.rounds or (1 if args.quick else 3)
    systems = ["moorline", *args.peers.split(",")]
    python = peers_python()
    shape = [str(runs), str(args.producers), str(args.workers), str(args.concurrency)]
    measured: dict[str, dict[str, list[float]]] = {}
    began = time.monotonic()
    for round_no in range(rounds):
        for system in systems:
            found = one_round(system, python, shape)
            print(f"round {round_no + 1}: {system} {json.dumps(found)}", file=sys.stderr)
            for key, value in found.items():
                measured.setdefault(system, {}).setdefault(key, []).append(value)
    print(
        f"No-op tasks: {runs} per round, median of {rounds} round(s), "
        f"{time.monotonic() - began:.0f} s in all. Each system: {args.producers} producers in "
        f"one process, {args.workers} worker processes of {args.concurrency} tasks at once "
        "(Celery's solo pool: 1), on this "
        "machine's PostgreSQL and Redis; warm-up and worker start-up outside the clocks."
    )
    print()
    print("\n".join(table(systems, measured)))
    print()
    for system in systems:
        print(f"- {system}: {DURABILITY[system]}")


if __name__ == "__main__":
    main()
