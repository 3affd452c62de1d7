"""The operator's view of every tenant: runs across tenants and tenants with their usage.

These routes exist for the dashboard signed in with ``MOORLINE_ADMIN_TOKEN``: what a tenant
does with its key on ``/v1/runs/...``, the admin does here on any tenant's run, through the
same functions (:mod:`moorline.api.routes.runs`), so both views answer alike. Every route
requires the admin token (a tenant's key is 403 ``forbidden``), and a run id that names no run
is 404 ``run_not_found``.

- ``GET /v1/admin/runs``: every tenant's runs, newest first, filtered by status, workflow,
  lane or tenant, paged with the same opaque keyset cursor as ``GET /v1/runs``.
- ``GET /v1/admin/runs/{run_id}`` and its ``/events``, ``/resume``, ``/cancel``,
  ``/messages``: as the tenant routes of the same names.
- ``GET /v1/admin/tenants``: tenants with their plan, today's quota use against the limit and
  running runs against the concurrency cap. Tenants are few (one per customer), so this page
  is by offset; the cursor is opaque all the same.
"""

from typing import Annotated

from fastapi import APIRouter, Query
from sse_starlette import EventSourceResponse

from moorline.api.deps import RunIdPath, ServicesDep, admin_router, any_run
from moorline.api.errors import BODY_ERRORS, responses
from moorline.api.routes.run_events import (
    AfterQuery,
    LastEventIdHeader,
    event_stream,
    resume_point,
)
from moorline.api.routes.runs import (
    DEFAULT_PAGE_SIZE,
    MAX_PAGE_SIZE,
    CreatedAfterQuery,
    CreatedBeforeQuery,
    CursorQuery,
    IdsQuery,
    InputContainsQuery,
    RunIdSearchQuery,
    cancel_owned,
    decode_cursor,
    describe_run,
    listed,
    resume,
    send_message,
)
from moorline.api.schemas import (
    WORKFLOW,
    Cancelled,
    MessageAccepted,
    MessageIn,
    Resume,
    Resumed,
    RunList,
    RunOut,
    TenantList,
    TenantLoad,
)
from moorline.db.repos.interrupts import InterruptResolved
from moorline.db.repos.listing import RunFilter
from moorline.db.repos.usage import utc_day
from moorline.errors import (
    Forbidden,
    InterruptNotFound,
    InvalidInput,
    InvalidRequest,
    LimitExceeded,
    NoPendingInterrupt,
    RateLimited,
    RunFinished,
    RunNotFound,
    RunNotInteractive,
    Unauthorized,
)
from moorline.types import RunStatus, TenantId

ADMIN_ERRORS = (Unauthorized, Forbidden)
ADMIN_STREAM_SLOT = "(admin)"
"""The admin's event streams count apart from every tenant's, so watching never uses theirs."""

TOKEN = r"^[A-Za-z0-9_.-]+$"


async def list_all_runs(
    services: ServicesDep,
    status: RunStatus | None = None,
    workflow: Annotated[str | None, Query(max_length=200, pattern=WORKFLOW)] = None,
    lane: Annotated[str | None, Query(max_length=64, pattern=TOKEN)] = None,
    tenant_id: Annotated[str | None, Query(max_length=36, pattern=r"^[A-Za-z0-9-]+$")] = None,
    limit: Annotated[
        int, Query(ge=1, description=f"Runs per page; above {MAX_PAGE_SIZE} counts as that.")
    ] = DEFAULT_PAGE_SIZE,
    cursor: CursorQuery = None,
    run_id: RunIdSearchQuery = None,
    input_contains: InputContainsQuery = None,
    created_after: CreatedAfterQuery = None,
    created_before: CreatedBeforeQuery = None,
    ids: IdsQuery = None,
) -> RunList:
    """Every tenant's runs, newest first, a page at a time."""
    page = await services.listing.page_all_tenants(
        where=RunFilter(
            status=status,
            workflow=workflow,
            lane=lane,
            run_id_search=run_id,
            input_contains=input_contains,
            created_after=created_after,
            created_before=created_before,
            run_ids=None if ids is None else tuple(sorted(set(ids))),
        ),
        limit=min(limit, MAX_PAGE_SIZE),
        after=None if cursor is None else decode_cursor(cursor),
        tenant_id=None if tenant_id is None else TenantId(tenant_id),
    )
    return listed(page)


async def get_any_run(run_id: RunIdPath, services: ServicesDep) -> RunOut:
    """Any tenant's run with its steps and the decision it waits for, if any."""
    return await describe_run(services, await any_run(services, run_id))


async def resume_any_run(run_id: RunIdPath, body: Resume, services: ServicesDep) -> Resumed:
    """Approve or deny the decision any tenant's run waits for; the first decision wins."""
    return await resume(services, await any_run(services, run_id), body)


async def cancel_any_run(run_id: RunIdPath, services: ServicesDep) -> Cancelled:
    """Cancel any tenant's run."""
    return await cancel_owned(services, await any_run(services, run_id))


async def message_any_run(
    run_id: RunIdPath, body: MessageIn, services: ServicesDep
) -> MessageAccepted:
    """Hand a message to any tenant's running run."""
    return await send_message(services, await any_run(services, run_id), body)


async def stream_any_run(
    run_id: RunIdPath,
    services: ServicesDep,
    after: AfterQuery = None,
    last_event_id: LastEventIdHeader = None,
) -> EventSourceResponse:
    """Any tenant's run's events as Server-Sent Events, as ``GET /v1/runs/{run_id}/events``."""
    run = await any_run(services, run_id)
    return await event_stream(
        services, run, resume_point(last_event_id, after), slot=ADMIN_STREAM_SLOT
    )


def _decode_offset(cursor: str | None) -> int:
    if cursor is None:
        return 0
    if not cursor.isascii() or not cursor.isdigit() or len(cursor) > 9:
        raise InvalidRequest("cursor: not a cursor this API returned")
    return int(cursor)


async def list_tenants(
    services: ServicesDep,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE, description="Tenants per page.")] = 100,
    cursor: Annotated[
        str | None,
        Query(pattern=r"^[0-9]{1,9}$", description="A `next_cursor` of an earlier page."),
    ] = None,
) -> TenantList:
    """Tenants, oldest first, with their plan's limits and their use of them now."""
    offset = _decode_offset(cursor)
    found = await services.tenants.list(limit=limit + 1, offset=offset)
    page = found[:limit]
    plans = [await services.plans.get(tenant.plan) for tenant in page]
    # One read of the counters and one count of running runs for the whole page.
    usages = await services.admission.usages(
        [(tenant.tenant_id, plan) for tenant, plan in zip(page, plans, strict=True)]
    )
    running = await services.listing.running_by_tenant(t.tenant_id for t in page)
    llm = await services.usage.tenants_day((t.tenant_id for t in page), utc_day())
    loads = [
        TenantLoad(
            tenant_id=tenant.tenant_id,
            name=tenant.name,
            plan=tenant.plan,
            lane=plan.lane,
            daily_quota=usage.daily_quota,
            used_today=usage.used_today,
            tenant_concurrency=plan.tenant_concurrency,
            running=running.get(tenant.tenant_id, 0),
            created_at=tenant.created_at,
            tokens_today=llm.get(tenant.tenant_id, (0, 0.0))[0],
            cost_today=llm.get(tenant.tenant_id, (0, 0.0))[1],
        )
        for tenant, plan, usage in zip(page, plans, usages, strict=True)
    ]
    more = len(found) > limit
    return TenantList(tenants=loads, next_cursor=str(offset + limit) if more else None)


def build_router() -> APIRouter:
    """A new router with the admin's run and tenant views."""
    router = admin_router()
    router.add_api_route(
        "/runs",
        list_all_runs,
        methods=["GET"],
        responses=responses(*ADMIN_ERRORS, InvalidRequest),
        summary="List every tenant's runs, newest first",
    )
    router.add_api_route(
        "/tenants",
        list_tenants,
        methods=["GET"],
        responses=responses(*ADMIN_ERRORS, InvalidRequest),
        summary="Tenants with their quota use and running runs",
    )
    router.add_api_route(
        "/runs/{run_id}",
        get_any_run,
        methods=["GET"],
        responses=responses(*ADMIN_ERRORS, InvalidRequest, RunNotFound),
        summary="Any tenant's run with its steps and pending interrupt",
    )
    router.add_api_route(
        "/runs/{run_id}/resume",
        resume_any_run,
        methods=["POST"],
        responses=responses(
            *ADMIN_ERRORS,
            *BODY_ERRORS,
            RunNotFound,
            InterruptNotFound,
            NoPendingInterrupt,
            InterruptResolved,
        ),
        summary="Approve or deny any tenant's paused run",
    )
    router.add_api_route(
        "/runs/{run_id}/cancel",
        cancel_any_run,
        methods=["POST"],
        status_code=202,
        responses=responses(*ADMIN_ERRORS, InvalidRequest, RunNotFound, RunFinished),
        summary="Cancel any tenant's run",
    )
    router.add_api_route(
        "/runs/{run_id}/messages",
        message_any_run,
        methods=["POST"],
        status_code=202,
        responses=responses(
            *ADMIN_ERRORS,
            *BODY_ERRORS,
            InvalidInput,
            RunNotFound,
            RunNotInteractive,
            LimitExceeded,
        ),
        summary="Send a message to any tenant's running run",
    )
    router.add_api_route(
        "/runs/{run_id}/events",
        stream_any_run,
        methods=["GET"],
        response_class=EventSourceResponse,
        responses={
            200: {"content": {"text/event-stream": {}}, "description": "The run's events"},
            **responses(*ADMIN_ERRORS, InvalidRequest, RunNotFound, RateLimited),
        },
        summary="Stream any tenant's run's events (Server-Sent Events)",
    )
    return router
