"""Triggering a run over HTTP: the hot path, with FastAPI's generic work taken off it.

``POST /v1/workflows/{workflow}/runs`` goes through
:class:`~moorline.admission.admit.Admission` (rate limit, input, idempotency, conversation,
quota, enqueue); the route only finds the workflow in the app's registry, which it knows for
validation and never runs. Triggers are what clients send most, so the route's arguments are
solved by :func:`solve_trigger` rather than by FastAPI's dependency solver
(:data:`TriggerRoute`), and its answer is built ready to send (:func:`answer_trigger`); with
the setting ``fast_paths`` False it is an ordinary route whose arguments FastAPI solves. The
OpenAPI document is the same either way (:func:`add_trigger_route`).
"""

from enum import Enum
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import Path, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute, APIRouter
from pydantic import TypeAdapter, ValidationError

from moorline.admission.submission import Origin, admit_submission
from moorline.admission.triggers import Admitted
from moorline.api.deps import Caller, Services, TriggerCallerDep, bearer_credential, caller_of_key
from moorline.api.errors import ADMISSION_ERRORS, BODY_ERRORS, rate_limit_headers, responses
from moorline.api.guards import JSONRequest, solved_by
from moorline.api.schemas import RunAccepted, RunCreate
from moorline.db.repos.records import Run
from moorline.engine.submitting import Submission
from moorline.errors import Unauthorized
from moorline.observability import tracing

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


def location_of(run: Run) -> str:
    """A new run's address (RFC 9110's ``Location`` of a 202): where to follow it."""
    return f"/v1/runs/{quote(run.run_id, safe='')}"


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


def add_trigger_route(
    router: APIRouter,
    path: str,
    route_class: type[APIRoute],
    *,
    tags: list[str | Enum] | None = None,
) -> None:
    """Add the trigger route to ``router`` at ``path``, its arguments solved by ``route_class``."""
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
            **responses(Unauthorized, *BODY_ERRORS, *ADMISSION_ERRORS),
        },
        summary="Start a run of a workflow",
    )
