"""``moorline schedules …``: a tenant's schedules, create, list, pause, resume, delete.

Client commands like ``submit``: they speak only the HTTP API with the tenant's key
(``--api-key``, ``MOORLINE_API_KEY``), print for people or ``--json``, and fail with one line.
"""

from typing import Annotated

import typer
from rich.table import Table

from moorline.cli.client_commands import (
    DEFAULT_URL,
    ApiKey,
    AsJson,
    Url,
    print_json,
    read_input,
    stdout,
    synchronous,
)
from moorline.client import Client
from moorline.client.results import Schedule, Schedules

ScheduleArg = Annotated[str, typer.Argument(metavar="SCHEDULE_ID", help="The schedule's id.")]


def register(cli: typer.Typer) -> None:
    """Add the ``schedules`` group to the ``moorline`` command tree."""
    group = typer.Typer(
        help="Run a workflow on a cron schedule or every N seconds.",
        no_args_is_help=True,
        rich_markup_mode="markdown",
    )
    group.command("create")(schedules_create)
    group.command("list")(schedules_list)
    group.command("pause")(schedules_pause)
    group.command("resume")(schedules_resume)
    group.command("delete")(schedules_delete)
    cli.add_typer(group, name="schedules")


def _when(schedule: Schedule) -> str:
    if schedule.cron is not None:
        return f"{schedule.cron} ({schedule.timezone})"
    return f"every {schedule.every_seconds}s"


def _show(schedule: Schedule, as_json: bool) -> None:
    if as_json:
        print_json(schedule)
        return
    state = "paused" if schedule.paused else f"next {schedule.next_at:%Y-%m-%d %H:%M:%S}Z"
    stdout().print(
        f"schedule {schedule.schedule_id}: {schedule.workflow} {_when(schedule)}, {state}"
    )


@synchronous
async def schedules_create(
    workflow: Annotated[str, typer.Argument(help="The workflow to run at each tick.")],
    cron: Annotated[
        str | None,
        typer.Option("--cron", help="Five cron fields, e.g. '0 3 * * *' (or --every)."),
    ] = None,
    every: Annotated[
        int | None,
        typer.Option("--every", min=1, metavar="SECONDS", help="An interval instead of cron."),
    ] = None,
    timezone: Annotated[
        str, typer.Option("--timezone", help="IANA time zone the cron is read in.")
    ] = "UTC",
    catch_up: Annotated[
        str,
        typer.Option(
            "--catch-up", help="Ticks missed while nothing ran: 'skip' them, or run 'one'."
        ),
    ] = "skip",
    input: Annotated[
        str,
        typer.Option(
            "--input", metavar="JSON|@FILE", help="The workflow's arguments as a JSON object."
        ),
    ] = "{}",
    paused: Annotated[bool, typer.Option("--paused", help="Create it paused.")] = False,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
    as_json: AsJson = False,
) -> None:
    """Create a schedule: WORKFLOW with --input at every tick of --cron or --every."""
    arguments = read_input(input)
    async with Client(url, api_key) as client:
        created = await client.create_schedule(
            workflow,
            arguments,
            cron=cron,
            every_seconds=every,
            timezone=timezone,
            catch_up=catch_up,
            paused=paused,
        )
    _show(created, as_json)


@synchronous
async def schedules_list(
    url: Url = DEFAULT_URL, api_key: ApiKey = None, as_json: AsJson = False
) -> None:
    """List your schedules: when each fires, its next tick, and how its ticks went."""
    async with Client(url, api_key) as client:
        found = await client.list_schedules()
    if as_json:
        print_json(Schedules(schedules=found))
        return
    table = Table("schedule", "workflow", "when", "next", "fired", "refused", "last error")
    for schedule in found:
        error = schedule.last_error
        table.add_row(
            schedule.schedule_id,
            schedule.workflow,
            _when(schedule),
            "paused" if schedule.paused else f"{schedule.next_at:%Y-%m-%d %H:%M:%S}Z",
            str(schedule.fired_count),
            str(schedule.refused_count),
            "" if error is None else f"{error.code} at {error.tick}",
        )
    stdout().print(table)


@synchronous
async def schedules_pause(
    schedule_id: ScheduleArg,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
    as_json: AsJson = False,
) -> None:
    """Pause a schedule: no tick fires until it is resumed."""
    async with Client(url, api_key) as client:
        _show(await client.pause_schedule(schedule_id), as_json)


@synchronous
async def schedules_resume(
    schedule_id: ScheduleArg,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
    as_json: AsJson = False,
) -> None:
    """Resume a schedule from its next tick after now (ticks while paused never fire)."""
    async with Client(url, api_key) as client:
        _show(await client.resume_schedule(schedule_id), as_json)


@synchronous
async def schedules_delete(
    schedule_id: ScheduleArg, url: Url = DEFAULT_URL, api_key: ApiKey = None
) -> None:
    """Delete a schedule; the runs it started are kept."""
    async with Client(url, api_key) as client:
        await client.delete_schedule(schedule_id)
    stdout().print(f"schedule {schedule_id} deleted")
