"""``make soak``: the full-size chaos soak, minutes to hours.

    python -m tests.soak [--minutes 10] [--share 0.7] [--rate R] [--seed N] [--keep DIR]

The load is ``--share`` of the drain rate a calibration measures first, unless ``--rate`` fixes
it; Redis is restarted every minute.

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
    parser.add_argument(
        "--share", type=float, default=0.7, help="load as a share of the measured drain rate"
    )
    parser.add_argument(
        "--rate", type=float, default=None, help="runs submitted per second (skips the share)"
    )
    parser.add_argument(
        "--calibration-s", type=float, default=30.0, help="seconds the drain rate is measured"
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the fault schedule")
    parser.add_argument("--keep", type=Path, default=None, help="keep the logs in this folder")
    args = parser.parse_args()
    stop_on_sigterm()
    load_s = args.minutes * 60
    config = SoakConfig(
        load_s=load_s,
        rate=args.rate,
        load_share=args.share,
        calibration_s=args.calibration_s,
        seed=args.seed,
        warm_up_s=min(120.0, max(25.0, load_s / 10)),
        drain_timeout_s=300.0,
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
