"""A tenant's schedules: ``/v1/schedules``, create, list, read, edit, pause, resume, delete.

A schedule triggers one workflow with a fixed input at every tick of a cron expression (five
fields, in an IANA time zone) or of an interval (``every_seconds``). The scheduler chore fires
the ticks through admission (see :mod:`moorline.admission.scheduler`); these routes only store
what to fire and when the next tick is. The workflow and its input are checked when they are
stored, so a schedule does not fail its first tick on a typo (a later deploy that changes
the workflow's parameters makes ticks refused ``invalid_input``, counted on the schedule).

``next_at`` is computed from now when a schedule is created, its cadence changes or it resumes:
ticks that fell while it was paused never fire.
"""

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Response
from pydantic import BaseModel, ConfigDict, Field

from moorline.api.deps import RUN_ID_PATTERN, CallerDep, ServicesDep, authenticate_tenant
from moorline.api.errors import BODY_ERRORS, responses
from moorline.api.guards import authenticated_by
from moorline.api.schemas import RequestBody, WorkflowName
from moorline.db.repos.schedules import NewSchedule, Schedule, SchedulesRepo
from moorline.dispatch.cron import MAX_EVERY_SECONDS, Cadence, CatchUp, parse_cadence
from moorline.errors import (
    InvalidInput,
    InvalidRequest,
    RateLimited,
    ScheduleNotFound,
    Unauthorized,
    WorkflowNotFound,
)
from moorline.types import JSONObject

CRON_PATTERN = r"^[0-9A-Za-z*/,#?\- ]+$"
"""The characters of a cron expression (numbers, names, ``* / , - # L ?``) and spaces."""
ZONE_PATTERN = r"^[A-Za-z][A-Za-z0-9_+\-/]*$"
"""An IANA time zone name (``Europe/Berlin``, ``Etc/GMT+1``)."""

Cron = Annotated[str, Field(min_length=1, max_length=200, pattern=CRON_PATTERN)]
EverySeconds = Annotated[int, Field(ge=1, le=MAX_EVERY_SECONDS)]
Zone = Annotated[str, Field(min_length=1, max_length=64, pattern=ZONE_PATTERN)]
CatchUpName = Literal["skip", "one"]


class ScheduleCreate(RequestBody):
    """A new schedule: a workflow, its input, and either ``cron`` or ``every_seconds``."""

    workflow: WorkflowName
    input: dict[str, Any] = Field(default_factory=dict, description="The workflow's arguments.")
    cron: Cron | None = Field(
        default=None, description="Five fields: minute hour day-of-month month day-of-week."
    )
    every_seconds: EverySeconds | None = Field(
        default=None, description="An interval instead of cron: ticks at multiples of it (UTC)."
    )
    timezone: Zone = Field(default="UTC", description="IANA time zone the cron is read in.")
    catch_up: CatchUpName = Field(
        default="skip", description="Ticks missed by more than the grace: none, or the latest."
    )
    paused: bool = False


class ScheduleEdit(RequestBody):
    """Fields to change; a new ``cron`` or ``every_seconds`` replaces the other."""

    workflow: WorkflowName | None = None
    input: dict[str, Any] | None = None
    cron: Cron | None = None
    every_seconds: EverySeconds | None = None
    timezone: Zone | None = None
    catch_up: CatchUpName | None = None
    paused: bool | None = None


class TickError(BaseModel):
    """The last tick admission refused."""

    code: str
    message: str
    tick: str


class ScheduleOut(BaseModel):
    """A schedule, with when it fires next and what its ticks did."""

    model_config = ConfigDict(frozen=True)

    schedule_id: str
    workflow: str
    input: dict[str, Any]
    cron: str | None
    every_seconds: int | None
    timezone: str
    catch_up: CatchUpName
    paused: bool
    next_at: datetime
    last_fired_at: datetime | None
    last_run_id: str | None
    last_error: TickError | None
    fired_count: int
    refused_count: int
    created_at: datetime
    updated_at: datetime


class ScheduleList(BaseModel):
    """The tenant's schedules, oldest first."""

    schedules: list[ScheduleOut]


def _out(schedule: Schedule) -> ScheduleOut:
    error = schedule.last_error
    return ScheduleOut(
        schedule_id=schedule.schedule_id,
        workflow=schedule.workflow,
        input=dict(schedule.input),
        cron=schedule.cron,
        every_seconds=schedule.every_s,
        timezone=schedule.timezone,
        catch_up="one" if schedule.catch_up == CatchUp.ONE else "skip",
        paused=schedule.paused,
        next_at=schedule.next_at,
        last_fired_at=schedule.last_fired_at,
        last_run_id=schedule.last_run_id,
        last_error=None if error is None else TickError.model_validate(error),
        fired_count=schedule.fired,
        refused_count=schedule.refused,
        created_at=schedule.created_at,
        updated_at=schedule.updated_at,
    )


def _checked_input(services: ServicesDep, workflow: str, data: dict[str, Any]) -> JSONObject:
    return services.workflows.get(workflow).validate_input(data)  # WorkflowNotFound, 422


async def _owned(services: ServicesDep, caller: CallerDep, schedule_id: str) -> Schedule:
    found = None
    if RUN_ID_PATTERN.match(schedule_id):
        found = await SchedulesRepo(services.db).get(schedule_id, tenant_id=caller.tenant.tenant_id)
    if found is None:
        # Another tenant's schedule is not found either (404, never 403).
        raise ScheduleNotFound(f"no schedule {schedule_id}")
    return found


async def create_schedule(
    body: ScheduleCreate, caller: CallerDep, services: ServicesDep
) -> ScheduleOut:
    """Store a schedule; its first tick is the cadence's first after now."""
    cadence = parse_cadence(body.cron, body.every_seconds, body.timezone)
    checked = _checked_input(services, body.workflow, body.input)
    created = await SchedulesRepo(services.db).create(
        NewSchedule(
            tenant_id=caller.tenant.tenant_id,
            workflow=body.workflow,
            input=checked,
            cron=cadence.cron,
            every_s=cadence.every_s,
            timezone=cadence.timezone,
            catch_up=body.catch_up,
            paused=body.paused,
            next_at=cadence.next_after(datetime.now(UTC)),
        )
    )
    return _out(created)


async def list_schedules(caller: CallerDep, services: ServicesDep) -> ScheduleList:
    """The tenant's schedules, oldest first."""
    found = await SchedulesRepo(services.db).list_for(caller.tenant.tenant_id)
    return ScheduleList(schedules=[_out(schedule) for schedule in found])


ScheduleIdPath = Annotated[str, Path(max_length=200)]


async def get_schedule(
    schedule_id: ScheduleIdPath, caller: CallerDep, services: ServicesDep
) -> ScheduleOut:
    """One of the tenant's schedules."""
    return _out(await _owned(services, caller, schedule_id))


async def edit_schedule(
    schedule_id: ScheduleIdPath, body: ScheduleEdit, caller: CallerDep, services: ServicesDep
) -> ScheduleOut:
    """Change a schedule; a new cadence, time zone or a resume moves ``next_at`` to after now."""
    current = await _owned(services, caller, schedule_id)
    given = body.model_fields_set
    values: dict[str, object] = {}
    for field in ("workflow", "input", "catch_up"):
        if field in given:
            value = getattr(body, field)
            if value is None:
                raise InvalidRequest(f"{field} cannot be null")
            values[field] = value
    if "workflow" in values or "input" in values:
        workflow = body.workflow or current.workflow
        data = body.input if body.input is not None else current.input
        values["input"] = _checked_input(services, workflow, dict(data))
    cadence = _edited_cadence(current, body, given)
    if cadence is not None:
        values.update(cron=cadence.cron, every_s=cadence.every_s, timezone=cadence.timezone)
    resuming = "paused" in given and body.paused is False and current.paused
    if "paused" in given:
        if body.paused is None:
            raise InvalidRequest("paused cannot be null")
        values["paused"] = body.paused
    if cadence is not None or resuming:
        timing = cadence or Cadence(
            cron=current.cron, every_s=current.every_s, timezone=current.timezone
        )
        values["next_at"] = timing.next_after(datetime.now(UTC))
    return await _update(services, caller, current, values)


def _edited_cadence(current: Schedule, body: ScheduleEdit, given: set[str]) -> Cadence | None:
    """The new timing when the edit touches it, checked; None when it does not."""
    if not given & {"cron", "every_seconds", "timezone"}:
        return None
    if given & {"cron", "every_seconds"}:
        cron, every_s = body.cron, body.every_seconds
    else:
        cron, every_s = current.cron, current.every_s
    zone = body.timezone if "timezone" in given else current.timezone
    return parse_cadence(cron, every_s, zone)


async def _update(
    services: ServicesDep, caller: CallerDep, current: Schedule, values: dict[str, object]
) -> ScheduleOut:
    if not values:
        return _out(current)
    updated = await SchedulesRepo(services.db).update(
        current.schedule_id, tenant_id=caller.tenant.tenant_id, values=values
    )
    if updated is None:  # deleted meanwhile
        raise ScheduleNotFound(f"no schedule {current.schedule_id}")
    return _out(updated)


async def pause_schedule(
    schedule_id: ScheduleIdPath, caller: CallerDep, services: ServicesDep
) -> ScheduleOut:
    """Stop a schedule's ticks until it resumes (``PATCH {"paused": true}``)."""
    current = await _owned(services, caller, schedule_id)
    if current.paused:
        return _out(current)
    return await _update(services, caller, current, {"paused": True})


async def resume_schedule(
    schedule_id: ScheduleIdPath, caller: CallerDep, services: ServicesDep
) -> ScheduleOut:
    """Fire a paused schedule again from its next tick after now; ticks while paused never do."""
    current = await _owned(services, caller, schedule_id)
    if not current.paused:
        return _out(current)
    timing = Cadence(cron=current.cron, every_s=current.every_s, timezone=current.timezone)
    values = {"paused": False, "next_at": timing.next_after(datetime.now(UTC))}
    return await _update(services, caller, current, values)


async def delete_schedule(
    schedule_id: ScheduleIdPath, caller: CallerDep, services: ServicesDep
) -> Response:
    """Delete a schedule; the runs it started are kept."""
    if not RUN_ID_PATTERN.match(schedule_id) or not await SchedulesRepo(services.db).delete(
        schedule_id, tenant_id=caller.tenant.tenant_id
    ):
        raise ScheduleNotFound(f"no schedule {schedule_id}")
    return Response(status_code=204)


def build_router() -> APIRouter:
    """A new router with the schedule routes."""
    router = APIRouter(
        prefix="/v1", tags=["schedules"], route_class=authenticated_by(authenticate_tenant)
    )
    found = (Unauthorized, RateLimited, InvalidRequest, ScheduleNotFound)
    checked = (*BODY_ERRORS, WorkflowNotFound, InvalidInput)
    router.add_api_route(
        "/schedules",
        create_schedule,
        methods=["POST"],
        status_code=201,
        responses=responses(Unauthorized, RateLimited, *checked),
        summary="Create a schedule",
    )
    router.add_api_route(
        "/schedules",
        list_schedules,
        methods=["GET"],
        responses=responses(Unauthorized, RateLimited),
        summary="The tenant's schedules",
    )
    router.add_api_route(
        "/schedules/{schedule_id}",
        get_schedule,
        methods=["GET"],
        responses=responses(*found),
        summary="A schedule",
    )
    router.add_api_route(
        "/schedules/{schedule_id}",
        edit_schedule,
        methods=["PATCH"],
        responses=responses(*found, *checked),
        summary="Change a schedule (pause, resume, cadence, input)",
    )
    router.add_api_route(
        "/schedules/{schedule_id}",
        delete_schedule,
        methods=["DELETE"],
        status_code=204,
        response_class=Response,
        responses=responses(*found),
        summary="Delete a schedule",
    )
    for action, handler in (("pause", pause_schedule), ("resume", resume_schedule)):
        router.add_api_route(
            f"/schedules/{{schedule_id}}/{action}",
            handler,
            methods=["POST"],
            responses=responses(*found),
            summary=f"{action.capitalize()} a schedule",
        )
    return router
