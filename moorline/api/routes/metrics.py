"""``GET /metrics``: the Prometheus text exposition (see :mod:`moorline.observability.metrics`).

Unauthenticated, like the health probes: a Prometheus server scrapes it, and it names lanes,
statuses, workflows and models only, never a run or an input, and a tenant only when
``MOORLINE_METRICS_TENANT_LABEL`` asks for the LLM usage per tenant.
"""

import asyncio

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from moorline.api.deps import ServicesDep
from moorline.db.repos.gauges import Gauges
from moorline.db.repos.workers import WorkersRepo
from moorline.observability.metrics import LaneFigures, LLMFigures, Snapshot, render


async def metrics(services: ServicesDep) -> Response:
    """Every metric of this deployment, read now."""
    gauges = Gauges(services.db)
    by_tenant = services.settings.metrics_tenant_label
    state = asyncio.gather(
        gauges.runs_by_lane_and_status(),
        gauges.pending_interrupts(),
        services.listing.lane_loads(await services.plans.lane_slots()),
        WorkersRepo(services.db).unserved(),
        gauges.deleted(),
        gauges.oldest_finished_age_s(),
    )
    figures, llm = await asyncio.gather(state, services.usage.totals(by_tenant=by_tenant))
    runs, interrupts_pending, loads, unserved, deleted, oldest = figures
    checked_out, pool_size = services.db.pool_usage()
    snapshot = Snapshot(
        runs=runs,
        lanes={
            load.lane: LaneFigures(queued=load.queued, oldest_queued_age_s=load.oldest_queued_age_s)
            for load in loads
        },
        interrupts_pending=interrupts_pending,
        unserved=unserved,
        sse_subscribers=services.stream_slots.total(),
        pool_checked_out=checked_out,
        pool_size=pool_size,
        sqlite_wal_bytes=services.db.sqlite_wal_bytes(),
        runs_deleted=deleted.runs,
        rows_deleted=deleted.rows,
        oldest_finished_age_s=oldest,
        llm=tuple(
            LLMFigures(
                model=model,
                tenant=tenant if by_tenant else None,
                prompt_tokens=row.totals.prompt_tokens,
                completion_tokens=row.totals.completion_tokens,
                cached_tokens=row.totals.cached_tokens,
                saved_tokens=row.saved_tokens,
                requests=row.totals.requests,
                failed_requests=row.totals.failed_requests,
                cost=row.totals.cost,
            )
            for tenant, model, row in llm
        ),
    )
    return Response(render(services.metrics, snapshot), media_type=CONTENT_TYPE_LATEST)


def build_router() -> APIRouter:
    """A new router with ``/metrics``."""
    router = APIRouter(tags=["metrics"])
    router.add_api_route(
        "/metrics",
        metrics,
        methods=["GET"],
        response_class=Response,
        responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}},
        summary="Prometheus metrics",
    )
    return router
