"""``moorline workflows``: the catalogue of a running server (``GET /v1/workflows``).

What a deployment serves, with the JSON Schema of each input; ``serve`` and ``worker`` print
their own app's list at start (``moorline.cli.banner.workflow_lines``). A client command: it
imports no engine or database module (``tests/unit/test_cli_imports.py``).
"""

import json

import typer
from rich.table import Table

from moorline.cli.client_commands import (
    DEFAULT_URL,
    ApiKey,
    AsJson,
    Url,
    print_json,
    stdout,
    synchronous,
)
from moorline.client import Client
from moorline.client.results import WorkflowInfo, Workflows


def register(cli: typer.Typer) -> None:
    """Add ``workflows`` to the ``moorline`` command tree."""
    cli.command("workflows")(workflows)


@synchronous
async def workflows(
    url: Url = DEFAULT_URL, api_key: ApiKey = None, as_json: AsJson = False
) -> None:
    """List the workflows the server runs: parameters, limits, and the lane of your runs."""
    async with Client(url, api_key) as client:
        listed = await client.workflows()
    if as_json:
        print_json(Workflows(workflows=listed))
        return
    stdout().print(workflows_table(listed))


def workflows_table(listed: list[WorkflowInfo]) -> Table:
    """One row per workflow: name, parameters (name: JSON type), limits, lane."""
    table = Table("workflow", "parameters", "max attempts", "timeout", "lane")
    for item in listed:
        table.add_row(
            item.name,
            _parameters(item.parameters),
            str(item.limits.max_attempts),
            "-" if item.limits.timeout_s is None else f"{item.limits.timeout_s:g}s",
            item.lane,
        )
    return table


def _parameters(schema: dict[str, object]) -> str:
    properties = schema.get("properties")
    if not isinstance(properties, dict):
        return ""
    required = schema.get("required")
    needed = set(required) if isinstance(required, list) else set()
    shown = []
    for name, spec in properties.items():
        kind = spec.get("type", "any") if isinstance(spec, dict) else "any"
        optional = "" if name in needed else "?"
        shown.append(f"{name}{optional}: {kind if isinstance(kind, str) else json.dumps(kind)}")
    return ", ".join(shown)
