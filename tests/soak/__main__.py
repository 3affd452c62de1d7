"""``make soak``: the full-size chaos soak, minutes to hours.

    python -m tests.soak [--minutes 10] [--rate 8] [--seed N] [--keep DIR]

Prints what was done (runs, faults injected) and what held; exits 1 when anything failed.
"""

import argparse
import tempfile
from pathlib import Path

from tests.soak.chaos import SoakConfig, run_soak, stop_on_sigterm
from tests.soak.test_soak import failures


def main() -> None:
    parser = argparse.ArgumentParser(description="Moorline chaos soak (PostgreSQL + Redis).")
    parser.add_argument("--minutes", type=float, default=10.0, help="minutes of load and faults")
    parser.add_argument("--rate", type=float, default=3.0, help="runs submitted per second")
    parser.add_argument("--seed", type=int, default=None, help="seed of the fault schedule")
    parser.add_argument("--keep", type=Path, default=None, help="keep the logs in this folder")
    args = parser.parse_args()
    stop_on_sigterm()
    load_s = args.minutes * 60
    config = SoakConfig(
        load_s=load_s,
        rate=args.rate,
        seed=args.seed,
        warm_up_s=min(120.0, max(25.0, load_s / 10)),
        drain_timeout_s=120.0,
    )
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        result = run_soak(config, args.keep)
    else:
        with tempfile.TemporaryDirectory() as folder:
            result = run_soak(config, Path(folder))
    print(result.describe())
    problems = failures(result)
    for problem in problems:
        print(f"FAILED: {problem}")
    raise SystemExit(1 if problems else 0)


if __name__ == "__main__":
    main()
