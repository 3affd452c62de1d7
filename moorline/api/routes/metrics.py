"""``GET /metrics``: the Prometheus text exposition (see :mod:`moorline.observability.metrics`).

Unauthenticated, like the health probes: a Prometheus server scrapes it, and it names lanes,
statuses and workflows only, never a tenant, a run or an input.
"""

import asyncio

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from moorline.api.deps import ServicesDep
from moorline.db.repos.gauges import Gauges
from moorline.db.repos.workers import WorkersRepo
from moorline.observability.metrics import LaneFigures, Snapshot, render


async def metrics(services: ServicesDep) -> Response:
    """Every metric of this deployment, read now."""
    gauges = Gauges(services.db)
    runs, interrupts_pending, loads, unserved, deleted, oldest = await asyncio.gather(
        gauges.runs_by_lane_and_status(),
        gauges.pending_interrupts(),
        services.listing.lane_loads(await services.plans.lane_slots()),
        WorkersRepo(services.db).unserved(),
        gauges.deleted(),
        gauges.oldest_finished_age_s(),
    )
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
