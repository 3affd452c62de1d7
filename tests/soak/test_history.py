"""The history checker finds what it is there to find: runs lost, doubled, or steps re-run.

A hand-written history on SQLite (the checker only reads ``runs``, ``events`` and ``steps``):
one clean run, and one run for each kind of breakage, each of which must be named.
"""

import asyncio
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import insert, update

from moorline.db.manager import DatabaseManager
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.db.schema import events, runs, steps, tenants
from moorline.db.types import utcnow
from moorline.settings import Settings
from moorline.types import TenantId
from tests.soak.history import check, read_executions


async def make_history(url: str, log: Path) -> dict[str, str]:
    db = DatabaseManager(Settings(database_url=url))
    await db.initialize()
    now = utcnow()
    try:
        tenant = TenantId(str(uuid.uuid4()))
        async with db.transaction() as conn:
            await conn.execute(
                insert(tenants).values(
                    id=tenant, name="t", plan="bulk", created_at=now, updated_at=now
                )
            )
        names = ["clean", "lost", "doubled", "rerun", "early_retry"]
        made = await RunsRepo(db).submit_many(
            [NewRun(tenant_id=tenant, workflow="soak", input={}, lane="w") for _ in names]
        )
        ids: dict[str, str] = {name: run.run_id for name, run in zip(names, made, strict=True)}
        async with db.transaction() as conn:
            for name, run_id in ids.items():
                status = "running" if name == "lost" else "succeeded"
                await conn.execute(
                    update(runs).where(runs.c.id == run_id).values(status=status, attempt=2)
                )
                history: list[tuple[str, int]] = [("started", 1)]
                if name != "lost":
                    history.append(("succeeded", 2))
                if name == "doubled":
                    history.append(("failed", 2))
                rows: list[dict[str, Any]] = [
                    {
                        "run_id": run_id,
                        "seq": seq,
                        "type": kind,
                        "attempt": attempt,
                        "data": {},
                        "created_at": now,
                    }
                    for seq, (kind, attempt) in enumerate(history, start=2)
                ]
                await conn.execute(insert(events), rows)
                await conn.execute(
                    insert(steps).values(
                        run_id=run_id,
                        key="s0",
                        status="succeeded",
                        attempt=2,
                        function="work",
                        call_hash="0" * 64,
                        output=0,
                        started_at=now,
                        finished_at=now,
                    )
                )
        lines = [f"{run_id} s0 2 1" for run_id in ids.values()]
        lines.append(f"{ids['rerun']} s0 3 1")  # ran again by a later attempt
        lines.append(f"{ids['early_retry']} s0 1 1")  # died before recording: allowed
        torn = f"\n{ids['clean']} s0 2"  # a last line cut short by a kill
        await asyncio.to_thread(log.write_text, "\n".join(lines) + torn)
        return ids
    finally:
        await db.dispose()


async def test_checker_names_each_broken_run(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/soak.db"
    log = tmp_path / "executions.log"
    ids = await make_history(url, log)
    submitted = [run_id for name, run_id in ids.items() if name != "clean"] + ["never-stored"]
    history = await check(url, submitted, log)

    assert history.lost == sorted([ids["lost"], "never-stored"])
    assert history.unexpected == [ids["clean"]]
    assert history.duplicate_terminal == [ids["doubled"]]
    assert history.step_reruns == [ids["rerun"]]
    assert history.replays_before_checkpoint == 1
    assert history.executions == len(read_executions(log)) == 7
    assert not history.ok
    described = history.describe()
    for name in ("lost", "doubled", "rerun"):
        assert f"run {ids[name]}" in described
    assert "succeeded (attempt 2)" in described and "failed (attempt 2)" in described


async def test_clean_runs_are_not_named(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/soak.db"
    log = tmp_path / "executions.log"
    ids = await make_history(url, log)
    clean = [ids["clean"], ids["early_retry"]]
    history = await check(url, clean, log)
    assert history.lost == []
    assert history.terminal == 2
    # Every run in the database is checked for doubles, submitted by this soak or not.
    assert history.duplicate_terminal == [ids["doubled"]]
    assert not set(clean) & set(history.offending())
