"""Webhooks: a tenant registers one per workflow; each signed delivery starts a run.

``POST /v1/hooks/{webhook_id}`` takes no API key: GitHub's ``X-Hub-Signature-256`` header
(``sha256=<hex HMAC-SHA256 of the raw body>`` keyed with the webhook's secret) authenticates
the delivery. The signature is checked over the raw bytes, with :func:`hmac.compare_digest`,
before the body is parsed at all (docs/reliability.md I1); a missing, repeated, malformed or wrong
signature is 401 ``invalid_signature`` and nothing is stored. A verified body becomes the
run's input ``{"payload": <body>, "event": <X-GitHub-Event>}`` and goes through admission like
any trigger, with the webhook as the rate-limit credential.

The delivery id (``X-GitHub-Delivery``) is the idempotency key, so a redelivery returns the
first delivery's run. It is stored as ``hook:<webhook_id>:<delivery id>``: a tenant's own
idempotency keys and the deliveries of its other webhooks can never collide with it.
"""

import hashlib
import hmac
import re
import secrets
from typing import Annotated

from fastapi import APIRouter, Header, Path, Request, Response

from moorline.admission.triggers import Trigger
from moorline.api.deps import (
    RUN_ID_PATTERN,
    CallerDep,
    RateKind,
    ServicesDep,
    authenticate_tenant,
    count_request,
)
from moorline.api.errors import ADMISSION_ERRORS, BODY_ERRORS, responses
from moorline.api.guards import authenticated_by, parse_json
from moorline.api.openapi import CHECKED_BY_ROUTE
from moorline.api.routes.trigger import answer_trigger
from moorline.api.schemas import RunAccepted, WebhookCreate, WebhookCreated
from moorline.errors import (
    InvalidRequest,
    InvalidSignature,
    RateLimited,
    Unauthorized,
    WebhookNotFound,
    WorkflowNotFound,
)
from moorline.types import TenantId

SIGNATURE_HEADER = "X-Hub-Signature-256"
SIGNATURE_PREFIX = "sha256="
_SIGNATURE = re.compile(r"^sha256=[0-9a-fA-F]{64}$")
_DELIVERY = re.compile(r"^[!-~]{1,100}$")
SECRET_BYTES = 32


def sign(secret: str, body: bytes) -> str:
    """GitHub's ``X-Hub-Signature-256`` value for ``body``: ``sha256=<hex HMAC-SHA256>``."""
    digest = hmac.new(secret.encode("utf-8"), body, hashlib.sha256).hexdigest()
    return SIGNATURE_PREFIX + digest


def verify_signature(secret: str, body: bytes, signatures: list[str]) -> None:
    """Check a delivery's signature header(s) against ``body``, in constant time.

    Args:
        secret: The webhook's secret.
        body: The raw request body, exactly as received.
        signatures: Every ``X-Hub-Signature-256`` header of the request.

    Raises:
        InvalidSignature: no header, more than one, a malformed one, or a wrong signature.
    """
    if len(signatures) != 1:
        raise InvalidSignature(
            f"a delivery needs exactly one {SIGNATURE_HEADER} header, got {len(signatures)}"
        )
    presented = signatures[0].strip()
    if not _SIGNATURE.match(presented):
        raise InvalidSignature(f"{SIGNATURE_HEADER} is not 'sha256=<64 hex digits>'")
    expected = sign(secret, body)
    if not hmac.compare_digest(presented.lower().encode(), expected.encode()):
        raise InvalidSignature(f"{SIGNATURE_HEADER} does not match the body")


async def create_webhook(
    body: WebhookCreate, caller: CallerDep, services: ServicesDep
) -> WebhookCreated:
    """Register a webhook that starts ``workflow``; deliver to ``url`` signed with ``secret``."""
    await count_request(services, caller, RateKind.WEBHOOKS)
    services.workflows.get(body.workflow)  # WorkflowNotFound
    secret = body.secret or secrets.token_hex(SECRET_BYTES)
    webhook = await services.webhooks.create(caller.tenant.tenant_id, body.workflow, secret)
    # From the configured address: the request's Host header is the client's to choose.
    path = f"/v1/hooks/{webhook.webhook_id}"
    base = services.settings.public_url
    url = path if base is None else f"{base}{path}"
    return WebhookCreated(webhook_id=webhook.webhook_id, url=url, secret=secret)


async def deliver_webhook(
    webhook_id: Annotated[str, Path(max_length=200)],
    request: Request,
    services: ServicesDep,
    # Both required, and checked by the route after the webhook is found: the signature
    # first (401), then the delivery id (422); the document says so (moorline.api.openapi).
    x_hub_signature_256: Annotated[
        str | None,
        Header(
            description="`sha256=<hex HMAC-SHA256 of the raw body>`.",
            json_schema_extra={CHECKED_BY_ROUTE: {"type": "string", "pattern": _SIGNATURE.pattern}},
        ),
    ] = None,
    x_github_event: Annotated[str | None, Header(max_length=100)] = None,
    x_github_delivery: Annotated[
        str | None,
        Header(
            max_length=100,
            description="The delivery id (idempotency key).",
            json_schema_extra={CHECKED_BY_ROUTE: {"type": "string", "pattern": _DELIVERY.pattern}},
        ),
    ] = None,
) -> Response:
    """Verify a delivery's signature, then start the webhook's workflow with its payload."""
    del x_hub_signature_256  # read raw below: a repeated header must be refused, not merged
    webhook = await services.webhooks.get(webhook_id) if RUN_ID_PATTERN.match(webhook_id) else None
    if webhook is None:
        raise WebhookNotFound(f"no webhook {webhook_id}")
    body = await request.body()
    verify_signature(webhook.secret, body, request.headers.getlist(SIGNATURE_HEADER))
    payload = parse_json(body)
    tenant = await services.tenants.get(TenantId(webhook.tenant_id))
    if tenant is None:  # pragma: no cover - a tenant's webhooks go with it (ON DELETE CASCADE)
        raise WebhookNotFound(f"no webhook {webhook_id}")
    # Required: it is the idempotency key, and without it a replayed signed body (a captured
    # delivery sent again) would start a new run each time.
    if x_github_delivery is None or not _DELIVERY.match(x_github_delivery):
        raise InvalidRequest(
            "a delivery needs an X-GitHub-Delivery header of 1-100 visible ASCII characters"
        )
    key = f"hook:{webhook.webhook_id}:{x_github_delivery}"
    admitted = await services.admission.admit(
        Trigger(
            tenant_id=tenant.tenant_id,
            plan=await services.plans.get(tenant.plan),
            rate_identity=f"webhook:{webhook.webhook_id}",
            workflow=services.workflows.get(webhook.workflow),
            input={"payload": payload, "event": x_github_event},
            idempotency_key=key,
        )
    )
    return answer_trigger(admitted, fast=services.settings.fast_paths)


def build_router() -> APIRouter:
    """A new router with the webhook routes."""
    router = APIRouter(
        prefix="/v1", tags=["webhooks"], route_class=authenticated_by(authenticate_tenant)
    )
    router.add_api_route(
        "/webhooks",
        create_webhook,
        methods=["POST"],
        status_code=201,
        responses=responses(Unauthorized, *BODY_ERRORS, WorkflowNotFound, RateLimited),
        summary="Register a webhook for a workflow",
    )
    router.add_api_route(
        "/hooks/{webhook_id}",
        deliver_webhook,
        methods=["POST"],
        status_code=202,
        response_model=RunAccepted,
        responses={
            200: {"model": RunAccepted, "description": "The run of a repeated delivery id"},
            **responses(InvalidSignature, *BODY_ERRORS, WebhookNotFound, *ADMISSION_ERRORS),
        },
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {}}},
                "description": "Any JSON, signed with the webhook's secret.",
            }
        },
        summary="Deliver a signed webhook event",
    )
    return router
