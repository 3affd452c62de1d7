"""What the suspension fault tests check after every fault: the run table, events, effects.

After any mix of kills, decisions and timer sweeps, every run of the test must have ended
``succeeded`` through exactly one terminal transition, returned the decision recorded for it,
and no step may have run again after its checkpoint: each line of the effects file (written by
``tests/faults/suspension_app.py`` before a step returns) must come from an attempt no later
than the one that checkpointed the step. A step in flight at a kill may repeat, in the attempt
that then finishes it: that is invariant 3.
"""

import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import func, select

from moorline.db.manager import DatabaseManager
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.records import DecisionReason
from moorline.db.schema import events, interrupts, runs, steps
from moorline.types import TERMINAL_STATUSES, JSONObject, RunId, RunStatus

TERMINAL_EVENTS = [status.value for status in TERMINAL_STATUSES]
STEP_KEYS = ("prepare", "act", "finish")


@dataclass(frozen=True, slots=True, kw_only=True)
class Posted:
    """A decision the test posted (or expects the timer sweep to record)."""

    approved: bool
    reason: str
    data: JSONObject | None


async def count_by_status(db: DatabaseManager, run_ids: Sequence[str]) -> Counter[str]:
    async with db.connect() as conn:
        rows = await conn.execute(
            select(runs.c.status, func.count())
            .where(runs.c.id.in_(list(run_ids)))
            .group_by(runs.c.status)
        )
        return Counter({status: count for status, count in rows})


async def with_status(db: DatabaseManager, run_ids: Sequence[str], status: str) -> list[str]:
    async with db.connect() as conn:
        rows = await conn.execute(
            select(runs.c.id).where(runs.c.id.in_(list(run_ids)), runs.c.status == status)
        )
        return list(rows.scalars())


async def running_under(db: DatabaseManager, run_ids: Sequence[str], pattern: str) -> list[str]:
    """The runs ``running`` under a lease owner matching ``pattern``."""
    async with db.connect() as conn:
        rows = await conn.execute(
            select(runs.c.id).where(
                runs.c.id.in_(list(run_ids)),
                runs.c.status == RunStatus.RUNNING.value,
                runs.c.lease_owner.like(pattern),
            )
        )
        return list(rows.scalars())


async def events_of(db: DatabaseManager, run_ids: Sequence[str], kind: str) -> Counter[str]:
    """Run id → how many events of type ``kind`` it has."""
    async with db.connect() as conn:
        rows = await conn.execute(
            select(events.c.run_id, func.count())
            .where(events.c.run_id.in_(list(run_ids)), events.c.type == kind)
            .group_by(events.c.run_id)
        )
        return Counter({run_id: count for run_id, count in rows})


async def decide_all(db: DatabaseManager, run_ids: Sequence[RunId]) -> dict[RunId, Posted]:
    """Approve every other waiting run and deny the rest, each with data of its own."""
    repo = InterruptsRepo(db)
    posted: dict[RunId, Posted] = {}
    for index, run_id in enumerate(run_ids):
        [pending] = await repo.pending_for_run(run_id)
        approved = index % 2 == 0
        reason = DecisionReason.APPROVED if approved else DecisionReason.DENIED
        data: JSONObject = {"index": index}
        await repo.resolve(
            run_id, pending.interrupt_id, approved=approved, reason=reason, data=data
        )
        posted[run_id] = Posted(approved=approved, reason=reason.value, data=data)
    return posted


def read_effects(path: Path) -> dict[tuple[str, str], list[JSONObject]]:
    """(run, step key) → the effect lines the step left, in the order written."""
    found: dict[tuple[str, str], list[JSONObject]] = defaultdict(list)
    if path.exists():
        for line in path.read_text().splitlines():
            effect = json.loads(line)
            found[(effect["run"], effect["key"])].append(effect)
    return found


async def check_outcomes(
    db: DatabaseManager,
    run_ids: Sequence[RunId],
    effects: Path,
    posted: dict[RunId, Posted],
    *,
    keys: Sequence[str] = STEP_KEYS,
) -> None:
    """Every run succeeded once, with its recorded decision, and no step re-ran."""
    by_status = await count_by_status(db, run_ids)
    assert by_status == Counter({RunStatus.SUCCEEDED.value: len(run_ids)}), by_status
    async with db.connect() as conn:
        ended = Counter(
            (
                await conn.execute(
                    select(events.c.run_id).where(
                        events.c.run_id.in_(list(run_ids)), events.c.type.in_(TERMINAL_EVENTS)
                    )
                )
            ).scalars()
        )
        outputs = {
            row.id: row.output
            for row in await conn.execute(
                select(runs.c.id, runs.c.output).where(runs.c.id.in_(list(run_ids)))
            )
        }
        recorded = {
            row.run_id: row
            for row in await conn.execute(
                select(interrupts).where(interrupts.c.run_id.in_(list(run_ids)))
            )
        }
        checkpointed = {
            (row.run_id, row.key): row
            for row in await conn.execute(select(steps).where(steps.c.run_id.in_(list(run_ids))))
        }
    assert ended == Counter({run_id: 1 for run_id in run_ids}), "a run ended twice or never"
    done = read_effects(effects)
    for run_id in run_ids:
        want = posted.get(run_id)
        output = outputs[run_id]
        if want is not None:
            interrupt = recorded[run_id]
            # The decision recorded is the one posted, and the one the workflow acted on.
            assert (interrupt.reason, interrupt.decision) == (want.reason, want.data), run_id
            assert output == {"approved": want.approved, "reason": want.reason, "data": want.data}
            acted = [effect["value"] for effect in done[(run_id, "act")]]
            assert acted and set(acted) == {want.approved}, (run_id, acted)
        for key in keys:
            step = checkpointed[(run_id, key)]
            assert step.status == "succeeded", (run_id, key, step.status)
            lines = done[(run_id, key)]
            assert lines, f"step {key} of run {run_id} left no effect"
            late = [line for line in lines if int(str(line["attempt"])) > step.attempt]
            assert not late, f"step {key} of run {run_id} ran after its checkpoint: {late}"
