"""Operator routes under ``/v1/admin``: tenants and their plans, and the lanes' load.

Every route here requires ``MOORLINE_ADMIN_TOKEN`` (:func:`moorline.api.deps.require_admin`);
a tenant's API key gets 403 ``forbidden``.
"""

import asyncio
from typing import Annotated

from fastapi import APIRouter, Path

from moorline.api.deps import RUN_ID_PATTERN, ServicesDep, admin_router
from moorline.api.errors import BODY_ERRORS, responses
from moorline.api.schemas import (
    LaneOut,
    Queues,
    TenantCreate,
    TenantCreated,
    TenantOut,
    TenantPlanChange,
)
from moorline.db.repos.tenants import TenantExists
from moorline.db.repos.workers import WorkersRepo
from moorline.errors import Forbidden, InvalidRequest, TenantNotFound, Unauthorized
from moorline.plans import PlansProvider
from moorline.types import TenantId

ADMIN_ERRORS = (Unauthorized, Forbidden)


async def _check_plan(plans: PlansProvider, plan: str) -> None:
    known = await plans.plans()
    if plan not in known:
        raise InvalidRequest(f"plan: unknown plan {plan!r} (known: {', '.join(sorted(known))})")


async def create_tenant(body: TenantCreate, services: ServicesDep) -> TenantCreated:
    """Create a tenant and its first API key; the key is in this answer only."""
    await _check_plan(services.plans, body.plan)
    tenant, api_key = await services.tenants.create(body.name, body.plan)
    return TenantCreated(
        tenant_id=tenant.tenant_id, name=tenant.name, plan=tenant.plan, api_key=api_key
    )


async def change_plan(
    tenant_id: Annotated[str, Path(max_length=200)],
    body: TenantPlanChange,
    services: ServicesDep,
) -> TenantOut:
    """Move a tenant to another plan; its next trigger is admitted under the new one."""
    await _check_plan(services.plans, body.plan)
    if not RUN_ID_PATTERN.match(tenant_id) or not await services.tenants.set_plan(
        TenantId(tenant_id), body.plan
    ):
        raise TenantNotFound(f"no tenant {tenant_id}")
    tenant = await services.tenants.get(TenantId(tenant_id))
    if tenant is None:  # pragma: no cover - tenants are not deleted through the API
        raise TenantNotFound(f"no tenant {tenant_id}")
    return TenantOut(tenant_id=tenant.tenant_id, name=tenant.name, plan=tenant.plan)


async def queues(services: ServicesDep) -> Queues:
    """Queued and running runs per lane, the oldest claimable one's age, the unserved runs."""
    loads, unserved = await asyncio.gather(
        services.listing.lane_loads(await services.plans.lane_slots()),
        WorkersRepo(services.db).unserved(),
    )
    return Queues(
        lanes=[
            LaneOut(
                lane=load.lane,
                queued=load.queued,
                running=load.running,
                oldest_queued_age_s=load.oldest_queued_age_s,
                unserved=sum(n for (lane, _), n in unserved.items() if lane == load.lane),
                unserved_workflows=sorted(w for lane, w in unserved if lane == load.lane),
            )
            for load in loads
        ]
    )


def build_router() -> APIRouter:
    """A new router with the admin routes."""
    router = admin_router()
    router.add_api_route(
        "/tenants",
        create_tenant,
        methods=["POST"],
        status_code=201,
        responses=responses(*ADMIN_ERRORS, *BODY_ERRORS, TenantExists),
        summary="Create a tenant and its API key",
    )
    router.add_api_route(
        "/tenants/{tenant_id}",
        change_plan,
        methods=["PATCH"],
        responses=responses(*ADMIN_ERRORS, *BODY_ERRORS, TenantNotFound),
        summary="Change a tenant's plan",
    )
    router.add_api_route(
        "/queues",
        queues,
        methods=["GET"],
        responses=responses(*ADMIN_ERRORS),
        summary="The load of every lane",
    )
    return router
