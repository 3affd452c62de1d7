"""Runs: trigger a workflow, read, list, resume, cancel and message runs, stream their events.

A trigger goes through :class:`~moorline.admission.admit.Admission` (rate limit, input,
idempotency, conversation, quota, enqueue); the route only finds the workflow in the app's
registry, which it knows for validation and never runs. Every route with a run id loads the
run through :func:`~moorline.api.deps.owned_run` (another tenant's run is 404), then hands it
to the function that does the work (:func:`describe_run`, :func:`resume`, …); the admin's run
routes (:mod:`moorline.api.routes.admin_runs`) call the same functions on any tenant's run.

The event stream is Server-Sent Events over :class:`~moorline.engine.streams.EventStreams`:
each event carries its ``seq`` as its ``id``, so a client that reconnects with
``Last-Event-ID`` (or ``?after=``) resumes after the last one it saw, with neither gap nor
duplicate. The stream closes after the run's terminal event, after ``EXECUTION_TIMEOUT``
(a client reconnects and resumes), or when the client leaves; a comment every
``SSE_PING_INTERVAL`` keeps proxies from closing an idle one. Each tenant may hold
``MAX_STREAMS_PER_TENANT`` streams open per process (:class:`~moorline.api.deps.StreamSlots`).
"""

import asyncio
import base64
import binascii
import json
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from enum import Enum
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, FastAPI, Header, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from sse_starlette import EventSourceResponse, ServerSentEvent

from moorline import fastpaths
from moorline.admission.submission import Origin, admit_submission
from moorline.admission.triggers import Admitted
from moorline.api.deps import (
    RUN_ID_PATTERN,
    Caller,
    CallerDep,
    RateKind,
    Services,
    ServicesDep,
    StreamSlots,
    TriggerCallerDep,
    authenticate_tenant,
    bearer_credential,
    caller_of_key,
    count_request,
    owned_run,
)
from moorline.api.errors import BODY_ERRORS, rate_limit_headers, responses
from moorline.api.guards import JSONRequest, authenticated_by, solved_by
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
    RunAccepted,
    RunCreate,
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
from moorline.db.repos.records import DecisionReason, Event, InterruptStatus, Run
from moorline.dispatch.cancel import cancel_run
from moorline.engine.streams import EventStream
from moorline.engine.submitting import Submission
from moorline.errors import (
    BudgetExhausted,
    ConversationBusy,
    IdempotencyConflict,
    InterruptNotFound,
    InvalidInput,
    InvalidRequest,
    LimitExceeded,
    NoPendingInterrupt,
    NotFound,
    QuotaExceeded,
    RateLimited,
    RunFinished,
    RunNotFound,
    RunNotInteractive,
    Unauthorized,
    WorkflowNotFound,
)
from moorline.observability import tracing
from moorline.runtime.base import RuntimeStore
from moorline.settings import Settings
from moorline.types import JSONObject, RunId, RunStatus

logger = logging.getLogger(__name__)

MAX_EVENT_ID = 2**31 - 1
"""The largest event id (``seq`` is a 32-bit integer on every backend): a larger one names no
event, and PostgreSQL would refuse to compare with it after the stream's 200."""

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
AfterQuery = Annotated[
    int | None,
    Query(ge=0, le=MAX_EVENT_ID, description="Resume after this event id."),
]
LastEventIdHeader = Annotated[
    int | None,
    Header(
        ge=0,
        le=MAX_EVENT_ID,
        description="Resume after this event id (what EventSource sends when it reconnects); "
        "wins over `after`.",
    ),
]

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 200
"""A ``limit`` above this is served as this (clamped, not refused)."""

RunIdPath = Annotated[str, Path(max_length=200, description="The run's id.")]
WorkflowPath = Annotated[str, Path(max_length=200, description="A registered workflow.")]


def accepted(run: Run) -> RunAccepted:
    """The answer to a trigger."""
    return RunAccepted(
        run_id=run.run_id,
        workflow=run.workflow,
        status=run.status,
        queue=run.lane,
        created_at=run.created_at,
    )


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


def location_of(run: Run) -> str:
    """A new run's address (RFC 9110's ``Location`` of a 202): where to follow it."""
    return f"/v1/runs/{quote(run.run_id, safe='')}"


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


async def trigger_run(
    workflow: WorkflowPath, body: RunCreate, caller: TriggerCallerDep, request: Request
) -> Response:
    """Start a run: 202 when admitted, 200 for a repeated idempotency key.

    Its arguments are solved by :func:`solve_trigger`, not by FastAPI (:data:`TriggerRoute`).
    """
    services: Services = request.app.state.services
    with tracing.trigger_span(workflow, request.headers):
        admitted = await admit_submission(
            services.admission,
            services.workflows,
            origin_of(caller),
            Submission(
                workflow=workflow,
                input=body.input,
                idempotency_key=body.idempotency_key,
                conversation_id=body.conversation_id,
                delay=body.delay_seconds,
            ),
        )
        tracing.record(run_id=admitted.run.run_id, created=admitted.created)
    return answer_trigger(admitted, fast=services.settings.fast_paths)


def origin_of(caller: Caller) -> Origin:
    """Who submits, for admission: the key's tenant, its plan, and the key's rate window."""
    return Origin(
        tenant_id=caller.tenant.tenant_id, plan=caller.plan, rate_identity=caller.rate_identity
    )


_WORKFLOW_PATH: TypeAdapter[str] = TypeAdapter(WorkflowPath)


async def solve_trigger(request: JSONRequest) -> dict[str, Any]:
    """:func:`trigger_run`'s arguments, as FastAPI's dependency solver would give them.

    The caller first (:func:`~moorline.api.deps.tenant_caller`: 401 before any 422), then
    the path's workflow and the body, whose errors are FastAPI's (located ``path``, ``body``).

    Raises:
        Unauthorized: no API key, or one that names no tenant.
        RequestValidationError: the workflow name or the body does not fit.
    """
    caller = await caller_of_key(request.app.state.services, bearer_credential(request))
    await request.parse()  # once the caller is known, as authenticated_by's routes do
    errors: list[Any] = []
    workflow = request.path_params["workflow"]
    try:
        workflow = _WORKFLOW_PATH.validate_python(workflow)
    except ValidationError as exc:
        errors += _located(exc, ("path", "workflow"))
    body: RunCreate | None = None
    if not request.has_body:
        errors.append({"type": "missing", "loc": ("body",), "msg": "Field required", "input": None})
    else:
        try:
            # from_attributes, as FastAPI validates a body (its errors' wording depends on it).
            body = RunCreate.model_validate(await request.json(), from_attributes=True)
        except ValidationError as exc:
            errors += _located(exc, ("body",))
    if errors:
        raise RequestValidationError(errors)
    return {"workflow": workflow, "body": body, "caller": caller, "request": request}


def _located(exc: ValidationError, prefix: tuple[str, ...]) -> list[Any]:
    return [{**error, "loc": prefix + error["loc"]} for error in exc.errors(include_url=False)]


TenantRoute = authenticated_by(authenticate_tenant)
"""The run routes' class: the caller's key is checked before a body is read."""

TriggerRoute = solved_by(solve_trigger)
"""The trigger route's class: FastAPI declares it, :func:`solve_trigger` solves it."""


def answer_trigger(admitted: Admitted, *, fast: bool = True) -> Response:
    """The answer to an admitted trigger: its status, rate-limit headers and body.

    A finished response, serialized here, rather than the :class:`RunAccepted` FastAPI would
    validate again against the route's ``response_model`` and then serialize (the route keeps
    ``response_model=RunAccepted`` for its OpenAPI schema; FastAPI sends a returned Response
    as it is). On the trigger path that round trip through pydantic is measurable, and so is
    Starlette's generic header building, which :class:`TriggerAnswer` skips; with ``fast``
    False (the setting ``fast_paths``) Starlette's own ``Response`` builds the same lines.
    """
    body = accepted(admitted.run).model_dump_json().encode()
    status_code = 202 if admitted.created else 200
    rate = admitted.rate
    location = location_of(admitted.run) if admitted.created else None
    if not fast:
        headers = (
            {} if rate is None else rate_limit_headers(rate.limit, rate.remaining, rate.reset_s)
        )
        if location is not None:
            headers["location"] = location
        return Response(body, status_code=status_code, headers=headers, media_type=_JSON)
    header_lines = (
        []
        if rate is None
        else [
            (b"ratelimit-limit", str(rate.limit).encode()),
            (b"ratelimit-remaining", str(rate.remaining).encode()),
            (b"ratelimit-reset", str(rate.reset_s).encode()),
        ]
    )
    if location is not None:
        header_lines.append((b"location", location.encode()))
    header_lines += [(b"content-length", str(len(body)).encode()), _JSON_CONTENT_TYPE]
    return TriggerAnswer(body, status_code=status_code, raw=header_lines)


_JSON = "application/json"
_JSON_CONTENT_TYPE = (b"content-type", b"application/json")


class TriggerAnswer(Response):
    """A JSON response whose header lines come ready-made.

    The lines (and their order) are those ``Response(body, headers=rate_limit_headers(...),
    media_type="application/json")`` would build; ``tests/api/test_runs.py`` compares them.
    """

    media_type = _JSON

    def __init__(self, body: bytes, *, status_code: int, raw: list[tuple[bytes, bytes]]) -> None:
        self.status_code = status_code
        self.background = None
        self.body = body
        self.raw_headers = raw


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


def resume_point(last_event_id: int | None, after: int | None) -> int:
    """The ``seq`` to stream after: ``Last-Event-ID`` wins over ``?after=``; 0 for all.

    Both were checked against :data:`AfterQuery` and :data:`LastEventIdHeader` (0 to
    :data:`MAX_EVENT_ID`) by FastAPI: a 422 ``invalid_request`` otherwise, as documented.
    """
    if last_event_id is not None:
        return last_event_id
    return 0 if after is None else after


def sse_event(event: Event) -> ServerSentEvent:
    """An event as sent: its ``seq`` as ``id``, its type as ``event``, its data as JSON."""
    return ServerSentEvent(
        id=str(event.seq),
        event=event.type,
        data=json.dumps(event.data, separators=(",", ":")),
    )


async def stream_events(
    run_id: RunIdPath,
    caller: CallerDep,
    services: ServicesDep,
    after: AfterQuery = None,
    last_event_id: LastEventIdHeader = None,
) -> EventSourceResponse:
    """The run's events as Server-Sent Events: stored ones after the cursor, then live ones."""
    await count_request(services, caller, RateKind.STREAMS)
    run = await owned_run(services, caller, run_id)
    return await event_stream(
        services, run, resume_point(last_event_id, after), slot=caller.tenant.tenant_id
    )


async def event_stream(
    services: Services, run: Run, after_seq: int, *, slot: str
) -> EventSourceResponse:
    """``run``'s events after ``after_seq`` as Server-Sent Events, counted in ``slot``'s streams.

    Raises:
        RateLimited: ``slot`` already holds as many open streams as allowed.
    """
    services.stream_slots.take(slot)
    try:
        stream = await services.streams.open(run.tenant_id, run.run_id, after_seq=after_seq)
    except BaseException:
        services.stream_slots.give_back(slot)
        raise
    settings = services.settings
    return EventSourceResponse(
        _send(stream, services.stream_slots, slot, settings.execution_timeout),
        ping=settings.sse_ping_interval,
        headers={"Cache-Control": "no-store"},
    )


async def _send(
    stream: EventStream, slots: StreamSlots, slot: str, lifetime_s: float
) -> AsyncIterator[ServerSentEvent]:
    """The stream's events until it ends or its lifetime is over; releases its slot."""
    try:
        async with stream, asyncio.timeout(lifetime_s):
            async for event in stream:
                yield sse_event(event)
    except TimeoutError:
        return  # the client reconnects with Last-Event-ID and resumes
    finally:
        slots.give_back(slot)


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
    _add_trigger_route(app.router, "/v1/workflows/{workflow}/runs", TriggerRoute, tags=["runs"])
    # First of all, ahead of the documentation's routes (/openapi.json, /docs, /redoc) that
    # FastAPI added when the app was built: no path matches both, so only the time changes.
    routes = app.router.routes
    routes.insert(0, routes.pop())
    app.include_router(build_router())


def _add_trigger_route(
    router: APIRouter,
    path: str,
    route_class: type[APIRoute],
    *,
    tags: list[str | Enum] | None = None,
) -> None:
    router.add_api_route(
        path,
        trigger_run,
        methods=["POST"],
        route_class_override=route_class,
        tags=tags,
        status_code=202,
        response_model=RunAccepted,
        responses={
            200: {"model": RunAccepted, "description": "The run of a repeated idempotency key"},
            **responses(
                Unauthorized,
                *BODY_ERRORS,
                WorkflowNotFound,
                InvalidInput,
                IdempotencyConflict,
                ConversationBusy,
                QuotaExceeded,
                RateLimited,
                BudgetExhausted,
            ),
        },
        summary="Start a run of a workflow",
    )


def build_router(*, with_trigger: bool = False) -> APIRouter:
    """A new router with the run routes, the trigger only ``with_trigger`` (see :func:`install`)."""
    router = APIRouter(prefix="/v1", tags=["runs"], route_class=TenantRoute)
    if with_trigger:
        _add_trigger_route(router, "/workflows/{workflow}/runs", TenantRoute)
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
