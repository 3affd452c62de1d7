"""``GET /v1/workflows``: the catalogue of the workflows this deployment can run.

Each entry is what a caller needs to trigger one: its name, its input as JSON Schema (from the
function's signature, the same model a trigger is validated with), its limits, and the lanes
its runs can be queued on. Every worker runs the whole app, so every lane of the configured
plans serves every workflow; ``lane`` is the one the caller's plan sends its runs to.
"""

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from moorline.api.deps import CallerDep, ServicesDep
from moorline.api.errors import responses
from moorline.engine.registry import WorkflowDefinition
from moorline.errors import Unauthorized


class WorkflowLimitsOut(BaseModel):
    """What bounds one run of the workflow."""

    model_config = ConfigDict(frozen=True)

    max_attempts: int = Field(description="Claims a run may have before it ends failed.")
    timeout_s: float | None = Field(
        description="Hard limit of an attempt in seconds; null: MOORLINE_EXECUTION_TIMEOUT."
    )
    soft_timeout_s: float | None = Field(
        description="Seconds after which the workflow is asked to stop; null: none."
    )


class WorkflowOut(BaseModel):
    """One workflow of the catalogue."""

    model_config = ConfigDict(frozen=True)

    name: str
    parameters: dict[str, Any] = Field(description="JSON Schema of the trigger's `input`.")
    limits: WorkflowLimitsOut
    lanes: list[str] = Field(description="Every lane whose workers serve the workflow.")
    lane: str = Field(description="The lane the caller's runs are queued on (its plan's).")


class WorkflowsOut(BaseModel):
    """The catalogue, by name."""

    model_config = ConfigDict(frozen=True)

    workflows: list[WorkflowOut]


def describe(definition: WorkflowDefinition, *, lanes: list[str], lane: str) -> WorkflowOut:
    """The catalogue entry of one workflow."""
    return WorkflowOut(
        name=definition.name,
        parameters=definition.parameters_schema(),
        limits=WorkflowLimitsOut(
            max_attempts=definition.max_attempts,
            timeout_s=definition.timeout_s,
            soft_timeout_s=definition.soft_timeout_s,
        ),
        lanes=lanes,
        lane=lane,
    )


async def list_workflows(caller: CallerDep, services: ServicesDep) -> WorkflowsOut:
    """Every workflow the caller may trigger, by name."""
    lanes = sorted(await services.plans.lane_slots())
    ordered = sorted(services.workflows, key=lambda definition: definition.name)
    return WorkflowsOut(
        workflows=[describe(item, lanes=lanes, lane=caller.plan.lane) for item in ordered]
    )


def build_router() -> APIRouter:
    """A new router with the catalogue route."""
    router = APIRouter(prefix="/v1", tags=["workflows"])
    router.add_api_route(
        "/workflows",
        list_workflows,
        methods=["GET"],
        responses=responses(Unauthorized),
        summary="The workflows this deployment runs, with their inputs as JSON Schema",
    )
    return router
