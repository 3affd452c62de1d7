"""``POST /v1/workflows/{workflow}/runs/batch``: up to 1,000 triggers in one request.

Each item is admitted on its own, exactly as the single trigger would admit its body
(:func:`~moorline.admission.submission.admit_each`: rate limit, input, idempotency key,
conversation, quota), and answered at its index with the status the single trigger would
answer and the run it names. Not all-or-nothing: one item's refusal stores nothing for that
item and changes nothing for the others. Most items are decided together
(:mod:`moorline.admission.bulk`), so the Submitter stores them in a few transactions; items
that share an idempotency key or a conversation are decided one by one, in the list's order.

What refuses the whole request is what the single trigger refuses before admission: a missing
or unknown key (401), an unknown workflow (404), a body that is not JSON (400), one that does
not fit the schema, no items or more than 1,000 among it (422), a body over
``MOORLINE_MAX_BODY_BYTES`` (413).
"""

from fastapi import APIRouter, Request, Response

from moorline.admission.submission import admit_each
from moorline.admission.triggers import Admitted
from moorline.api.deps import ServicesDep, TriggerCallerDep, authenticate_tenant
from moorline.api.errors import BODY_ERRORS, responses
from moorline.api.guards import authenticated_by
from moorline.api.routes.trigger import WorkflowPath, origin_of
from moorline.api.schemas import ItemError, RunBatch, RunBatchAnswer, RunBatchItem
from moorline.engine.submitting import Submission
from moorline.errors import MoorlineError, QuotaExceeded, Unauthorized, WorkflowNotFound
from moorline.observability import tracing
from moorline.types import RunStatus


async def trigger_batch(
    workflow: WorkflowPath,
    body: RunBatch,
    caller: TriggerCallerDep,
    services: ServicesDep,
    request: Request,
) -> Response:
    """Start up to 1,000 runs of a workflow; each item is answered on its own."""
    services.workflows.get(workflow)  # an unknown workflow refuses the request, not each item
    submissions = [
        Submission(
            workflow=workflow,
            input=item.input,
            idempotency_key=item.idempotency_key,
            conversation_id=item.conversation_id,
            delay=item.delay_seconds,
        )
        for item in body.runs
    ]
    with tracing.trigger_span(workflow, request.headers):
        outcomes = await admit_each(
            services.admission, services.workflows, origin_of(caller), submissions, checked=True
        )
    items = [answer_item(outcome) for outcome in outcomes]
    answer = RunBatchAnswer(
        workflow=workflow,
        created=sum(item.status_code == 202 for item in items),
        existing=sum(item.status_code == 200 for item in items),
        refused=sum(item.error is not None for item in items),
        results=items,
    )
    # Serialized here: FastAPI would validate the model again against response_model first,
    # a measurable cost at a thousand items (the route keeps response_model for its schema).
    return Response(answer.model_dump_json(), media_type="application/json")


def answer_item(outcome: Admitted | MoorlineError) -> RunBatchItem:
    """One item's answer: its run, or the error the single trigger would answer."""
    if isinstance(outcome, MoorlineError):
        error = ItemError(code=outcome.code, message=outcome.message, **outcome.details)
        # A run the quota refused is stored (rate_limited): the item names it, as the error does.
        run_id = outcome.run_id if isinstance(outcome, QuotaExceeded) else None
        return RunBatchItem(
            status_code=outcome.status,
            run_id=run_id,
            status=RunStatus.RATE_LIMITED if run_id is not None else None,
            error=error,
        )
    run = outcome.run
    return RunBatchItem(
        status_code=202 if outcome.created else 200,
        run_id=run.run_id,
        status=run.status,
        queue=run.lane,
        created_at=run.created_at,
    )


def build_router() -> APIRouter:
    """A new router with the batch trigger route."""
    router = APIRouter(
        prefix="/v1", tags=["runs"], route_class=authenticated_by(authenticate_tenant)
    )
    router.add_api_route(
        "/workflows/{workflow}/runs/batch",
        trigger_batch,
        methods=["POST"],
        response_model=RunBatchAnswer,
        responses=responses(Unauthorized, *BODY_ERRORS, WorkflowNotFound),
        summary="Start up to 1,000 runs of a workflow, each answered on its own",
    )
    return router
