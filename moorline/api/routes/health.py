"""Liveness and readiness: ``GET /healthz`` and ``GET /readyz``.

``/healthz`` answers whenever the process serves HTTP, so an orchestrator restarts only a hung
process. ``/readyz`` answers 200 only when every backend this process depends on accepts work
(the database: a real write probe, see :mod:`moorline.db.health`; Redis, when configured: a
``PING`` within :data:`REDIS_PROBE_TIMEOUT_S`), so a load balancer stops
routing to a process whose database went read-only or away, without restarting it.
"""

from collections.abc import Awaitable, Callable
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from moorline.api.deps import Services
from moorline.db.health import check_writable
from moorline.db.manager import DatabaseManager
from moorline.errors import BackendUnavailable

REDIS_PROBE_TIMEOUT_S = 2.0
"""How long ``/readyz`` waits for Redis's ``PING``: shorter than a load balancer's probe."""


class Health(BaseModel):
    """The process serves HTTP."""

    status: Literal["ok"]


class Readiness(BaseModel):
    """Every backend accepts work."""

    status: Literal["ready"]
    checks: dict[str, str] = Field(description="Each backend checked, and `ok`.")


class NotReadyDetail(BaseModel):
    """Which backend is down, and why."""

    code: Literal["not_ready"]
    message: str = Field(description="What is down and why, e.g. `database is down: <reason>`.")
    checks: dict[str, str] = Field(description="Each backend checked: `ok` or `down`.")


class NotReady(BaseModel):
    """The 503 body of ``/readyz``, in the API's error shape."""

    error: NotReadyDetail


async def healthz() -> Health:
    """Answer 200 whenever the process serves HTTP; it checks no backend."""
    return Health(status="ok")


async def readyz(request: Request) -> Readiness | JSONResponse:
    """Answer 200 when every backend accepts work, else 503 naming what is down.

    The database must accept a write, not only a read (see ``moorline.db.health``); Redis,
    when the process uses it, must answer a ``PING`` in time.
    """
    db: DatabaseManager = request.app.state.db
    services: Services = request.app.state.services
    probes: dict[str, Callable[[], Awaitable[None]]] = {"database": lambda: check_writable(db)}
    if services.settings.redis_url:
        # Triggers go through Redis (rate limits, quotas, wake-ups): down, they all answer 503.
        probes["redis"] = lambda: services.store.check_available(REDIS_PROBE_TIMEOUT_S)
    checks: dict[str, str] = {}
    failures: list[str] = []
    for name, probe in probes.items():
        try:
            await probe()
        except BackendUnavailable as exc:
            checks[name] = "down"
            failures.append(exc.message)
        else:
            checks[name] = "ok"
    if not failures:
        return Readiness(status="ready", checks=checks)
    detail = NotReadyDetail(code="not_ready", message="; ".join(failures), checks=checks)
    return JSONResponse(status_code=503, content=NotReady(error=detail).model_dump())


def build_router() -> APIRouter:
    """A new router with the two probes (a fresh one per app: routers are mutable)."""
    router = APIRouter(tags=["health"])
    router.add_api_route("/healthz", healthz, response_model=Health, summary="The process is up")
    router.add_api_route(
        "/readyz",
        readyz,
        response_model=Readiness,
        responses={503: {"model": NotReady, "description": "A backend is down; the body names it"}},
        summary="Every backend accepts work",
    )
    return router
