"""Reads of single runs by id or idempotency key, and the helpers the run writers share.

:class:`RunRepoBase` holds what every part of :class:`~moorline.db.repos.runs.RunsRepo`
needs (the manager and its backend); the reads here open their own connection and are retried
on a lost connection like every public repository method.
"""

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.backends import Backend
from moorline.db.manager import DatabaseManager
from moorline.db.repos.records import Run, run_from_row
from moorline.db.schema import runs
from moorline.types import RunId, TenantId

IN_CHUNK = 1000
"""Ids per IN list; far below every backend's bound-parameter limit (asyncpg: 32,767)."""


class RunRepoBase:
    """The database a run repository works on, and that database's backend."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db
        self._backend: Backend = db.backend


class RunReads(RunRepoBase):
    """Runs read by id or by idempotency key."""

    async def get(self, run_id: RunId) -> Run | None:
        """The run, or None when there is none with that id."""
        return (await self.get_many([run_id])).get(run_id)

    async def get_many(self, run_ids: Sequence[RunId]) -> dict[RunId, Run]:
        """The runs among ``run_ids`` that exist, by id."""
        wanted = sorted(set(run_ids))
        if not wanted:
            return {}

        async def read() -> dict[RunId, Run]:
            async with self._db.connect() as conn:
                return await select_runs_txn(conn, wanted)

        return await self._db.with_retry(read)

    async def find_by_idempotency_key(self, tenant_id: TenantId, key: str) -> Run | None:
        """The tenant's run stored under idempotency ``key``, or None."""
        return (await self.find_by_idempotency_keys(tenant_id, [key])).get(key)

    async def find_by_idempotency_keys(
        self, tenant_id: TenantId, keys: Sequence[str]
    ) -> dict[str, Run]:
        """The tenant's runs stored under any of ``keys``, by key (a bulk submission's)."""
        wanted = sorted(set(keys))
        if not wanted:
            return {}

        async def read() -> dict[str, Run]:
            found: dict[str, Run] = {}
            async with self._db.connect() as conn:
                for offset in range(0, len(wanted), IN_CHUNK):
                    chunk = wanted[offset : offset + IN_CHUNK]
                    stmt = select(runs).where(
                        runs.c.tenant_id == tenant_id, runs.c.idempotency_key.in_(chunk)
                    )
                    for row in (await conn.execute(stmt)).mappings():
                        found[row["idempotency_key"]] = run_from_row(row)
            return found

        return await self._db.with_retry(read)


async def select_runs_txn(conn: AsyncConnection, run_ids: Sequence[str]) -> dict[RunId, Run]:
    """The runs among ``run_ids`` that exist, by id, read in the caller's transaction."""
    found: dict[RunId, Run] = {}
    for offset in range(0, len(run_ids), IN_CHUNK):
        chunk = list(run_ids[offset : offset + IN_CHUNK])
        rows = await conn.execute(select(runs).where(runs.c.id.in_(chunk)))
        for row in rows.mappings():
            run = run_from_row(row)
            found[run.run_id] = run
    return found


async def db_now_txn(conn: AsyncConnection, backend: Backend) -> datetime:
    """The database's current time, read once for a transaction's writes."""
    now: datetime = (await conn.execute(backend.select_now())).scalar_one()
    return now
