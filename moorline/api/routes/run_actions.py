"""Retry and re-run of one run, for its tenant and for the admin.

- ``POST /v1/runs/{run_id}/retry``: a ``failed`` or ``timed_out`` run back to ``queued`` with
  a fresh attempt budget and its checkpoints kept, so it resumes at the step that failed
  (:mod:`moorline.db.repos.run_retries`); any other status is 409 ``run_not_retryable``. It
  is the same run: no quota unit is taken again.
- ``POST /v1/runs/{run_id}/rerun``: a new run of the same workflow with the same input (and
  conversation), through admission like any trigger (rate limit, quota, conversation), with
  ``rerun_of`` naming the original. An optional body ``{"idempotency_key"}`` makes a repeated
  request (a lost answer sent again) return the first re-run with 200 instead of a second.

The admin's routes (``/v1/admin/runs/{run_id}/retry|rerun``) call the same functions on any
tenant's run; the admin's re-run counts against the run's tenant's plan, quota included.
"""

from fastapi import APIRouter, Response

from moorline.admission.triggers import Trigger
from moorline.api.deps import (
    CallerDep,
    RunIdPath,
    Services,
    ServicesDep,
    admin_router,
    any_run,
    owned_run,
)
from moorline.api.errors import BODY_ERRORS, responses
from moorline.api.routes.admin_runs import ADMIN_ERRORS
from moorline.api.routes.runs import TenantRoute
from moorline.api.routes.trigger import accepted, location_of
from moorline.api.schemas import RerunAccepted, RerunRequest, RunAccepted
from moorline.db.repos.records import Run
from moorline.errors import (
    BudgetExhausted,
    ConversationBusy,
    IdempotencyConflict,
    InvalidRequest,
    QuotaExceeded,
    RateLimited,
    RunNotFound,
    RunNotRetryable,
    TenantNotFound,
    Unauthorized,
    WorkflowNotFound,
)
from moorline.plans import Plan

ADMIN_RATE_IDENTITY = "admin"
"""The rate-limit credential of the admin's re-runs (with the run's tenant's plan rate)."""


async def retry_run(run_id: RunIdPath, caller: CallerDep, services: ServicesDep) -> RunAccepted:
    """Put a failed or timed-out run back to queued; it resumes at the step that failed."""
    return await retry(services, await owned_run(services, caller, run_id))


async def retry_any_run(run_id: RunIdPath, services: ServicesDep) -> RunAccepted:
    """Retry any tenant's failed or timed-out run."""
    return await retry(services, await any_run(services, run_id))


async def retry(services: Services, run: Run) -> RunAccepted:
    """Retry ``run`` and wake its lane's workers.

    Raises:
        RunNotRetryable: ``run`` is not ``failed`` or ``timed_out``.
        ConversationBusy: its conversation has another active run now.
    """
    retried = await services.runs.retry(run.run_id, tenant_id=run.tenant_id)
    await services.notifier.notify({retried.lane})
    return accepted(retried)


async def rerun_run(
    run_id: RunIdPath,
    caller: CallerDep,
    services: ServicesDep,
    response: Response,
    body: RerunRequest | None = None,
) -> RerunAccepted:
    """Start a new run with the run's workflow and input, linked to it (``rerun_of``)."""
    run = await owned_run(services, caller, run_id)
    key = None if body is None else body.idempotency_key
    return await rerun(services, run, caller.plan, caller.rate_identity, response, key)


async def rerun_any_run(
    run_id: RunIdPath,
    services: ServicesDep,
    response: Response,
    body: RerunRequest | None = None,
) -> RerunAccepted:
    """Re-run any tenant's run, against that tenant's plan and quota."""
    run = await any_run(services, run_id)
    tenant = await services.tenants.get(run.tenant_id)
    if tenant is None:  # pragma: no cover - a run's tenant is deleted with its runs
        raise TenantNotFound(f"no tenant {run.tenant_id}")
    plan = await services.plans.get(tenant.plan)
    identity = f"{ADMIN_RATE_IDENTITY}:{run.tenant_id}"
    key = None if body is None else body.idempotency_key
    return await rerun(services, run, plan, identity, response, key)


async def rerun(
    services: Services,
    run: Run,
    plan: Plan,
    rate_identity: str,
    response: Response,
    idempotency_key: str | None,
) -> RerunAccepted:
    """Admit a new run of ``run``'s workflow with its input and conversation.

    With ``idempotency_key``, a repeat answers the first re-run (200, no new run): the key is
    the trigger's, so it is unique per tenant among all its runs, as a trigger's key is.

    Raises:
        WorkflowNotFound: the served app no longer has the workflow.
        InvalidInput: the input no longer fits the workflow's parameters.
        ConversationBusy, QuotaExceeded, RateLimited: as for a trigger.
        IdempotencyConflict: the key belongs to a run that is not a re-run of ``run``.
    """
    if not isinstance(run.input, dict):  # pragma: no cover - inputs are stored as objects
        raise InvalidRequest(f"run {run.run_id} has no input object to re-run")
    admitted = await services.admission.admit(
        Trigger(
            tenant_id=run.tenant_id,
            plan=plan,
            rate_identity=rate_identity,
            workflow=services.workflows.get(run.workflow),
            input=run.input,
            conversation_id=run.conversation_id,
            rerun_of=run.run_id,
            idempotency_key=idempotency_key,
        )
    )
    if not admitted.created:
        if admitted.run.rerun_of != run.run_id:
            raise IdempotencyConflict(
                f"idempotency key {idempotency_key!r} was used by run {admitted.run.run_id}, "
                f"which is not a re-run of {run.run_id}"
            )
        response.status_code = 200
    response.headers["location"] = location_of(admitted.run)
    return RerunAccepted(**accepted(admitted.run).model_dump(), rerun_of=run.run_id)


def _add_routes(router: APIRouter, *, admin: bool) -> None:
    """The retry and re-run routes on ``router`` (under ``/v1`` or ``/v1/admin``)."""
    errors = ADMIN_ERRORS if admin else (Unauthorized, RateLimited)
    whose = "any tenant's" if admin else "a"
    router.add_api_route(
        "/runs/{run_id}/retry",
        retry_any_run if admin else retry_run,
        methods=["POST"],
        status_code=202,
        response_model=RunAccepted,
        responses=responses(
            *errors, InvalidRequest, RunNotFound, RunNotRetryable, ConversationBusy
        ),
        summary=f"Retry {whose} failed or timed-out run from its failed step",
    )
    router.add_api_route(
        "/runs/{run_id}/rerun",
        rerun_any_run if admin else rerun_run,
        methods=["POST"],
        status_code=202,
        response_model=RerunAccepted,
        responses={
            200: {"model": RerunAccepted, "description": "The re-run of a repeated key"},
            **responses(
                *errors,
                *BODY_ERRORS,
                InvalidRequest,
                RunNotFound,
                WorkflowNotFound,
                ConversationBusy,
                IdempotencyConflict,
                QuotaExceeded,
                RateLimited,
                BudgetExhausted,
            ),
        },
        summary=f"Start a new run with {whose} run's input",
    )


def build_router() -> APIRouter:
    """A new router with the tenant's retry and re-run routes."""
    router = APIRouter(prefix="/v1", tags=["runs"], route_class=TenantRoute)
    _add_routes(router, admin=False)
    return router


def build_admin_router() -> APIRouter:
    """A new router with the admin's retry and re-run routes."""
    router = admin_router()
    _add_routes(router, admin=True)
    return router
