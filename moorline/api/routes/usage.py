"""``GET /v1/usage``: the caller's daily quota, straight from the counters admission uses."""

from fastapi import APIRouter

from moorline.api.deps import CallerDep, ServicesDep
from moorline.api.errors import responses
from moorline.api.schemas import UsageOut
from moorline.errors import RateLimited, Unauthorized


async def usage(caller: CallerDep, services: ServicesDep) -> UsageOut:
    """The tenant's quota today: units taken by admitted runs, what is left, the next reset."""
    current = await services.admission.usage(caller.tenant.tenant_id, caller.plan)
    return UsageOut(
        tenant_id=caller.tenant.tenant_id,
        plan=caller.plan.name,
        daily_quota=current.daily_quota,
        used_today=current.used_today,
        remaining=current.remaining,
        resets_at=current.resets_at,
    )


def build_router() -> APIRouter:
    """A new router with the usage route."""
    router = APIRouter(prefix="/v1", tags=["usage"])
    router.add_api_route(
        "/usage",
        usage,
        methods=["GET"],
        responses=responses(Unauthorized, RateLimited),
        summary="The tenant's daily quota and its use today",
    )
    return router
