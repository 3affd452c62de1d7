"""Bulk actions: cancel or retry every run a set of filters matches, as a durable job.

- ``POST /v1/runs/bulk/cancel`` and ``POST /v1/runs/bulk/retry`` take the list's filters
  (status, workflow, conversation, a created range, ids) and answer 202 with the new job at
  once: the runs it acts on are fixed then (at most
  :data:`~moorline.db.repos.bulk_jobs.MAX_BULK_RUNS`, else 422 ``too_many_runs``), and a
  processor in the worker processes acts on them in batches (:mod:`moorline.dispatch.bulk`).
  The same ``idempotency_key`` again answers 200 with the first request's job.
- ``GET /v1/runs/bulk/{job_id}``: the job's progress (``total``, ``done``, ``failed``,
  ``state``).

The admin's routes (``/v1/admin/runs/bulk/…``) act on every tenant's runs, or one tenant's
(``tenant_id``). These routers are installed ahead of the run routes: ``/v1/runs/{run_id}/
cancel`` would otherwise take ``bulk`` for a run id.
"""

from typing import Annotated, Any

from fastapi import APIRouter, Path, Response

from moorline.api.deps import (
    CallerDep,
    Services,
    ServicesDep,
    admin_router,
)
from moorline.api.errors import BODY_ERRORS, responses
from moorline.api.routes.admin_runs import ADMIN_ERRORS
from moorline.api.routes.runs import TenantRoute
from moorline.api.schemas import AdminBulkRequest, BulkJobOut, BulkRequest
from moorline.db.repos.bulk_jobs import ADMIN_SCOPE, BulkAction, BulkJob
from moorline.db.repos.listing import RunFilter
from moorline.db.repos.run_retries import RETRYABLE
from moorline.errors import (
    BulkJobNotFound,
    IdempotencyConflict,
    InvalidRequest,
    RateLimited,
    TooManyRuns,
    Unauthorized,
)
from moorline.types import JSONObject, TenantId

JobIdPath = Annotated[
    str, Path(max_length=36, pattern=r"^[A-Za-z0-9-]+$", description="The bulk job's id.")
]


def job_out(job: BulkJob) -> BulkJobOut:
    """A job as answered."""
    return BulkJobOut(
        job_id=job.job_id,
        action=job.action.value,
        state=job.state.value,
        total=job.total,
        done=job.done,
        failed=job.failed,
        filters=job.filters,
        created_at=job.created_at,
        updated_at=job.updated_at,
        finished_at=job.finished_at,
    )


async def start_job(
    services: Services,
    action: BulkAction,
    body: BulkRequest,
    *,
    scope: str,
    tenant_id: TenantId | None,
    response: Response,
) -> BulkJobOut:
    """Store a bulk job over the runs ``body`` matches; 200 for a repeated idempotency key.

    Raises:
        InvalidRequest: no filter at all, or a status the action does not apply to.
        TooManyRuns: the filters match more runs than one request may act on.
        IdempotencyConflict: the key was used with another action or other filters.
    """
    filters: JSONObject = body.model_dump(mode="json", exclude_none=True)
    filters.pop("idempotency_key", None)
    if not filters or list(filters) == ["tenant_id"]:
        # Every run of a tenant (or of all of them) is never what an empty body means.
        raise InvalidRequest("give at least one filter: status, workflow, conversation_id, ids, …")
    if body.status is not None and (body.status in RETRYABLE) != (action is BulkAction.RETRY):
        applies = "failed or timed_out" if action is BulkAction.RETRY else "one that has not ended"
        raise InvalidRequest(
            f"status: a bulk {action.value} acts on runs that are {applies}, "
            f"not {body.status.value}"
        )
    where = RunFilter(
        status=body.status,
        workflow=body.workflow,
        conversation_id=body.conversation_id,
        created_after=body.created_after,
        created_before=body.created_before,
        run_ids=None if body.ids is None else tuple(sorted(set(body.ids))),
    )
    job, created = await services.bulk_jobs.create(
        scope=scope,
        action=action,
        where=where,
        filters=filters,
        tenant_id=tenant_id,
        idempotency_key=body.idempotency_key,
    )
    response.status_code = 202 if created else 200
    return job_out(job)


async def bulk_cancel(
    body: BulkRequest, caller: CallerDep, services: ServicesDep, response: Response
) -> BulkJobOut:
    """Cancel every run the filters match, as a job processed in batches."""
    tenant_id = caller.tenant.tenant_id
    return await start_job(
        services, BulkAction.CANCEL, body, scope=tenant_id, tenant_id=tenant_id, response=response
    )


async def bulk_retry(
    body: BulkRequest, caller: CallerDep, services: ServicesDep, response: Response
) -> BulkJobOut:
    """Retry every failed or timed-out run the filters match, as a job processed in batches."""
    tenant_id = caller.tenant.tenant_id
    return await start_job(
        services, BulkAction.RETRY, body, scope=tenant_id, tenant_id=tenant_id, response=response
    )


async def get_job(job_id: JobIdPath, caller: CallerDep, services: ServicesDep) -> BulkJobOut:
    """A bulk job's progress."""
    return job_out(await services.bulk_jobs.get(job_id, scope=caller.tenant.tenant_id))


async def admin_bulk_cancel(
    body: AdminBulkRequest, services: ServicesDep, response: Response
) -> BulkJobOut:
    """Cancel every tenant's runs the filters match (or one tenant's: ``tenant_id``)."""
    tenant_id = None if body.tenant_id is None else TenantId(body.tenant_id)
    return await start_job(
        services, BulkAction.CANCEL, body, scope=ADMIN_SCOPE, tenant_id=tenant_id, response=response
    )


async def admin_bulk_retry(
    body: AdminBulkRequest, services: ServicesDep, response: Response
) -> BulkJobOut:
    """Retry every tenant's failed or timed-out runs the filters match."""
    tenant_id = None if body.tenant_id is None else TenantId(body.tenant_id)
    return await start_job(
        services, BulkAction.RETRY, body, scope=ADMIN_SCOPE, tenant_id=tenant_id, response=response
    )


async def admin_get_job(job_id: JobIdPath, services: ServicesDep) -> BulkJobOut:
    """Any bulk job's progress (a tenant's or the admin's)."""
    return job_out(await services.bulk_jobs.get(job_id))


_STARTED: dict[int | str, dict[str, Any]] = {
    200: {"model": BulkJobOut, "description": "The job of a repeated idempotency key"}
}


def _add_routes(router: APIRouter, *, admin: bool) -> None:
    errors = ADMIN_ERRORS if admin else (Unauthorized, RateLimited)
    whose = "every tenant's" if admin else "the tenant's"
    for action, tenant_route, admin_route in (
        (BulkAction.CANCEL, bulk_cancel, admin_bulk_cancel),
        (BulkAction.RETRY, bulk_retry, admin_bulk_retry),
    ):
        router.add_api_route(
            f"/runs/bulk/{action.value}",
            admin_route if admin else tenant_route,
            methods=["POST"],
            status_code=202,
            response_model=BulkJobOut,
            responses={
                **_STARTED,
                **responses(*errors, *BODY_ERRORS, TooManyRuns, IdempotencyConflict),
            },
            summary=f"{action.value.capitalize()} {whose} runs that match filters (a job)",
        )
    router.add_api_route(
        "/runs/bulk/{job_id}",
        admin_get_job if admin else get_job,
        methods=["GET"],
        response_model=BulkJobOut,
        responses=responses(*errors, InvalidRequest, BulkJobNotFound),
        summary="A bulk job's progress",
    )


def build_router() -> APIRouter:
    """A new router with the tenant's bulk routes."""
    router = APIRouter(prefix="/v1", tags=["runs"], route_class=TenantRoute)
    _add_routes(router, admin=False)
    return router


def build_admin_router() -> APIRouter:
    """A new router with the admin's bulk routes."""
    router = admin_router()
    _add_routes(router, admin=True)
    return router
