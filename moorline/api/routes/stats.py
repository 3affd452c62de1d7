"""Per-workflow statistics: ``GET /v1/stats/workflows`` (a tenant's) and its admin twin.

Throughput, failure rate and p50/p95 duration of the runs that ended in a time range
(:mod:`moorline.db.repos.run_stats`), for the dashboard's Statistics page and any client.
"""

from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import AwareDatetime, BaseModel, ConfigDict

from moorline.api.deps import CallerDep, ServicesDep, admin_router, authenticate_tenant
from moorline.api.errors import responses
from moorline.api.guards import authenticated_by
from moorline.api.routes.admin_runs import ADMIN_ERRORS
from moorline.db.repos.run_stats import MAX_DURATIONS, RunStats, WorkflowStats
from moorline.errors import InvalidRequest, RateLimited, Unauthorized
from moorline.types import TenantId

DEFAULT_RANGE = timedelta(hours=1)
MAX_RANGE = timedelta(days=31)


class WorkflowStatsOut(BaseModel):
    """One workflow's runs that ended in the range."""

    model_config = ConfigDict(frozen=True)

    workflow: str
    ended: int
    by_status: dict[str, int]
    failure_rate: float | None
    """``failed`` and ``timed_out`` runs over ``ended``; null when none ended."""
    runs_per_minute: float
    p50_seconds: float | None
    p95_seconds: float | None
    sampled: bool
    """The percentiles come from the newest ended runs of the range only."""


class WorkflowStatsList(BaseModel):
    """The range (UTC) and each workflow with a run that ended in it, by name."""

    model_config = ConfigDict(frozen=True)

    since: datetime
    until: datetime
    workflows: list[WorkflowStatsOut]


SinceQuery = Annotated[
    AwareDatetime | None,
    Query(description="Start of the range, with its offset (default: an hour before `until`)."),
]
UntilQuery = Annotated[
    AwareDatetime | None, Query(description="End of the range, with its offset (default: now).")
]


def _range(since: datetime | None, until: datetime | None) -> tuple[datetime, datetime]:
    end = (until or datetime.now(UTC)).astimezone(UTC)
    start = since.astimezone(UTC) if since is not None else end - DEFAULT_RANGE
    if start >= end:
        raise InvalidRequest("since: must be before until")
    if end - start > MAX_RANGE:
        raise InvalidRequest(f"since, until: a range of at most {MAX_RANGE.days} days")
    return start, end


async def _answer(
    services: ServicesDep,
    since: datetime | None,
    until: datetime | None,
    tenant_id: TenantId | None,
) -> WorkflowStatsList:
    start, end = _range(since, until)
    found = await RunStats(services.db).by_workflow(since=start, until=end, tenant_id=tenant_id)
    return WorkflowStatsList(since=start, until=end, workflows=[_out(s) for s in found])


def _out(stats: WorkflowStats) -> WorkflowStatsOut:
    return WorkflowStatsOut(
        workflow=stats.workflow,
        ended=stats.ended,
        by_status=stats.by_status,
        failure_rate=stats.failure_rate,
        runs_per_minute=stats.runs_per_minute,
        p50_seconds=stats.p50_s,
        p95_seconds=stats.p95_s,
        sampled=stats.sampled,
    )


async def tenant_stats(
    caller: CallerDep, services: ServicesDep, since: SinceQuery = None, until: UntilQuery = None
) -> WorkflowStatsList:
    """The tenant's runs that ended in the range, per workflow."""
    return await _answer(services, since, until, caller.tenant.tenant_id)


async def all_stats(
    services: ServicesDep,
    since: SinceQuery = None,
    until: UntilQuery = None,
    tenant_id: Annotated[str | None, Query(max_length=36, pattern=r"^[A-Za-z0-9-]+$")] = None,
) -> WorkflowStatsList:
    """Every tenant's (or one tenant's) runs that ended in the range, per workflow."""
    return await _answer(services, since, until, None if tenant_id is None else TenantId(tenant_id))


_DESCRIPTION = (
    "Runs counted by when they ended, in `[since, until)` (at most "
    f"{MAX_RANGE.days} days): per final status, the failure rate (`failed` and `timed_out`), "
    "runs per minute, and p50/p95 seconds from first start to end of the succeeded and "
    f"failed ones (from the newest {MAX_DURATIONS:,} of the range; `sampled` when more ended)."
)


def build_router() -> APIRouter:
    """A new router with the tenant's and the admin's statistics routes."""
    router = APIRouter(
        prefix="/v1", tags=["stats"], route_class=authenticated_by(authenticate_tenant)
    )
    router.add_api_route(
        "/stats/workflows",
        tenant_stats,
        methods=["GET"],
        responses=responses(Unauthorized, InvalidRequest, RateLimited),
        summary="Per-workflow statistics of the tenant's runs",
        description=_DESCRIPTION,
    )
    admin = admin_router()
    admin.add_api_route(
        "/stats/workflows",
        all_stats,
        methods=["GET"],
        responses=responses(*ADMIN_ERRORS, InvalidRequest),
        summary="Per-workflow statistics of every tenant's runs",
        description=_DESCRIPTION,
    )
    both = APIRouter()
    both.include_router(router)
    both.include_router(admin)
    return both
