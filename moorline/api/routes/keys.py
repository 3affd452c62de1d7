"""Admin routes for a tenant's API keys: list them, issue another, revoke one.

Rotation without downtime: issue a second key, move the clients to it, revoke the first. A
revoked key stops authenticating at once in the API process that revoked it and within
``AUTH_CACHE_TTL_S`` (5 s) in every other one (:mod:`moorline.db.repos.tenants`). A tenant's
last key may be revoked too: the tenant keeps its runs and can be given a new key.
"""

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Path, Response
from pydantic import BaseModel, ConfigDict

from moorline.api.deps import RUN_ID_PATTERN, ServicesDep, admin_router
from moorline.api.errors import responses
from moorline.db.repos.records import ApiKey
from moorline.errors import (
    ApiKeyNotFound,
    Forbidden,
    InvalidRequest,
    NotFound,
    TenantNotFound,
    Unauthorized,
)
from moorline.types import TenantId

ADMIN_ERRORS = (Unauthorized, Forbidden)
TenantIdPath = Annotated[str, Path(max_length=200)]
KeyIdPath = Annotated[str, Path(max_length=200)]


class ApiKeyOut(BaseModel):
    """One API key as listed: its id and first characters, never the key."""

    model_config = ConfigDict(frozen=True)

    key_id: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None


class ApiKeyIssued(ApiKeyOut):
    """A new API key, shown this once (only its hash is stored)."""

    api_key: str


class ApiKeyList(BaseModel):
    """A tenant's API keys, revoked ones too, oldest first."""

    model_config = ConfigDict(frozen=True)

    keys: list[ApiKeyOut]


def _out(key: ApiKey) -> ApiKeyOut:
    return ApiKeyOut(
        key_id=key.key_id, prefix=key.prefix, created_at=key.created_at, revoked_at=key.revoked_at
    )


async def _existing_tenant(services: ServicesDep, tenant_id: str) -> TenantId:
    if RUN_ID_PATTERN.match(tenant_id) and await services.tenants.get(TenantId(tenant_id)):
        return TenantId(tenant_id)
    raise TenantNotFound(f"no tenant {tenant_id}")


async def list_keys(tenant_id: TenantIdPath, services: ServicesDep) -> ApiKeyList:
    """The tenant's API keys, revoked ones too, oldest first."""
    tenant = await _existing_tenant(services, tenant_id)
    return ApiKeyList(keys=[_out(key) for key in await services.tenants.list_keys(tenant)])


async def issue_key(tenant_id: TenantIdPath, services: ServicesDep) -> ApiKeyIssued:
    """Issue another API key for the tenant (its other keys keep working)."""
    tenant = await _existing_tenant(services, tenant_id)
    try:
        key, api_key = await services.tenants.issue_key(tenant)
    except NotFound:  # deleted between the check and the insert
        raise TenantNotFound(f"no tenant {tenant_id}") from None
    return ApiKeyIssued(**_out(key).model_dump(), api_key=api_key)


async def revoke_key(tenant_id: TenantIdPath, key_id: KeyIdPath, services: ServicesDep) -> Response:
    """Revoke one of the tenant's API keys."""
    tenant = await _existing_tenant(services, tenant_id)
    if not RUN_ID_PATTERN.match(key_id) or not await services.tenants.revoke_key(
        key_id, tenant_id=tenant
    ):
        raise ApiKeyNotFound(f"tenant {tenant_id} has no unrevoked API key {key_id}")
    return Response(status_code=204)


def build_router() -> APIRouter:
    """A new router with the key routes (admin)."""
    router = admin_router()
    router.add_api_route(
        "/tenants/{tenant_id}/keys",
        list_keys,
        methods=["GET"],
        responses=responses(*ADMIN_ERRORS, InvalidRequest, TenantNotFound),
        summary="A tenant's API keys (never the keys themselves)",
    )
    router.add_api_route(
        "/tenants/{tenant_id}/keys",
        issue_key,
        methods=["POST"],
        status_code=201,
        responses=responses(*ADMIN_ERRORS, InvalidRequest, TenantNotFound),
        summary="Issue another API key for a tenant",
    )
    router.add_api_route(
        "/tenants/{tenant_id}/keys/{key_id}",
        revoke_key,
        methods=["DELETE"],
        status_code=204,
        response_class=Response,
        responses=responses(*ADMIN_ERRORS, InvalidRequest, TenantNotFound, ApiKeyNotFound),
        summary="Revoke an API key (within 5 s on every API process)",
    )
    return router
