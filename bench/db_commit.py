"""Commit rate through DatabaseManager.transaction(), per backend, against a baseline.

Each round commits ``--commits`` one-row write transactions (an event insert, the commonest write
a worker makes) one after another, first through ``DatabaseManager.transaction()`` and then
through a bare SQLAlchemy ``engine.begin()`` on the same database: the ratio is the cost of the
manager's own machinery (IMMEDIATE begin on SQLite, failover creator and pre-ping elsewhere).
Prints the median of ``--rounds`` rounds with min and max.

    .venv/bin/python bench/db_commit.py [--commits 500] [--rounds 3] [--backends sqlite,...]
"""

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from common import on_fresh_database, summary
from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.db.schema import events, runs, tenants
from moorline.db.types import utcnow
from moorline.settings import Settings


async def seed(db: DatabaseManager) -> str:
    now = utcnow()
    tenant_id, run_id = str(uuid.uuid4()), str(uuid.uuid4())
    async with db.transaction() as conn:
        await conn.execute(
            insert(tenants).values(
                id=tenant_id, name=f"bench-{tenant_id}", plan="free", created_at=now, updated_at=now
            )
        )
        await conn.execute(
            insert(runs).values(
                id=run_id,
                tenant_id=tenant_id,
                workflow="bench",
                status="running",
                lane="workflow",
                priority=0,
                attempt=1,
                max_attempts=3,
                not_before=now,
                input_hash="0" * 64,
                input={},
                created_at=now,
                updated_at=now,
            )
        )
    return run_id


Opener = Callable[[], AbstractAsyncContextManager[AsyncConnection]]


async def commit_rate(open_tx: Opener, run_id: str, first_seq: int, commits: int) -> float:
    started = time.perf_counter()
    for seq in range(first_seq, first_seq + commits):
        async with open_tx() as conn:
            await conn.execute(
                insert(events).values(
                    run_id=run_id,
                    seq=seq,
                    type="bench",
                    attempt=1,
                    data={"n": seq},
                    created_at=utcnow(),
                )
            )
    return commits / (time.perf_counter() - started)


async def measure(url: str, commits: int, rounds: int) -> tuple[list[float], list[float]]:
    db = DatabaseManager(Settings(database_url=url))
    await upgrade(db)
    await db.initialize()
    try:
        run_id = await seed(db)
        managed: list[float] = []
        bare: list[float] = []
        seq = 0
        for _ in range(rounds):
            managed.append(await commit_rate(db.transaction, run_id, seq, commits))
            seq += commits
            bare.append(await commit_rate(db.engine.begin, run_id, seq, commits))
            seq += commits
        return managed, bare
    finally:
        await db.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default="sqlite,postgresql,mysql")
    args = parser.parse_args()
    print(f"one-row write transactions, {args.commits} per round, median of {args.rounds}")
    for backend in args.backends.split(","):
        managed, bare = asyncio.run(
            on_fresh_database(backend, lambda url: measure(url, args.commits, args.rounds))
        )
        ratio = statistics.median(managed) / statistics.median(bare)
        print(f"{backend:10} manager {summary(managed)}  bare {summary(bare)}  ratio {ratio:.2f}")


if __name__ == "__main__":
    main()
