"""``GET /v1/admin/workers``: every worker process, live or dead, and the runs each holds.

Each worker process (``moorline worker``, or each worker loop of ``moorline serve``) renews a
``workers`` row with its heartbeat (:mod:`moorline.worker.presence`); these routes read those
rows and the ``running`` runs whose lease names them (:mod:`moorline.db.repos.workers`). A
worker is ``dead`` once its row's expiry (one ``MOORLINE_LEASE_TTL`` after its last beat, by
database time) passed, so a worker killed with ``kill -9`` shows dead within one TTL; the
runs it held stay listed under it until the reaper takes them back. Admin token only.
"""

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query

from moorline.api.deps import ServicesDep, admin_router
from moorline.api.errors import responses
from moorline.api.schemas import TOKEN, HeldRunOut, WorkerDetail, WorkerList, WorkerOut
from moorline.db.repos.workers import HeldRun, ListedWorker, WorkersRepo
from moorline.errors import Forbidden, InvalidRequest, Unauthorized, WorkerNotFound

ADMIN_ERRORS = (Unauthorized, Forbidden)

WorkerIdPath = Annotated[
    str,
    Path(
        min_length=1,
        max_length=255,
        pattern=TOKEN,
        description="The worker's id (`worker_id` of the listing).",
    ),
]
StatusQuery = Annotated[
    Literal["live", "dead"] | None,
    Query(description="Only the live, or only the dead, workers."),
]


def _worker_out(listed: ListedWorker) -> WorkerOut:
    row = listed.worker
    entry = row.entry
    return WorkerOut(
        worker_id=entry.worker_id,
        host=entry.host,
        pid=entry.pid,
        version=entry.version,
        lanes=dict(entry.lanes),
        workflows=None if entry.workflows is None else list(entry.workflows),
        status="live" if listed.alive else "dead",
        started_at=row.started_at,
        last_seen_at=row.last_seen_at,
        last_seen_age_s=listed.last_seen_age_s,
        expires_at=row.expires_at,
        runs=listed.held,
        run_ids=list(listed.held_ids),
    )


def _held_out(run: HeldRun) -> HeldRunOut:
    return HeldRunOut(
        run_id=run.run_id,
        tenant_id=run.tenant_id,
        workflow=run.workflow,
        queue=run.lane,
        attempt=run.attempt,
        started_at=run.started_at,
        lease_expires_at=run.lease_expires_at,
    )


async def list_workers(services: ServicesDep, status: StatusQuery = None) -> WorkerList:
    """Every worker with a heartbeat row, live ones first, with the runs each holds."""
    listed = await WorkersRepo(services.db).listing()
    if status is not None:
        listed = [worker for worker in listed if worker.alive == (status == "live")]
    return WorkerList(workers=[_worker_out(worker) for worker in listed])


async def get_worker(worker_id: WorkerIdPath, services: ServicesDep) -> WorkerDetail:
    """One worker with every run it holds, in id order."""
    found = await WorkersRepo(services.db).get(worker_id)
    if found is None:
        raise WorkerNotFound(f"no worker {worker_id} (it never beat, stopped, or was pruned)")
    listed, held = found
    return WorkerDetail(**_worker_out(listed).model_dump(), held=[_held_out(run) for run in held])


def build_router() -> APIRouter:
    """A new router with the workers routes."""
    router = admin_router()
    router.add_api_route(
        "/workers",
        list_workers,
        methods=["GET"],
        responses=responses(*ADMIN_ERRORS, InvalidRequest),
        summary="Every worker, live or dead, with the runs it holds",
    )
    router.add_api_route(
        "/workers/{worker_id}",
        get_worker,
        methods=["GET"],
        responses=responses(*ADMIN_ERRORS, InvalidRequest, WorkerNotFound),
        summary="One worker with every run it holds",
    )
    return router
