"""Runs: read, list, resume, cancel and message runs; the routes of ``/v1/runs``.

Every route with a run id loads the run through :func:`~moorline.api.deps.owned_run` (another
tenant's run is 404), then hands it to the function that does the work (:func:`describe_run`,
:func:`resume`, …); the admin's run routes (:mod:`moorline.api.routes.admin_runs`) call the
same functions on any tenant's run. The trigger route is :mod:`moorline.api.routes.trigger`'s
and the event stream :mod:`moorline.api.routes.run_events`'s; :func:`install` adds them all.
"""

import base64
import binascii
import json
import logging
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, FastAPI, Query
from sse_starlette import EventSourceResponse

from moorline import fastpaths
from moorline.api.deps import (
    RUN_ID_PATTERN,
    CallerDep,
    RunIdPath,
    Services,
    ServicesDep,
    authenticate_tenant,
    owned_run,
)
from moorline.api.errors import BODY_ERRORS, responses
from moorline.api.guards import authenticated_by
from moorline.api.routes.run_events import stream_events
from moorline.api.routes.trigger import TriggerRoute, add_trigger_route
from moorline.api.routes.usage import run_usage_out, step_usage_out
from moorline.api.schemas import (
    CONVERSATION,
    WORKFLOW,
    ApprovalOut,
    Cancelled,
    ChildOut,
    MessageAccepted,
    MessageIn,
    PendingInterrupt,
    Resume,
    Resumed,
    RunIdText,
    RunList,
    RunOut,
    RunSummary,
    StepOut,
    StorableTime,
    WaitingFor,
)
from moorline.db.repos.children import ChildrenRepo
from moorline.db.repos.interrupts import InterruptResolved
from moorline.db.repos.listing import (
    SEARCH_WINDOW,
    SHORT_ID_MAX,
    RunCursor,
    RunFilter,
    RunPage,
)
from moorline.db.repos.records import DecisionReason, InterruptStatus, Run
from moorline.dispatch.cancel import cancel_run
from moorline.errors import (
    InterruptNotFound,
    InvalidInput,
    InvalidRequest,
    LimitExceeded,
    NoPendingInterrupt,
    NotFound,
    RateLimited,
    RunFinished,
    RunNotFound,
    RunNotInteractive,
    Unauthorized,
)
from moorline.runtime.base import RuntimeStore
from moorline.settings import Settings
from moorline.types import JSONObject, RunId, RunStatus

logger = logging.getLogger(__name__)

CURSOR_PATTERN = r"^[A-Za-z0-9_-]+$"
"""A ``next_cursor`` is unpadded URL-safe base64 (:func:`encode_cursor`)."""

# The parameters' constraints are in the OpenAPI document as the server applies them: what
# FastAPI checks is refused 422 invalid_request before a route runs.
CursorQuery = Annotated[
    str | None,
    Query(
        min_length=1,
        max_length=500,
        pattern=CURSOR_PATTERN,
        description="A `next_cursor` of an earlier page, as returned; anything else is 422.",
    ),
]
RunIdSearchQuery = Annotated[
    str | None,
    Query(
        min_length=4,
        max_length=36,
        pattern=r"^[0-9a-f-]+$",
        description=f"Only runs whose id starts with this, when longer than {SHORT_ID_MAX} "
        f"characters (a whole id, say); up to {SHORT_ID_MAX}, whose id starts or ends with it "
        f"(the dashboard shows an id's last 8), among the newest {SEARCH_WINDOW:,} runs the "
        "other filters select.",
    ),
]
InputContainsQuery = Annotated[
    str | None,
    Query(
        min_length=1,
        max_length=200,
        description=f"Only runs whose input's JSON text contains this, in any case; among the "
        f"newest {SEARCH_WINDOW:,} runs the other filters select.",
    ),
]
CreatedAfterQuery = Annotated[
    StorableTime,
    Query(description="Only runs created at or after this instant (with its UTC offset)."),
]
CreatedBeforeQuery = Annotated[
    StorableTime,
    Query(description="Only runs created before this instant (with its UTC offset)."),
]
MAX_LISTED_IDS = 100
"""The most run ids one listing may name (``ids`` repeated): one page's worth."""
IdsQuery = Annotated[
    list[RunIdText] | None,
    Query(max_length=MAX_LISTED_IDS, description="Only these runs (repeat `ids` for more)."),
]

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 200
"""A ``limit`` above this is served as this (clamped, not refused)."""


def summary(run: Run) -> RunSummary:
    """``run`` as listed."""
    return RunSummary(
        run_id=run.run_id,
        workflow=run.workflow,
        tenant_id=run.tenant_id,
        status=run.status,
        queue=run.lane,
        attempt=run.attempt,
        error=run.error,
        conversation_id=run.conversation_id,
        created_at=run.created_at,
        started_at=run.started_at,
        finished_at=run.finished_at,
        elapsed_time=run.elapsed_time,
        waiting_for=None if run.waiting_for is None else WaitingFor.model_validate(run.waiting_for),
        parent_run_id=run.parent_run_id,
        rerun_of=run.rerun_of,
    )


def encode_cursor(cursor: RunCursor) -> str:
    """The opaque ``next_cursor`` string of a listing position."""
    raw = json.dumps([cursor.created_at.isoformat(), cursor.run_id], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(text: str) -> RunCursor:
    """The listing position of a ``cursor`` this API returned.

    Raises:
        InvalidRequest: not a cursor this API returned.
    """
    refused = InvalidRequest("cursor: not a cursor this API returned")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        created_at, run_id = json.loads(raw)
        moment = datetime.fromisoformat(created_at)
        if moment.tzinfo is None:
            raise refused
        # In UTC here, as the database compares it: a forged far-past time with an offset
        # would overflow only when bound, as a 500.
        moment = moment.astimezone(UTC)
    except (binascii.Error, ValueError, TypeError, OverflowError):
        raise refused from None
    # A run id this API wrote: a forged one (a NUL, which PostgreSQL refuses) is not sent.
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.match(run_id):
        raise refused
    return RunCursor(created_at=moment, run_id=RunId(run_id))


TenantRoute = authenticated_by(authenticate_tenant)
"""The run routes' class: the caller's key is checked before a body is read."""


async def get_run(run_id: RunIdPath, caller: CallerDep, services: ServicesDep) -> RunOut:
    """A run with its steps and the decision it waits for, if any."""
    return await describe_run(services, await owned_run(services, caller, run_id))


async def describe_run(services: Services, run: Run) -> RunOut:
    """``run`` with its steps and the decision it waits for, if any."""
    steps = await services.steps.list(run.run_id)
    children = await ChildrenRepo(services.db).list(run.run_id)
    asked = await services.interrupts.for_run(run.run_id)
    pending = [i for i in asked if i.status is InterruptStatus.PENDING]
    waiting = pending[0] if pending and not run.status.is_terminal else None
    return RunOut(
        **summary(run).model_dump(),
        input=run.input,
        output=run.output,
        children=[
            ChildOut(
                run_id=child.run_id,
                key=child.child_key or "",
                workflow=child.workflow,
                status=child.status,
            )
            for child in children
        ],
        steps=[
            StepOut(
                key=step.key,
                status=step.status.value,
                attempt=step.attempt,
                started_at=step.started_at,
                finished_at=step.finished_at,
                usage=step_usage_out(step.usage),
            )
            for step in steps
        ],
        approvals=[
            ApprovalOut(
                interrupt_id=i.interrupt_id,
                action=i.action,
                status=i.status.value,
                reason=None if i.reason is None else i.reason.value,
                requested_at=i.created_at,
                decided_at=i.resolved_at,
            )
            for i in asked
        ],
        usage=run_usage_out(run, steps),
        pending_interrupt=(
            None
            if waiting is None
            else PendingInterrupt(
                interrupt_id=waiting.interrupt_id,
                action=waiting.action,
                data=waiting.data,
                expires_at=waiting.expires_at,
            )
        ),
    )


async def list_runs(
    caller: CallerDep,
    services: ServicesDep,
    status: RunStatus | None = None,
    workflow: Annotated[str | None, Query(max_length=200, pattern=WORKFLOW)] = None,
    conversation_id: Annotated[str | None, Query(max_length=200, pattern=CONVERSATION)] = None,
    limit: Annotated[
        int, Query(ge=1, description=f"Runs per page; above {MAX_PAGE_SIZE} counts as that.")
    ] = DEFAULT_PAGE_SIZE,
    cursor: CursorQuery = None,
    parent_run_id: Annotated[
        str | None, Query(max_length=36, description="Only this run's child runs.")
    ] = None,
    run_id: RunIdSearchQuery = None,
    input_contains: InputContainsQuery = None,
    created_after: CreatedAfterQuery = None,
    created_before: CreatedBeforeQuery = None,
    ids: IdsQuery = None,
) -> RunList:
    """The tenant's runs, newest first, a page at a time."""
    page = await services.listing.page(
        caller.tenant.tenant_id,
        where=RunFilter(
            status=status,
            workflow=workflow,
            conversation_id=conversation_id,
            parent_run_id=parent_run_id,
            run_id_search=run_id,
            input_contains=input_contains,
            created_after=created_after,
            created_before=created_before,
            run_ids=None if ids is None else tuple(sorted(set(ids))),
        ),
        limit=min(limit, MAX_PAGE_SIZE),
        after=None if cursor is None else decode_cursor(cursor),
    )
    return listed(page)


def listed(page: RunPage) -> RunList:
    """A page of runs as answered."""
    return RunList(
        runs=[summary(run) for run in page.runs],
        next_cursor=None if page.next_cursor is None else encode_cursor(page.next_cursor),
    )


async def resume_run(
    run_id: RunIdPath, body: Resume, caller: CallerDep, services: ServicesDep
) -> Resumed:
    """Approve or deny the decision a run waits for; the first decision wins."""
    return await resume(services, await owned_run(services, caller, run_id), body)


async def resume(services: Services, run: Run, body: Resume) -> Resumed:
    """Record the decision ``run`` waits for and wake its worker; the first decision wins."""
    interrupt_id = body.interrupt_id
    if interrupt_id is None:
        pending = (
            [] if run.status.is_terminal else await services.interrupts.pending_for_run(run.run_id)
        )
        if not pending:
            raise NoPendingInterrupt(f"run {run.run_id} waits for no decision")
        interrupt_id = pending[0].interrupt_id
    reason = DecisionReason.APPROVED if body.approved else DecisionReason.DENIED
    try:
        resolved = await services.interrupts.resolve(
            run.run_id, interrupt_id, approved=body.approved, reason=reason, data=body.data
        )
    except NotFound:
        raise InterruptNotFound(f"no interrupt {interrupt_id} in run {run.run_id}") from None
    await _wake(services.store, run.run_id, interrupt_id, body.approved, reason, body.data)
    if not run.status.is_terminal:
        # A run waiting for this decision was re-queued by it: its lane's workers claim it now
        # rather than at their next poll. A run still executing gets a spare claim, no more.
        await services.notifier.notify({run.lane})
    return Resumed(run_id=run.run_id, interrupt_id=resolved.interrupt_id, resolution="resolved")


async def _wake(
    store: RuntimeStore,
    run_id: RunId,
    interrupt_id: str,
    approved: bool,
    reason: DecisionReason,
    data: JSONObject | None,
) -> None:
    """Wake the run's waiting worker; the database already holds the decision.

    A lost wake-up costs the worker one poll of the database, so a store that does not answer
    does not fail the request.
    """
    decision: JSONObject = {"approved": approved, "reason": reason.value, "data": data}
    try:
        await store.resolve_interrupt(run_id, interrupt_id, decision)
    except Exception:
        logger.warning("could not wake run %s after a decision", run_id, exc_info=True)


async def cancel(run_id: RunIdPath, caller: CallerDep, services: ServicesDep) -> Cancelled:
    """Cancel a run: a queued one ends at once, a running one at its next check."""
    return await cancel_owned(services, await owned_run(services, caller, run_id))


async def cancel_owned(services: Services, run: Run) -> Cancelled:
    """Cancel ``run``: a queued one ends at once, a running one at its next check."""
    cancelled = await cancel_run(
        services.runs, services.store, run.tenant_id, run.run_id, ChildrenRepo(services.db)
    )
    return Cancelled(run_id=cancelled.run_id, status=cancelled.status)


async def post_message(
    run_id: RunIdPath, body: MessageIn, caller: CallerDep, services: ServicesDep
) -> MessageAccepted:
    """Hand a message to a running run's workflow (it drains messages at its checkpoints)."""
    return await send_message(services, await owned_run(services, caller, run_id), body)


async def send_message(services: Services, run: Run, body: MessageIn) -> MessageAccepted:
    """Hand a message to ``run``'s workflow (it drains messages at its checkpoints)."""
    message = await services.inbox.post_message(run.tenant_id, run.run_id, body.content)
    return MessageAccepted(run_id=run.run_id, seq=message.seq)


def install(app: FastAPI) -> None:
    """Add the run routes to ``app`` (whose ``state.settings`` is set).

    The trigger route goes on the app's own router rather than through
    :func:`build_router`'s: FastAPI matches a route of an included router twice per request
    (once to choose the router, once inside it), and triggers are the hot path. Its path,
    tags and everything else in the OpenAPI document are those of the included route. With
    the setting ``fast_paths`` False it is an ordinary route of the included router, its
    arguments solved by FastAPI (:data:`TenantRoute`).

    Raises:
        ConfigError: ``fast_paths``, and the installed FastAPI or Starlette lacks an internal
            the trigger route's fast path uses.
    """
    settings: Settings = app.state.settings
    if not settings.fast_paths:
        app.include_router(build_router(with_trigger=True))
        return
    fastpaths.require("fastapi")
    fastpaths.require("starlette")
    add_trigger_route(app.router, "/v1/workflows/{workflow}/runs", TriggerRoute, tags=["runs"])
    # First of all, ahead of the documentation's routes (/openapi.json, /docs, /redoc) that
    # FastAPI added when the app was built: no path matches both, so only the time changes.
    routes = app.router.routes
    routes.insert(0, routes.pop())
    app.include_router(build_router())


def build_router(*, with_trigger: bool = False) -> APIRouter:
    """A new router with the run routes, the trigger only ``with_trigger`` (see :func:`install`)."""
    router = APIRouter(prefix="/v1", tags=["runs"], route_class=TenantRoute)
    if with_trigger:
        add_trigger_route(router, "/workflows/{workflow}/runs", TenantRoute)
    router.add_api_route(
        "/runs",
        list_runs,
        methods=["GET"],
        responses=responses(Unauthorized, InvalidRequest, RateLimited),
        summary="List runs, newest first",
    )
    router.add_api_route(
        "/runs/{run_id}",
        get_run,
        methods=["GET"],
        responses=responses(Unauthorized, InvalidRequest, RunNotFound, RateLimited),
        summary="A run with its steps and pending interrupt",
    )
    router.add_api_route(
        "/runs/{run_id}/resume",
        resume_run,
        methods=["POST"],
        responses=responses(
            Unauthorized,
            *BODY_ERRORS,
            RunNotFound,
            InterruptNotFound,
            NoPendingInterrupt,
            InterruptResolved,
            RateLimited,
        ),
        summary="Approve or deny a paused run",
    )
    router.add_api_route(
        "/runs/{run_id}/cancel",
        cancel,
        methods=["POST"],
        status_code=202,
        responses=responses(Unauthorized, InvalidRequest, RunNotFound, RunFinished, RateLimited),
        summary="Cancel a run",
    )
    router.add_api_route(
        "/runs/{run_id}/messages",
        post_message,
        methods=["POST"],
        status_code=202,
        responses=responses(
            Unauthorized,
            *BODY_ERRORS,
            InvalidInput,
            RunNotFound,
            RunNotInteractive,
            LimitExceeded,
            RateLimited,
        ),
        summary="Send a message to a running run",
    )
    router.add_api_route(
        "/runs/{run_id}/events",
        stream_events,
        methods=["GET"],
        response_class=EventSourceResponse,
        responses={
            200: {"content": {"text/event-stream": {}}, "description": "The run's events"},
            **responses(Unauthorized, InvalidRequest, RunNotFound, RateLimited),
        },
        summary="Stream a run's events (Server-Sent Events)",
    )
    return router
