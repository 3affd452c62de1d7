"""The client commands of the ``moorline`` CLI: they talk to a server through ``moorline.Client``.

``tenants create``, ``submit``, ``status``, ``cancel``, ``approve``, ``deny``, ``inject`` and
``runs`` reach the server at ``--url`` (``MOORLINE_URL``) with ``--api-key`` / ``--key``
(``MOORLINE_API_KEY``); ``tenants create`` takes ``--admin-token`` (``MOORLINE_ADMIN_TOKEN``)
instead. Each prints for people by default and JSON with ``--json``, for scripts.

Errors (the server's, or a bad ``--input``) are one line on stderr, ``error: <code>:
<message>``, and exit status 1. ``submit --follow`` exits 2 when the run ended other than
``succeeded``, so a script can tell a failed run from a failed command.
"""

import asyncio
import json
from collections import Counter
from collections.abc import Callable, Coroutine
from functools import wraps
from pathlib import Path
from typing import Annotated, Any, ParamSpec, TypeVar

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table
from rich.text import Text

from moorline.cli.run_filters import CreatedAfter, CreatedBefore, Ids, aware
from moorline.client import Client, Event, Run, RunSummary
from moorline.errors import InvalidInput, MoorlineError
from moorline.types import JSONObject, JSONValue, RunStatus

DEFAULT_URL = "http://127.0.0.1:8000"
EXIT_ERROR = 1
EXIT_RUN_NOT_SUCCEEDED = 2
PIPE_WIDTH = 400
"""Columns a table may use when stdout is not a terminal."""

P = ParamSpec("P")
T = TypeVar("T")

Url = Annotated[
    str,
    typer.Option("--url", envvar="MOORLINE_URL", help="The Moorline server's base URL."),
]
ApiKey = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        "--key",
        envvar="MOORLINE_API_KEY",
        help="The tenant's API key (prefer the environment variable: a command line is "
        "visible to other users of the machine).",
        show_default=False,
    ),
]
AdminToken = Annotated[
    str | None,
    typer.Option(
        "--admin-token",
        envvar="MOORLINE_ADMIN_TOKEN",
        help="The server's admin token.",
        show_default=False,
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
RunIdArg = Annotated[str, typer.Argument(metavar="RUN_ID", help="The run's id.")]


def register(cli: typer.Typer) -> None:
    """Add the client commands to the ``moorline`` command tree."""
    # ``tenants create`` lives here with the other client commands; its group, with the rest
    # of tenant and key management, is moorline.cli.management's.
    for name, command in (
        ("submit", submit),
        ("status", status),
        ("cancel", cancel),
        ("approve", approve),
        ("deny", deny),
        ("inject", inject),
        ("runs", runs),
    ):
        cli.command(name)(command)


def synchronous(command: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, T]:
    """Run an async command with ``asyncio.run``, and print a Moorline error as one line."""

    @wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return asyncio.run(command(*args, **kwargs))
        except MoorlineError as exc:
            print_error(exc)
            raise typer.Exit(EXIT_ERROR) from None

    return run


def print_error(exc: MoorlineError) -> None:
    """``error: <code>: <message>``, one line on stderr."""
    console = Console(stderr=True, soft_wrap=True, highlight=False)
    message = " ".join(exc.message.split())
    console.print(Text.assemble(("error: ", "bold red"), f"{exc.code}: {message}"))


def stdout() -> Console:
    """The console of a command's output."""
    # soft_wrap: long ids and JSON stay on one line whatever the terminal width. Into a pipe,
    # Rich would assume 80 columns and cut table cells; a script reads whole lines.
    console = Console(soft_wrap=True, highlight=False)
    if not console.is_terminal:
        console.width = PIPE_WIDTH
    return console


def print_json(value: BaseModel | list[BaseModel] | JSONObject) -> None:
    """``value`` as JSON on stdout (plain ``print``: no Rich markup may touch it)."""
    if isinstance(value, BaseModel):
        print(value.model_dump_json())
    elif isinstance(value, list):
        print(json.dumps([item.model_dump(mode="json") for item in value]))
    else:
        print(json.dumps(value))


# --- tenants ----------------------------------------------------------------------------------


@synchronous
async def tenants_create(
    name: Annotated[str, typer.Argument(help="The tenant's name (unique).")],
    plan: Annotated[
        str, typer.Option("--plan", help="professional, team, sandbox or a plans-file plan.")
    ],
    url: Url = DEFAULT_URL,
    admin_token: AdminToken = None,
    as_json: AsJson = False,
) -> None:
    """Create a tenant and print its API key, shown this once."""
    async with Client(url, admin_token=admin_token) as client:
        tenant = await client.create_tenant(name, plan)
    if as_json:
        print_json(tenant)
        return
    console = stdout()
    console.print(f"tenant {tenant.tenant_id} ({tenant.name}, plan {tenant.plan})")
    console.print(f"API key (shown once, store it now): {tenant.api_key}")
    console.print(f"  export MOORLINE_API_KEY={tenant.api_key}")


# --- runs -------------------------------------------------------------------------------------


def read_input(text: str) -> JSONObject:
    """The ``--input`` object: JSON, or ``@path`` of a file holding JSON.

    Raises:
        InvalidInput: Not a readable file, not JSON, or not a JSON object.
    """
    source = "--input"
    if text.startswith("@"):
        path = Path(text[1:])
        source = f"--input file {path}"
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise InvalidInput(f"{source}: cannot read it ({exc.strerror})") from None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidInput(f"{source}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise InvalidInput(f"{source}: must be a JSON object of the workflow's arguments")
    return value


@synchronous
async def submit(
    workflow: Annotated[str, typer.Argument(help="The workflow to run.")],
    input: Annotated[
        str,
        typer.Option(
            "--input", metavar="JSON|@FILE", help="The workflow's arguments as a JSON object."
        ),
    ] = "{}",
    idempotency_key: Annotated[
        str | None,
        typer.Option(
            help="The same key and input again returns the first run.", show_default=False
        ),
    ] = None,
    conversation: Annotated[
        str | None,
        typer.Option(help="The conversation id (one active run each).", show_default=False),
    ] = None,
    delay: Annotated[
        float | None,
        typer.Option(min=0, help="Seconds before the run may start.", show_default=False),
    ] = None,
    follow: Annotated[
        bool, typer.Option("--follow", help="Stream the run's events until it ends.")
    ] = False,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
    as_json: AsJson = False,
) -> None:
    """Start a run; with `--follow`, stream its events and end with its output.

    With `--follow` the exit status is 2 when the run failed, was cancelled or timed out.
    """
    arguments = read_input(input)
    async with Client(url, api_key) as client:
        accepted = await client.trigger(
            workflow,
            arguments,
            idempotency_key=idempotency_key,
            conversation_id=conversation,
            delay_seconds=delay,
        )
        if not follow:
            if as_json:
                print_json(accepted)
            else:
                stdout().print(f"run {accepted.run_id} {accepted.status} (queue {accepted.queue})")
            return
        if not as_json:
            stdout().print(f"run {accepted.run_id} {accepted.status}", style="dim")
        run = await follow_run(client, accepted.run_id, as_json=as_json)
    if as_json:
        print_json(run)
    else:
        print_outcome(run)
    if run.status != RunStatus.SUCCEEDED:
        raise typer.Exit(EXIT_RUN_NOT_SUCCEEDED)


async def follow_run(client: Client, run_id: str, *, as_json: bool) -> Run:
    """Print the run's events until its end; the finished run.

    For people: ``delta`` texts as they stream, other events as dim lines, under a live
    status line naming the run's latest state. For scripts: one JSON object per event.
    """
    if as_json:
        async for event in client.events(run_id):
            print(json.dumps({"seq": event.seq, "type": event.type, "data": event.data}))
        return await client.get_run(run_id)
    console = stdout()
    in_text = False
    with console.status(f"run {run_id}: waiting for events") as live:
        async for event in client.events(run_id):
            text = delta_text(event)
            if text is not None:
                console.print(text, end="", markup=False)
                in_text = True
                continue
            if in_text:
                console.print()
                in_text = False
            console.print(describe(event), style="dim", markup=False)
            live.update(f"run {run_id}: {event.type}")
            if event.type == "permission_request" and isinstance(event.data, dict):
                # The run waits for someone: say who can unblock it, and how.
                command = f"{run_id} --interrupt {event.data.get('interrupt_id')}"
                console.print(
                    f"waiting for a decision on {event.data.get('action')!r}: "
                    f"moorline approve {command} (or deny)",
                    markup=False,
                )
    if in_text:
        console.print()
    return await client.get_run(run_id)


def delta_text(event: Event) -> str | None:
    """The text of a ``delta`` event, or None for any other event."""
    if event.type != "delta" or not isinstance(event.data, dict):
        return None
    text = event.data.get("text")
    return text if isinstance(text, str) else None


def describe(event: Event) -> str:
    """One line for an event: its type and its data as compact JSON.

    A failure's traceback is left out: the outcome printed at the end shows it as lines.
    """
    shown = event.data
    if isinstance(shown, dict):
        shown, _ = split_traceback(shown)
        if isinstance(shown, dict) and isinstance(shown.get("error"), dict):
            shown = {**shown, "error": split_traceback(shown["error"])[0]}
    data = "" if shown in ({}, None) else " " + json.dumps(shown, separators=(",", ":"))
    return f"[{event.seq}] {event.type}{data}"


def print_outcome(run: Run) -> None:
    """The run's final status, then its output (or its error, and its traceback as lines)."""
    console = stdout()
    style = "green" if run.status == RunStatus.SUCCEEDED else "red"
    console.print(f"run {run.run_id} {run.status}", style=f"bold {style}")
    if run.status == RunStatus.SUCCEEDED:
        shown, trace = run.output, None
    else:
        shown, trace = split_traceback(run.error)
    if shown is not None:
        print(json.dumps(shown, indent=2, ensure_ascii=False))
    if trace is not None:
        console.print(Text(trace.rstrip("\n")))


def split_traceback(error: JSONValue) -> tuple[JSONValue, str | None]:
    """A failed run's error without its ``traceback``, and the traceback apart.

    Inside the JSON the traceback would be one long line of escaped newlines; it is printed
    below the error as it was written, one frame a line.
    """
    if not isinstance(error, dict) or not isinstance(error.get("traceback"), str):
        return error, None
    rest = {name: value for name, value in error.items() if name != "traceback"}
    return rest, str(error["traceback"])


@synchronous
async def status(
    run_id: RunIdArg, url: Url = DEFAULT_URL, api_key: ApiKey = None, as_json: AsJson = False
) -> None:
    """Show a run: its status, steps, output or error, and the decision it waits for."""
    async with Client(url, api_key) as client:
        run = await client.get_run(run_id)
    if as_json:
        print_json(run)
        return
    table = Table.grid(padding=(0, 2))
    for field, value in (
        ("run", run.run_id),
        ("workflow", run.workflow),
        ("status", str(run.status)),
        ("queue", run.queue),
        ("attempt", str(run.attempt)),
        ("conversation", run.conversation_id or "-"),
        ("created", run.created_at.isoformat()),
        ("elapsed", "-" if run.elapsed_time is None else f"{run.elapsed_time:.3f}s"),
        ("steps", describe_steps(run)),
    ):
        table.add_row(Text(field, style="bold"), Text(value))
    if run.parent_run_id is not None:
        table.add_row(Text("parent", style="bold"), Text(run.parent_run_id))
    if run.children:
        counts = Counter(str(child.status) for child in run.children)
        shown = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
        table.add_row(Text("children", style="bold"), Text(f"{len(run.children)}: {shown}"))
    if run.waiting_for is not None:
        waiting = run.waiting_for
        until = "no time limit" if waiting.until is None else f"until {waiting.until.isoformat()}"
        kind = waiting.kind if waiting.model is None else f"{waiting.kind} of {waiting.model}"
        table.add_row(Text("parked", style="bold"), Text(f"{kind}, {until}"))
    if run.pending_interrupt is not None:
        pending = run.pending_interrupt
        asked = f"{pending.action} {json.dumps(pending.data)} (id {pending.interrupt_id})"
        table.add_row(Text("waits for", style="bold"), Text(asked))
    if run.output is not None:
        table.add_row(Text("output", style="bold"), Text(json.dumps(run.output)))
    trace = None
    if run.error is not None:
        error, trace = split_traceback(run.error)
        table.add_row(Text("error", style="bold"), Text(json.dumps(error)))
    console = stdout()
    console.print(table)
    if trace is not None:
        console.print(Text(trace.rstrip("\n")))


def describe_steps(run: Run) -> str:
    """How many steps the run checkpointed, and its latest (a chat run has hundreds)."""
    if not run.steps:
        return "-"
    last = run.steps[-1]
    return f"{len(run.steps)}, latest {last.key} ({last.status})"


@synchronous
async def cancel(
    run_id: RunIdArg, url: Url = DEFAULT_URL, api_key: ApiKey = None, as_json: AsJson = False
) -> None:
    """Cancel a run: a queued one ends at once, a running one at its next check."""
    async with Client(url, api_key) as client:
        result = await client.cancel(run_id)
    if as_json:
        print_json(result)
    else:
        stdout().print(f"run {result.run_id}: cancel recorded, status {result.status}")


InterruptOption = Annotated[
    str | None,
    typer.Option(
        "--interrupt",
        help="The interrupt to decide (default: the oldest pending one).",
        show_default=False,
    ),
]


async def decide(
    run_id: str, approved: bool, interrupt: str | None, url: str, api_key: str | None, as_json: bool
) -> None:
    """Approve or deny the run's pending interrupt and say so."""
    async with Client(url, api_key) as client:
        result = await client.resume(run_id, approved=approved, interrupt_id=interrupt)
    if as_json:
        print_json(result)
    else:
        verdict = "approved" if approved else "denied"
        stdout().print(f"run {result.run_id}: interrupt {result.interrupt_id} {verdict}")


@synchronous
async def approve(
    run_id: RunIdArg,
    interrupt: InterruptOption = None,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
    as_json: AsJson = False,
) -> None:
    """Approve the permission a paused run asks for."""
    await decide(run_id, True, interrupt, url, api_key, as_json)


@synchronous
async def deny(
    run_id: RunIdArg,
    interrupt: InterruptOption = None,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
    as_json: AsJson = False,
) -> None:
    """Deny the permission a paused run asks for."""
    await decide(run_id, False, interrupt, url, api_key, as_json)


@synchronous
async def inject(
    run_id: RunIdArg,
    text: Annotated[str, typer.Argument(help="The message for the run's workflow.")],
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
    as_json: AsJson = False,
) -> None:
    """Send a message to a running run (a chat run drains it at its next turn)."""
    async with Client(url, api_key) as client:
        result = await client.post_message(run_id, text)
    if as_json:
        print_json(result)
    else:
        stdout().print(f"run {result.run_id}: message {result.seq} queued")


@synchronous
async def runs(
    status: Annotated[
        RunStatus | None, typer.Option(help="Only runs in this status.", show_default=False)
    ] = None,
    workflow: Annotated[
        str | None, typer.Option(help="Only runs of this workflow.", show_default=False)
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=200, help="At most this many runs.")] = 20,
    created_after: CreatedAfter = None,
    created_before: CreatedBefore = None,
    ids: Ids = None,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
    as_json: AsJson = False,
) -> None:
    """List the tenant's runs, newest first."""
    async with Client(url, api_key) as client:
        page = await client.list_runs(
            status=status,
            workflow=workflow,
            created_after=aware(created_after),
            created_before=aware(created_before),
            ids=ids or None,
            limit=limit,
        )
    if as_json:
        print_json(page)
        return
    stdout().print(runs_table(page.runs))


def runs_table(rows: list[RunSummary]) -> Table:
    """One line per run; ids are never cut (they are what the next command needs)."""
    table = Table(box=None)
    table.add_column("run", no_wrap=True, min_width=max((len(r.run_id) for r in rows), default=3))
    for name in ("workflow", "status", "created", "elapsed"):
        table.add_column(name, no_wrap=True)
    for run in rows:
        elapsed = "-" if run.elapsed_time is None else f"{run.elapsed_time:.2f}s"
        created = run.created_at.strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(run.run_id, run.workflow, str(run.status), created, elapsed)
    return table
