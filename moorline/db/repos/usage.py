"""LLM usage: a step's model calls, added to its run and to its tenant's day.

A step's usage is written by :meth:`~moorline.db.repos.steps.StepsRepo.succeed` (or ``fail``)
in the transaction of its checkpoint: ``steps.usage``, the run's counters and the
``llm_usage`` row of (tenant, UTC day, workflow, model) change together or not at all, so the
totals are exact and a checkpoint retried after a lost acknowledgement counts nothing twice
(the retry finds the step finished and writes nothing).

What replays saved (the recorded usage of steps returned from their checkpoint, which called
no model) is added by :meth:`UsageRepo.add_saved`, fenced, once per attempt that replayed.

Costs are the engine's: it prices the calls from the models file before they are written, so
a later price change never rewrites the past.
"""

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Insert, Update, bindparam, func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.backends import Backend, DialectName, backend_for
from moorline.db.manager import DatabaseManager
from moorline.db.repos.fences import hold_fence_txn
from moorline.db.repos.records import Fence
from moorline.db.schema import llm_usage, runs, steps
from moorline.db.types import utcnow
from moorline.types import RunId, TenantId
from moorline.usage import ModelTotals, StepUsage, usage_from_json

DAY_FORMAT = "%Y-%m-%d"

_KEYS = ("tenant_id", "day", "workflow", "model")
_RUN_COUNTERS = (
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "cost",
    "saved_tokens",
    "saved_cost",
)
_COUNTERS = (
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "requests",
    "failed_requests",
    "cost",
    "saved_tokens",
    "saved_cost",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Charge:
    """Usage to write for one run: what its step spent, or what its replays saved."""

    tenant_id: TenantId
    workflow: str
    spent: StepUsage = field(default_factory=dict)
    saved: StepUsage = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.spent and not self.saved


@dataclass(frozen=True, slots=True, kw_only=True)
class UsageRow:
    """One (workflow, model) of a tenant's totals."""

    workflow: str
    model: str
    totals: ModelTotals
    saved_tokens: int
    saved_cost: float


def utc_day() -> str:
    """Today's ``YYYY-MM-DD`` in UTC, the day usage is counted on."""
    return utcnow().strftime(DAY_FORMAT)


@functools.cache
def _statements(dialect: DialectName) -> tuple[Update, Insert]:
    """The run's counters' UPDATE and ``llm_usage``'s upsert, built once per dialect.

    Parameters of the UPDATE: ``usage_run_id`` and ``add_<column>`` for each run counter; the
    upsert takes ``llm_usage`` rows.
    """
    added = {
        column: runs.c[column] + bindparam(f"add_{column}", type_=runs.c[column].type)
        for column in _RUN_COUNTERS
    }
    counters = update(runs).where(runs.c.id == bindparam("usage_run_id")).values(**added)
    upsert = backend_for(dialect).add_to_counters(llm_usage, keys=_KEYS, columns=_COUNTERS)
    return counters, upsert


async def add_usage_txn(
    conn: AsyncConnection, backend: Backend, run_id: RunId, charge: Charge
) -> None:
    """Add ``charge`` to the run's counters and its tenant's day, in the caller's transaction.

    The caller holds the run's row (its fence): this only adds.
    """
    spent = _sum(charge.spent.values())
    saved = _sum(charge.saved.values())
    counters, upsert = _statements(backend.name)
    await conn.execute(
        counters,
        {
            "usage_run_id": run_id,
            "add_prompt_tokens": spent.prompt_tokens,
            "add_completion_tokens": spent.completion_tokens,
            "add_cached_tokens": spent.cached_tokens,
            "add_cost": spent.cost,
            "add_saved_tokens": saved.tokens,
            "add_saved_cost": saved.cost,
        },
    )
    day = utc_day()
    rows: list[dict[str, Any]] = []
    for model in sorted(set(charge.spent) | set(charge.saved)):
        used = charge.spent.get(model, ModelTotals())
        kept = charge.saved.get(model, ModelTotals())
        rows.append(
            {
                "tenant_id": charge.tenant_id,
                "day": day,
                "workflow": charge.workflow,
                "model": model,
                **{name: getattr(used, name) for name in _COUNTERS[:6]},
                "saved_tokens": kept.tokens,
                "saved_cost": kept.cost,
            }
        )
    await conn.execute(upsert, rows)


def _sum(totals: Sequence[ModelTotals] | Any) -> ModelTotals:
    total = ModelTotals()
    for entry in totals:
        total.add(entry)
    return total


class UsageRepo:
    """Reads of the usage totals, and the saved tokens of replays."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db
        self._backend: Backend = db.backend

    async def add_saved(self, fence: Fence, charge: Charge) -> None:
        """Add what this attempt's replays saved to its run and its tenant's day, fenced.

        Not retried: it adds, so a retry after a lost acknowledgement could count twice.

        Raises:
            LeaseLost: The fence no longer holds; nothing was written.
        """
        if charge.empty:
            return
        async with self._db.write_transaction() as conn:
            await hold_fence_txn(conn, self._backend.name, fence, "saved usage")
            await add_usage_txn(conn, self._backend, fence.run_id, charge)

    async def run_by_model(self, run_id: RunId) -> StepUsage:
        """A run's spent usage by model: the sum of its steps' usage."""

        async def read() -> StepUsage:
            async with self._db.connect() as conn:
                result = await conn.execute(
                    select(steps.c.usage).where(
                        steps.c.run_id == run_id, steps.c.usage.is_not(None)
                    )
                )
                totals: StepUsage = {}
                for (stored,) in result:
                    for model, entry in usage_from_json(stored).items():
                        totals.setdefault(model, ModelTotals()).add(entry)
                return totals

        return await self._db.with_retry(read)

    async def tenant_day(self, tenant_id: TenantId, day: str) -> list[UsageRow]:
        """A tenant's rows of ``day``, one per (workflow, model)."""

        async def read() -> list[UsageRow]:
            async with self._db.connect() as conn:
                result = await conn.execute(
                    select(llm_usage).where(
                        llm_usage.c.tenant_id == tenant_id, llm_usage.c.day == day
                    )
                )
                return [_row(row) for row in result.mappings()]

        return await self._db.with_retry(read)

    async def tenants_day(
        self, tenant_ids: Iterable[TenantId], day: str
    ) -> dict[TenantId, tuple[int, float]]:
        """Tenant → (tokens, cost) of ``day``, for the tenants that used any (one read)."""
        wanted = list(tenant_ids)
        if not wanted:
            return {}
        tokens = func.sum(llm_usage.c.prompt_tokens + llm_usage.c.completion_tokens)
        stmt = (
            select(llm_usage.c.tenant_id, tokens, func.sum(llm_usage.c.cost))
            .where(llm_usage.c.tenant_id.in_(wanted), llm_usage.c.day == day)
            .group_by(llm_usage.c.tenant_id)
        )

        async def read() -> dict[TenantId, tuple[int, float]]:
            async with self._db.connect() as conn:
                rows = (await conn.execute(stmt)).all()
            return {TenantId(row[0]): (int(row[1] or 0), float(row[2] or 0.0)) for row in rows}

        return await self._db.with_retry(read)

    async def totals(self, *, by_tenant: bool = False) -> list[tuple[str, str, UsageRow]]:
        """All-time totals per model (and tenant): ``(tenant or "", model, row)``."""
        group = [llm_usage.c.model] + ([llm_usage.c.tenant_id] if by_tenant else [])
        sums = [func.sum(llm_usage.c[name]).label(name) for name in _COUNTERS]

        async def read() -> list[tuple[str, str, UsageRow]]:
            async with self._db.connect() as conn:
                result = await conn.execute(select(*group, *sums).group_by(*group))
                out: list[tuple[str, str, UsageRow]] = []
                for row in result.mappings():
                    tenant = str(row["tenant_id"]) if by_tenant else ""
                    out.append((tenant, str(row["model"]), _row({**row, "workflow": ""})))
                return out

        return await self._db.with_retry(read)


def _row(row: Mapping[Any, Any]) -> UsageRow:
    return UsageRow(
        workflow=str(row["workflow"]),
        model=str(row["model"]),
        totals=ModelTotals(
            prompt_tokens=int(row["prompt_tokens"] or 0),
            completion_tokens=int(row["completion_tokens"] or 0),
            cached_tokens=int(row["cached_tokens"] or 0),
            requests=int(row["requests"] or 0),
            failed_requests=int(row["failed_requests"] or 0),
            cost=float(row["cost"] or 0.0),
        ),
        saved_tokens=int(row["saved_tokens"] or 0),
        saved_cost=float(row["saved_cost"] or 0.0),
    )
