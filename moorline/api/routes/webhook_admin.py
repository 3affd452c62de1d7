"""A tenant's webhooks: list them and delete one (``GET``/``DELETE /v1/webhooks``).

Beside :mod:`moorline.api.routes.webhooks`, which creates webhooks and takes deliveries. The
listing leaves the secrets out: each was shown when its webhook was created.
"""

from typing import Annotated

from fastapi import APIRouter, Path, Response
from pydantic import BaseModel, ConfigDict

from moorline.api.deps import RUN_ID_PATTERN, CallerDep, ServicesDep, authenticate_tenant
from moorline.api.errors import responses
from moorline.api.guards import authenticated_by
from moorline.errors import InvalidRequest, Unauthorized, WebhookNotFound


class WebhookOut(BaseModel):
    """A webhook as listed: where to deliver, and the workflow it starts (no secret)."""

    model_config = ConfigDict(frozen=True)

    webhook_id: str
    workflow: str
    url: str


class WebhookList(BaseModel):
    """The tenant's webhooks, oldest first."""

    model_config = ConfigDict(frozen=True)

    webhooks: list[WebhookOut]


async def list_webhooks(caller: CallerDep, services: ServicesDep) -> WebhookList:
    """The tenant's webhooks, oldest first."""
    base = services.settings.public_url or ""
    found = await services.webhooks.list_for(caller.tenant.tenant_id)
    return WebhookList(
        webhooks=[
            WebhookOut(
                webhook_id=hook.webhook_id,
                workflow=hook.workflow,
                url=f"{base}/v1/hooks/{hook.webhook_id}",
            )
            for hook in found
        ]
    )


async def delete_webhook(
    webhook_id: Annotated[str, Path(max_length=200)], caller: CallerDep, services: ServicesDep
) -> Response:
    """Delete one of the tenant's webhooks: deliveries to it are 404 from then on."""
    if not RUN_ID_PATTERN.match(webhook_id) or not await services.webhooks.delete(
        webhook_id, tenant_id=caller.tenant.tenant_id
    ):
        # Another tenant's webhook is not found either (404, never 403).
        raise WebhookNotFound(f"no webhook {webhook_id}")
    return Response(status_code=204)


def build_router() -> APIRouter:
    """A new router with the webhook listing and deletion."""
    router = APIRouter(
        prefix="/v1", tags=["webhooks"], route_class=authenticated_by(authenticate_tenant)
    )
    router.add_api_route(
        "/webhooks",
        list_webhooks,
        methods=["GET"],
        responses=responses(Unauthorized),
        summary="The tenant's webhooks",
    )
    router.add_api_route(
        "/webhooks/{webhook_id}",
        delete_webhook,
        methods=["DELETE"],
        status_code=204,
        response_class=Response,
        responses=responses(Unauthorized, InvalidRequest, WebhookNotFound),
        summary="Delete a webhook",
    )
    return router
