"""The soak's history checker: reads runs, events and steps and names every run lost or doubled.

It checks, over the runs the soak had accepted (HTTP 202/200 with a run id):

- **lost**: a submitted run that is not in a terminal status, or not in the database at all;
- **unexpected**: a run in the database the soak never got an id for (a submission doubled);
- **duplicate terminal**: more than one terminal event (``succeeded``, ``failed``, ...) in a
  run's history, or a terminal status without its terminal event;
- **step re-run**: an execution of a step (from the soak app's execution log) by an attempt
  later than the one whose checkpoint is stored, or two executions by the checkpoint's own
  attempt: the step ran again although its result was already recorded.

Executions by attempts *earlier* than the checkpoint's are the at-least-once part of the
guarantee (the worker died between running the step and recording it) and are counted, not
flagged.

    python -m tests.soak.history DATABASE_URL EXECUTION_LOG [RUN_ID_FILE]
"""

import asyncio
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select

from moorline.db.manager import DatabaseManager
from moorline.db.repos.events import TERMINAL_EVENT_TYPES
from moorline.db.schema import events, runs, steps
from moorline.settings import Settings
from moorline.types import TERMINAL_STATUSES

Execution = tuple[str, str, int]
"""(run id, step key, attempt) of one logged execution of a step function."""


@dataclass
class History:
    """What the checker found; ``ok`` when nothing was lost or doubled."""

    submitted: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    duplicate_terminal: list[str] = field(default_factory=list)
    step_reruns: list[str] = field(default_factory=list)
    executions: int = 0
    checkpoints: int = 0
    replays_before_checkpoint: int = 0
    """Executions by an attempt before the checkpoint's: allowed (at-least-once)."""
    timelines: dict[str, list[str]] = field(default_factory=dict)
    waits_s: list[float] = field(default_factory=list)
    """Submit → first start of every started run (database clock)."""
    durations_s: list[float] = field(default_factory=list)
    """Submit → finish of every finished run (database clock)."""

    @property
    def terminal(self) -> int:
        return sum(n for status, n in self.statuses.items() if status in TERMINAL_STATUSES)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.unexpected or self.duplicate_terminal or self.step_reruns)

    def offending(self) -> list[str]:
        return sorted(set(self.lost + self.unexpected + self.duplicate_terminal + self.step_reruns))

    def describe(self) -> str:
        """A summary, then each offending run's events (seq, type, attempt)."""
        lines = [
            f"submitted {self.submitted}, terminal {self.terminal}, "
            f"statuses {dict(sorted(self.statuses.items()))}",
            f"step executions {self.executions} for {self.checkpoints} checkpoints "
            f"({self.replays_before_checkpoint} re-executions before a checkpoint, allowed)",
            f"submit→start p50 {_quantile(self.waits_s, 0.5):.2f} s, p99 "
            f"{_quantile(self.waits_s, 0.99):.2f} s, max {_quantile(self.waits_s, 1):.2f} s; "
            f"submit→finish p50 {_quantile(self.durations_s, 0.5):.2f} s, "
            f"max {_quantile(self.durations_s, 1):.2f} s",
            f"lost {len(self.lost)}, unexpected {len(self.unexpected)}, duplicate terminal "
            f"{len(self.duplicate_terminal)}, step re-runs after a checkpoint "
            f"{len(self.step_reruns)}",
        ]
        for run_id in self.offending()[:20]:
            reasons = [
                name
                for name, found in (
                    ("lost", self.lost),
                    ("unexpected", self.unexpected),
                    ("duplicate terminal", self.duplicate_terminal),
                    ("step re-run", self.step_reruns),
                )
                if run_id in found
            ]
            lines.append(f"run {run_id} ({', '.join(reasons)}):")
            lines += [f"    {entry}" for entry in self.timelines.get(run_id, ["no events"])]
        return "\n".join(lines)


def _quantile(values: list[float], share: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(share * len(ordered)) - 1))]


def read_executions(log: Path) -> list[Execution]:
    """The logged executions; a torn last line (a process killed mid-write) is skipped."""
    if not log.exists():
        return []
    found = []
    for line in log.read_text().splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2].isdigit():
            found.append((parts[0], parts[1], int(parts[2])))
    return found


async def check(database_url: str, submitted: list[str], log: Path) -> History:
    """Check the soak database at ``database_url`` against the runs the soak submitted."""
    history = History(submitted=len(submitted))
    db = DatabaseManager(Settings(database_url=database_url))
    try:
        async with db.connect() as conn:
            run_rows = (
                await conn.execute(
                    select(
                        runs.c.id,
                        runs.c.status,
                        runs.c.created_at,
                        runs.c.started_at,
                        runs.c.finished_at,
                    )
                )
            ).all()
            event_rows = (
                await conn.execute(
                    select(events.c.run_id, events.c.seq, events.c.type, events.c.attempt).order_by(
                        events.c.run_id, events.c.seq
                    )
                )
            ).all()
            checkpoint_rows = (
                await conn.execute(
                    select(steps.c.run_id, steps.c.key, steps.c.attempt).where(
                        steps.c.status == "succeeded"
                    )
                )
            ).all()
    finally:
        await db.dispose()

    status_of = {row.id: row.status for row in run_rows}
    history.waits_s = [
        (row.started_at - row.created_at).total_seconds() for row in run_rows if row.started_at
    ]
    history.durations_s = [
        (row.finished_at - row.created_at).total_seconds() for row in run_rows if row.finished_at
    ]
    timelines: defaultdict[str, list[str]] = defaultdict(list)
    terminal_events: Counter[str] = Counter()
    for row in event_rows:
        timelines[row.run_id].append(f"{row.seq:3} {row.type} (attempt {row.attempt})")
        if row.type in TERMINAL_EVENT_TYPES:
            terminal_events[row.run_id] += 1

    wanted = set(submitted)
    history.statuses = Counter(status_of[run_id] for run_id in wanted if run_id in status_of)
    history.lost = sorted(
        run_id for run_id in wanted if status_of.get(run_id) not in TERMINAL_STATUSES
    )
    history.unexpected = sorted(set(status_of) - wanted)
    history.duplicate_terminal = sorted(
        run_id
        for run_id, status in status_of.items()
        if terminal_events[run_id] > 1
        or (
            status in TERMINAL_STATUSES and status != "rate_limited" and not terminal_events[run_id]
        )
    )

    checkpoint_attempt = {(row.run_id, row.key): row.attempt for row in checkpoint_rows}
    history.checkpoints = len(checkpoint_attempt)
    executions = read_executions(log)
    history.executions = len(executions)
    by_checkpoint_attempt: Counter[tuple[str, str]] = Counter()
    rerun: set[str] = set()
    for run_id, key, attempt in executions:
        stored = checkpoint_attempt.get((run_id, key))
        if stored is None:
            continue  # never recorded: the run's later attempts ran it again, as they must
        if attempt > stored:
            rerun.add(run_id)
        elif attempt == stored:
            by_checkpoint_attempt[(run_id, key)] += 1
        else:
            history.replays_before_checkpoint += 1
    rerun |= {run_id for (run_id, _), count in by_checkpoint_attempt.items() if count > 1}
    history.step_reruns = sorted(rerun)
    history.timelines = {run_id: timelines[run_id] for run_id in history.offending()}
    return history


def main() -> None:
    """Check a soak database left behind (``--keep``), from the command line."""
    if len(sys.argv) not in (3, 4):
        print(__doc__.splitlines()[-1].strip(), file=sys.stderr)
        raise SystemExit(2)
    url, log = sys.argv[1], Path(sys.argv[2])
    if len(sys.argv) == 4:
        submitted = Path(sys.argv[3]).read_text().split()
    else:
        submitted = asyncio.run(_all_run_ids(url))
    history = asyncio.run(check(url, submitted, log))
    print(history.describe())
    raise SystemExit(0 if history.ok else 1)


async def _all_run_ids(url: str) -> list[str]:
    db = DatabaseManager(Settings(database_url=url))
    try:
        async with db.connect() as conn:
            return [row.id for row in await conn.execute(select(runs.c.id))]
    finally:
        await db.dispose()


if __name__ == "__main__":
    main()
