"""``moorline submit-many``: start many runs from JSON lines, through the batch trigger.

Each non-blank line of the file (or of stdin, for ``-``) is one item: a trigger's body,
``{"input": {...}, "idempotency_key"?, "conversation_id"?, "delay_seconds"?}``, or with
``--inputs`` the workflow's input object itself. Every line is read and checked before anything
is sent, so a malformed line is one error line and no run. The items then go
:data:`~moorline.client.calls.MAX_BATCH` a request (``POST /v1/workflows/{workflow}/runs/batch``)
under a progress bar on stderr; each item is admitted on its own (docs/api.md).

The output is a summary line, or with ``--json`` each item's answer as a JSON line, in the
order of the input. Items refused one by one (a quota, a conflict, a bad input) make the exit
status 1, with one line on stderr naming how many and the first.
"""

import json
import sys
from pathlib import Path
from typing import Annotated, Any, TextIO

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from moorline.cli.client_commands import (
    DEFAULT_URL,
    EXIT_ERROR,
    ApiKey,
    AsJson,
    Url,
    print_error,
    stdout,
    synchronous,
)
from moorline.client import BatchItem, Client
from moorline.client.calls import MAX_BATCH, batch_item, chunks
from moorline.errors import InvalidInput, MoorlineError


def register(cli: typer.Typer) -> None:
    """Add ``submit-many`` to the ``moorline`` command tree."""
    cli.command("submit-many")(submit_many)


def read_items(source: TextIO, name: str, *, inputs: bool) -> list[dict[str, Any]]:
    """The items of a JSON-lines ``source``, each checked as a batch item.

    Raises:
        InvalidInput: naming the first bad line: not JSON, not an object, an unknown field.
    """
    items: list[dict[str, Any]] = []
    for number, line in enumerate(source, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as exc:
            raise InvalidInput(f"{name} line {number}: not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise InvalidInput(f"{name} line {number}: must be a JSON object")
        try:
            items.append(batch_item({"input": value} if inputs else value))
        except InvalidInput as exc:
            raise InvalidInput(f"{name} line {number}: {exc.message}") from None
    return items


def _read(file: str, *, inputs: bool) -> list[dict[str, Any]]:
    if file == "-":
        return read_items(sys.stdin, "stdin", inputs=inputs)
    path = Path(file)
    try:
        with path.open(encoding="utf-8") as source:
            return read_items(source, str(path), inputs=inputs)
    except OSError as exc:
        raise InvalidInput(f"{path}: cannot read it ({exc.strerror})") from None


@synchronous
async def submit_many(
    workflow: Annotated[str, typer.Argument(help="The workflow to run.")],
    file: Annotated[
        str,
        typer.Argument(metavar="FILE", help="JSON lines, one run each; `-` for stdin."),
    ] = "-",
    inputs: Annotated[
        bool,
        typer.Option(
            "--inputs",
            help="Each line is the workflow's input, not a trigger body with an `input`.",
        ),
    ] = False,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
    as_json: AsJson = False,
) -> None:
    """Start one run per JSON line, 1,000 a request, each admitted on its own.

    A line is a trigger's body (`{"input": {...}, "idempotency_key": ...}`), or with
    `--inputs` the input itself. Exits 1 when any item was refused.
    """
    items = _read(file, inputs=inputs)
    answers: list[BatchItem] = []
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    async with Client(url, api_key) as client:
        with progress:
            task = progress.add_task(f"submitting to {workflow}", total=len(items))
            for chunk in chunks(items, MAX_BATCH):
                answers += await client.trigger_many(workflow, chunk)
                progress.advance(task, len(chunk))
    if as_json:
        for answer in answers:
            print(answer.model_dump_json())
    refused = [(index, a) for index, a in enumerate(answers) if a.error is not None]
    created = sum(a.status_code == 202 for a in answers)
    if not as_json:
        stdout().print(
            f"{len(answers)} items: {created} new runs, "
            f"{len(answers) - created - len(refused)} earlier runs, {len(refused)} refused"
        )
    if refused:
        index, first = refused[0]
        error = first.error or {}
        print_error(
            MoorlineError(
                f"{len(refused)} of {len(answers)} items refused; the first, item {index + 1}: "
                f"{error.get('code')}: {error.get('message')}"
            )
        )
        raise typer.Exit(EXIT_ERROR)
