"""What routes depend on: the app's services, and who is calling.

:class:`Services` is built once per app by :func:`moorline.api.app.create_app` and kept on
``app.state``; nothing here is module-level state.

Authentication reads ``Authorization: Bearer <credential>`` only:

- :func:`tenant_caller`: an API key, hashed and looked up (see
  :mod:`moorline.db.repos.tenants`; a key found is trusted for
  :data:`~moorline.db.repos.tenants.AUTH_CACHE_TTL_S` seconds, so a revocation or plan change
  made by another process reaches this one within that bound, one made here at once); a
  missing, unknown or revoked key is 401 ``unauthorized``, all alike. A credential not shaped
  as a key is refused without a lookup, and one that named nothing is remembered as such for
  the same TTL.
- :data:`CallerDep`: :func:`tenant_caller`, and the request counted against the key's
  ``MOORLINE_REQUEST_RATE_LIMIT`` (:func:`count_request`; stream opens and webhook creations
  count against a window of their own too). The trigger takes :data:`TriggerCallerDep`: its
  rate is its plan's, counted by admission.
- :func:`require_admin`: ``MOORLINE_ADMIN_TOKEN``, compared in constant time; a tenant's key
  is 403 ``forbidden``, anything else 401. Without an admin token the admin routes are off:
  every credential is refused there.

Every route that takes a run id loads the run through :func:`owned_run`, which answers 404
``run_not_found`` for a run of another tenant exactly as for one that does not exist
(docs/design.md invariant 6); ``tests/api/test_isolation.py`` enumerates the routes to hold every
one of them to it.
"""

import hmac
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from moorline.admission.admit import Admission
from moorline.admission.ratelimit import RateLimiter
from moorline.api.guards import authenticated_by
from moorline.db.manager import DatabaseManager
from moorline.db.repos.bulk_jobs import BulkJobsRepo
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.listing import RunListing
from moorline.db.repos.records import Run, Tenant
from moorline.db.repos.runs import RunsRepo
from moorline.db.repos.steps import StepsRepo
from moorline.db.repos.tenants import TenantsRepo, hash_api_key, is_api_key_shaped
from moorline.db.repos.usage import UsageRepo
from moorline.db.repos.webhooks import WebhooksRepo
from moorline.dispatch.wakeups import Notifier, Waiter
from moorline.engine.inbox import Inbox
from moorline.engine.registry import Moorline
from moorline.engine.streams import EventStreams
from moorline.errors import Forbidden, RateLimited, RunNotFound, Unauthorized
from moorline.llm.models import ModelsProvider
from moorline.observability.metrics import Metrics
from moorline.plans import Plan, PlansProvider
from moorline.runtime.base import RuntimeStore
from moorline.settings import Settings
from moorline.types import RunId

RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9-]{1,36}$")
"""Run ids are UUID text (UUIDv7); anything else names no run and is not looked up."""

RunIdPath = Annotated[str, Path(max_length=200, description="The run's id.")]
"""A route's ``{run_id}``: its length checked here (422), its form by :func:`owned_run`."""

api_key_scheme = HTTPBearer(
    scheme_name="ApiKey",
    description="A tenant's API key: `Authorization: Bearer ml_…`.",
    auto_error=False,
)
admin_scheme = HTTPBearer(
    scheme_name="AdminToken",
    description="`MOORLINE_ADMIN_TOKEN`: `Authorization: Bearer <token>`.",
    auto_error=False,
)


class StreamSlots:
    """Counts each tenant's open event streams in this process, up to ``limit`` at once.

    Args:
        limit: Streams one tenant may hold open at once.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._open: dict[str, int] = {}

    def take(self, tenant_id: str) -> None:
        """Count one more open stream of the tenant.

        Raises:
            RateLimited: The tenant already holds ``limit`` open streams.
        """
        held = self._open.get(tenant_id, 0)
        if held >= self._limit:
            raise RateLimited(
                f"this tenant already has {held} open event streams, the most allowed at once; "
                "close one and try again",
                limit=self._limit,
                reset_s=1,
            )
        self._open[tenant_id] = held + 1

    def held(self, tenant_id: str) -> int:
        """Streams the tenant holds open now."""
        return self._open.get(tenant_id, 0)

    def total(self) -> int:
        """Streams open now, every tenant's."""
        return sum(self._open.values())

    def give_back(self, tenant_id: str) -> None:
        """Count one open stream of the tenant less."""
        held = self._open.get(tenant_id, 0) - 1
        if held > 0:
            self._open[tenant_id] = held
        else:
            self._open.pop(tenant_id, None)


@dataclass(frozen=True, slots=True, kw_only=True)
class Services:
    """Everything the routes use, built once per app."""

    settings: Settings
    db: DatabaseManager
    workflows: Moorline
    plans: PlansProvider
    tenants: TenantsRepo
    runs: RunsRepo
    listing: RunListing
    steps: StepsRepo
    interrupts: InterruptsRepo
    webhooks: WebhooksRepo
    admission: Admission
    rate_limiter: RateLimiter
    """The API rate limits, the same as admission's: triggers' and :class:`RateKind`'s."""
    store: RuntimeStore
    notifier: Notifier
    waiter: Waiter
    """Wake-ups: the Submitter notifies through ``notifier``; worker loops that ``moorline
    serve`` runs in this process wait on ``waiter`` (the same in-process hub)."""
    inbox: Inbox
    streams: EventStreams
    stream_slots: StreamSlots
    metrics: Metrics
    """This process's event metrics (admission counts its refusals; ``serve``'s worker loops
    count theirs)."""
    bulk_jobs: BulkJobsRepo
    """Bulk cancels and retries: stored here, processed by the worker processes."""
    usage: UsageRepo
    """LLM usage totals (``GET /v1/usage``, ``/metrics``)."""
    models: ModelsProvider
    """The models file, read at start so that a bad one stops ``serve --workers 0`` too."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Caller:
    """An authenticated tenant.

    Attributes:
        tenant: The tenant the API key names.
        plan: The tenant's plan, as currently configured.
        rate_identity: Whose API rate limit the request counts against: a digest prefix of
            the key (never the key itself).
    """

    tenant: Tenant
    plan: Plan
    rate_identity: str


async def get_services(request: Request) -> Services:
    """The app's services.

    A coroutine although it awaits nothing: FastAPI runs a plain ``def`` dependency in its
    thread pool, a thread hop per request for an attribute read.
    """
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]
Credentials = HTTPAuthorizationCredentials | None


async def tenant_caller(
    request: Request, credentials: Annotated[Credentials, Depends(api_key_scheme)]
) -> Caller:
    """The tenant whose API key the request carries.

    Reads the services off the request rather than through :data:`ServicesDep`: FastAPI
    solves every dependency of every request anew, and one level less is measurable on the
    trigger path (``bench/api.py``).

    Raises:
        Unauthorized: no key, or one that names no tenant (unknown or revoked).
    """
    authenticated: Caller | None = getattr(request.state, "caller", None)
    if authenticated is not None:
        return authenticated  # by authenticate_tenant, before the body was read
    key = None if credentials is None else credentials.credentials
    return await caller_of_key(request.app.state.services, key)


async def authenticate_tenant(request: Request) -> None:
    """:func:`tenant_caller`'s check from the headers alone, before a body is read.

    The routes with a body run it first (:func:`~moorline.api.guards.authenticated_by`), so
    a request without a valid key costs no body read or parse; the caller is kept on
    ``request.state`` for :func:`tenant_caller`.

    Raises:
        Unauthorized: no key, or one that names no tenant.
    """
    services: Services = request.app.state.services
    request.state.caller = await caller_of_key(services, bearer_credential(request))


def bearer_credential(request: Request) -> str | None:
    """The credential of the request's ``Authorization: Bearer`` header, or None.

    What :data:`api_key_scheme` (``HTTPBearer(auto_error=False)``) reads, without the
    pydantic model it wraps the credential in: for a route that solves its own arguments
    (the trigger's, :func:`~moorline.api.routes.trigger.solve_trigger`).
    """
    authorization = request.headers.get("Authorization")
    if not authorization:
        return None
    scheme, _, credential = authorization.partition(" ")
    credential = credential.strip()
    if not (scheme and credential) or scheme.lower() != "bearer":
        return None
    return credential


async def caller_of_key(services: Services, key: str | None) -> Caller:
    """The tenant whose API key is ``key`` (see :func:`tenant_caller`).

    The key is hashed once, for the lookup and the rate-limit identity both.

    Raises:
        Unauthorized: no key, or one that names no tenant (unknown or revoked).
    """
    if key is None:
        raise Unauthorized("an API key is required: send 'Authorization: Bearer <key>'")
    if not is_api_key_shaped(key):
        raise Unauthorized("the API key is not valid")  # no lookup: it cannot name a tenant
    digest = hash_api_key(key)
    tenant = await services.tenants.authenticate_digest(digest)
    if tenant is None:
        raise Unauthorized("the API key is not valid")
    return Caller(
        tenant=tenant,
        plan=await services.plans.get(tenant.plan),
        rate_identity=f"key:{digest[:32]}",
    )


async def require_admin(
    request: Request,
    services: ServicesDep,
    credentials: Annotated[Credentials, Depends(admin_scheme)],
) -> None:
    """Let only the admin token through.

    Raises:
        Unauthorized: no credential, or one that is neither the admin token nor an API key.
        Forbidden: a tenant's API key, or any credential while admin routes are off.
    """
    if getattr(request.state, "is_admin", False):
        return  # by authenticate_admin, before the body was read
    await check_admin(services, None if credentials is None else credentials.credentials)


async def authenticate_admin(request: Request) -> None:
    """:func:`require_admin`'s check from the headers alone, before a body is read.

    Raises:
        Unauthorized: as :func:`require_admin`.
        Forbidden: as :func:`require_admin`.
    """
    await check_admin(request.app.state.services, bearer_credential(request))
    request.state.is_admin = True


def admin_router() -> APIRouter:
    """A new router under ``/v1/admin`` that lets only the admin token through.

    The token is checked from the headers before a body is read (:func:`authenticate_admin`),
    and again as a dependency (:func:`require_admin`), so the OpenAPI document shows it.
    """
    return APIRouter(
        prefix="/v1/admin",
        tags=["admin"],
        route_class=authenticated_by(authenticate_admin),
        dependencies=[Depends(require_admin)],
    )


async def check_admin(services: Services, credential: str | None) -> None:
    """Whether ``credential`` is the admin token (see :func:`require_admin`)."""
    if credential is None:
        raise Unauthorized("the admin token is required: send 'Authorization: Bearer <token>'")
    token = services.settings.admin_token
    presented = credential.encode("utf-8")
    if token is not None and hmac.compare_digest(
        presented, token.get_secret_value().encode("utf-8")
    ):
        return
    if await services.tenants.authenticate(credential) is not None:
        raise Forbidden("this is an admin route; a tenant's API key cannot use it")
    if token is None:
        raise Forbidden("admin routes are off: MOORLINE_ADMIN_TOKEN is not set")
    raise Unauthorized("the admin token is not valid")


class RateKind(StrEnum):
    """What a tenant's request counts against beside triggers: a window of its own per key."""

    REQUESTS = "requests"
    """Every request of a :data:`CallerDep` route (``MOORLINE_REQUEST_RATE_LIMIT``)."""
    STREAMS = "streams"
    """Event stream opens (``MOORLINE_STREAM_RATE_LIMIT``)."""
    WEBHOOKS = "webhooks"
    """Webhook creations (``MOORLINE_WEBHOOK_RATE_LIMIT``)."""


async def count_request(services: Services, caller: Caller, kind: RateKind) -> None:
    """Count one request of ``caller``'s key against its ``kind`` window.

    The same moving windows, storage and fail-open rule as the plans' trigger rates
    (:mod:`moorline.admission.ratelimit`), under an identity of their own per kind.

    Raises:
        RateLimited: The window is full.
    """
    settings = services.settings
    rate = {
        RateKind.REQUESTS: settings.request_rate_limit,
        RateKind.STREAMS: settings.stream_rate_limit,
        RateKind.WEBHOOKS: settings.webhook_rate_limit,
    }[kind]
    await services.rate_limiter.hit(f"{caller.rate_identity}:{kind}", rate)


async def rate_limited_caller(
    request: Request, credentials: Annotated[Credentials, Depends(api_key_scheme)]
) -> Caller:
    """:func:`tenant_caller`, its request counted against ``MOORLINE_REQUEST_RATE_LIMIT``.

    Raises:
        Unauthorized: As :func:`tenant_caller`.
        RateLimited: The key's request window is full.
    """
    caller = await tenant_caller(request, credentials)
    await count_request(request.app.state.services, caller, RateKind.REQUESTS)
    return caller


CallerDep = Annotated[Caller, Depends(rate_limited_caller)]
"""The caller of a tenant route, counted against the key's request rate. Every tenant route
takes it but the trigger, whose rate is its plan's and which admission counts
(:data:`TriggerCallerDep`)."""

TriggerCallerDep = Annotated[Caller, Depends(tenant_caller)]


async def any_run(services: Services, run_id: str) -> Run:
    """The run ``run_id`` of any tenant: for admin routes only.

    Raises:
        RunNotFound: no such run.
    """
    run = await services.runs.get(RunId(run_id)) if RUN_ID_PATTERN.match(run_id) else None
    if run is None:
        raise RunNotFound(f"no run {run_id}")
    return run


async def owned_run(services: Services, caller: Caller, run_id: str) -> Run:
    """The run ``run_id`` if it belongs to the caller's tenant.

    Raises:
        RunNotFound: no such run, or another tenant's (the same answer, the same work).
    """
    run = await services.runs.get(RunId(run_id)) if RUN_ID_PATTERN.match(run_id) else None
    if run is None or run.tenant_id != caller.tenant.tenant_id:
        raise RunNotFound(f"no run {run_id}")
    return run
