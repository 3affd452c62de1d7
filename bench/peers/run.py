"""Moorline beside its peers on the same no-op workload, in one run, all through public APIs.

Peers run in their own venv, ``bench/peers/.venv``, created on first use with
``PEER_PACKAGES`` from PyPI; Moorline's own environment is never touched. Every system runs
through a driver process of its own (``moorline_driver.py``, ``peer_driver.py`` with
``peer_<name>.py``), one after the other, so each has the machine to itself; each figure is the
median of ``--rounds`` rounds, and Moorline's ratios are taken against the peers' figures of the
same run, per storage (``GROUPS``). Timing is the same for all (``timing.py``):

- **enqueue**: one producer, one call at a time (``--runs``); **bulk**: one producer, the
  system's documented bulk call, ``--batch`` tasks a call (``--bulk-runs``);
- **drain**: one worker process at the system's defaults runs everything enqueued above (a
  system with no bulk call gets the bulk's count enqueued one at a time, untimed, so every
  worker drains as many tasks); the clock runs from 10 % done to the last, so start-up is
  outside it. Moorline adds ``drain_wide`` (``--wide-slots`` slots) and, with DBOS,
  ``drain_step`` (``--step-runs`` workflows of one checkpointed step; 2,000, so that the
  quicker system's clock runs for seconds, not a few of the 20 ms polls);
- **latency**: enqueue → start of one task at a time, the worker idle (``--latency-runs``);
- **the same work**: a task that does nothing; "done" read from the system's own record;
- **durability differs, and is printed with the table** (``DURABILITY``).

    .venv/bin/python bench/peers/run.py [--quick] [--rounds 1] [--runs 300] [--bulk-runs 3000]
        [--step-runs 2000] [--latency-runs 100] [--systems moorline-sqlite,huey-sqlite,...]
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
import venv
from pathlib import Path

from report import DURABILITY, GROUPS, figures_table, ratio_table

HERE = Path(__file__).resolve().parent
VENV = HERE / ".venv"
PEER_PACKAGES = [
    "celery[redis]==5.7.0",
    "redis==8.1.0",
    "procrastinate==3.10.0",
    "psycopg[binary]==3.3.9",
    "pgqueuer[asyncpg]==1.6.0",
    "dbos==3.4.0",
    "huey==3.5.4",
]
SYSTEMS = [system for _, members in GROUPS for system in members]


def peers_python() -> Path:
    """The peers' interpreter, creating their venv and installing them on first use."""
    python = VENV / "bin" / "python"
    stamp = VENV / ".installed"
    if not stamp.exists() or stamp.read_text() != "\n".join(PEER_PACKAGES):
        print(f"installing {', '.join(PEER_PACKAGES)} into {VENV}", file=sys.stderr)
        if not python.exists():
            venv.create(VENV, with_pip=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", *PEER_PACKAGES], check=True)
        stamp.write_text("\n".join(PEER_PACKAGES))
    return python


def one_round(system: str, python: Path, config: dict[str, int]) -> dict[str, float]:
    """One measurement of ``system`` (``name-storage``) by its driver; its last line is JSON."""
    name, storage = system.rsplit("-", 1)
    storage = {"pgredis": "postgresql+redis", "pg": "postgresql"}.get(storage, storage)
    if name == "moorline":
        command = [sys.executable, str(HERE / "moorline_driver.py"), storage, json.dumps(config)]
    else:
        command = [str(python), str(HERE / "peer_driver.py"), name, storage, json.dumps(config)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, cwd=HERE)
    if done.returncode != 0:
        raise SystemExit(f"{system} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 round: a smoke run")
    parser.add_argument("--rounds", type=int, default=1, help="rounds, median taken")
    parser.add_argument("--runs", type=int, default=None, help="one-at-a-time enqueues (300)")
    parser.add_argument("--bulk-runs", type=int, default=None, help="bulk enqueues (3000)")
    parser.add_argument("--batch", type=int, default=1000, help="tasks a bulk call")
    parser.add_argument("--step-runs", type=int, default=None, help="one-step runs (2000)")
    parser.add_argument("--latency-runs", type=int, default=None, help="latency probes (100)")
    parser.add_argument("--wide-slots", type=int, default=64, help="Moorline's wider worker")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    args = parser.parse_args()
    quick = args.quick
    config = {
        "runs": args.runs or (50 if quick else 300),
        "bulk_runs": args.bulk_runs or (500 if quick else 3000),
        "step_runs": args.step_runs or (100 if quick else 2000),
        "latency_runs": args.latency_runs or (10 if quick else 100),
        "batch": args.batch,
        "wide_slots": args.wide_slots,
    }
    systems = args.systems.split(",")
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"--systems: unknown {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    python = peers_python()
    measured: dict[str, dict[str, list[float]]] = {}
    began = time.monotonic()
    for round_no in range(args.rounds):
        for system in systems:
            try:
                found = one_round(system, python, config)
            except (SystemExit, subprocess.TimeoutExpired) as failed:
                # One system's failure leaves the others' figures standing; it is reported.
                print(f"round {round_no + 1}: {system} FAILED: {failed}", file=sys.stderr)
                continue
            print(f"round {round_no + 1}: {system} {json.dumps(found)}", file=sys.stderr)
            for key, value in found.items():
                measured.setdefault(system, {}).setdefault(key, []).append(value)
    median = {
        system: {key: statistics.median(values) for key, values in figures.items()}
        for system, figures in measured.items()
    }
    print(
        f"No-op tasks, median of {args.rounds} round(s), {time.monotonic() - began:.0f} s in "
        f"all: {json.dumps(config)}. One producer; one worker process per system at its "
        "defaults; this machine's PostgreSQL and Redis; warm-up and worker start-up outside "
        "the clocks."
    )
    print()
    print("\n".join(figures_table(median)))
    print()
    print("\n".join(ratio_table(median)))
    print()
    for system in systems:
        print(f"- {system}: {DURABILITY[system]}")
    for system in systems:
        if system.startswith("moorline-") and system in median:
            it = median[system]
            print(
                f"- {system}: `moorline worker` at its defaults served the run's lane with "
                f"{it['slots']:.0f} slots, the plan's tenant cap {it['tenant_cap']:.0f}; the "
                f"wider worker had {config['wide_slots']} slots and a tenant cap as large"
            )


if __name__ == "__main__":
    main()
