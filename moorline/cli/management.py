"""``moorline tenants …``, ``moorline workers`` and ``moorline webhooks …``.

``tenants`` commands are the operator's (``--admin-token``, ``MOORLINE_ADMIN_TOKEN``): create,
list, change a plan, list a tenant's keys, issue another key, revoke one. ``workers`` is the
operator's too: every worker process, live or dead, with its lanes and the runs it holds, or
one worker's held runs. ``webhooks`` commands
are a tenant's (``--api-key``): list and delete its webhooks. Like the other client commands
they speak only the HTTP API, print for people or ``--json``, and fail with one line.
"""

from typing import Annotated, Literal

import typer
from rich.table import Table

from moorline.cli.client_commands import (
    DEFAULT_URL,
    AdminToken,
    ApiKey,
    AsJson,
    Url,
    print_json,
    stdout,
    synchronous,
    tenants_create,
)
from moorline.client import Client
from moorline.client.results import (
    ApiKeys,
    TenantLoad,
    TenantPage,
    Webhooks,
    Worker,
    WorkerDetail,
    Workers,
)

TenantArg = Annotated[str, typer.Argument(metavar="TENANT_ID", help="The tenant's id.")]


def register(cli: typer.Typer) -> None:
    """Add the ``tenants`` and ``webhooks`` groups to the ``moorline`` command tree."""
    tenants = typer.Typer(
        help="Manage tenants, their plans and API keys (admin).",
        no_args_is_help=True,
        rich_markup_mode="markdown",
    )
    tenants.command("create")(tenants_create)
    tenants.command("list")(tenants_list)
    tenants.command("plan")(tenants_plan)
    tenants.command("keys")(tenants_keys)
    tenants.command("issue-key")(tenants_issue_key)
    tenants.command("revoke-key")(tenants_revoke_key)
    cli.add_typer(tenants, name="tenants")
    cli.command("workers")(workers_list)
    webhooks = typer.Typer(
        help="List and delete your webhooks.", no_args_is_help=True, rich_markup_mode="markdown"
    )
    webhooks.command("list")(webhooks_list)
    webhooks.command("delete")(webhooks_delete)
    cli.add_typer(webhooks, name="webhooks")


@synchronous
async def tenants_list(
    url: Url = DEFAULT_URL, admin_token: AdminToken = None, as_json: AsJson = False
) -> None:
    """List every tenant with its plan, today's quota use and running runs."""
    async with Client(url, admin_token=admin_token) as client:
        rows: list[TenantLoad] = []
        cursor: str | None = None
        while True:
            page = await client.list_tenants(cursor=cursor)
            rows += page.tenants
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
    if as_json:
        print_json(TenantPage(tenants=rows, next_cursor=None))
        return
    table = Table("tenant", "name", "plan", "lane", "used today", "running")
    for row in rows:
        table.add_row(
            row.tenant_id,
            row.name,
            row.plan,
            row.lane,
            f"{row.used_today}/{row.daily_quota}",
            f"{row.running}/{row.tenant_concurrency}",
        )
    stdout().print(table)


@synchronous
async def tenants_plan(
    tenant_id: TenantArg,
    plan: Annotated[str, typer.Argument(help="The new plan.")],
    url: Url = DEFAULT_URL,
    admin_token: AdminToken = None,
    as_json: AsJson = False,
) -> None:
    """Move a tenant to another plan; its next trigger is admitted under it."""
    async with Client(url, admin_token=admin_token) as client:
        tenant = await client.change_plan(tenant_id, plan)
    if as_json:
        print_json(tenant)
        return
    stdout().print(f"tenant {tenant.tenant_id} ({tenant.name}) is on plan {tenant.plan}")


@synchronous
async def tenants_keys(
    tenant_id: TenantArg,
    url: Url = DEFAULT_URL,
    admin_token: AdminToken = None,
    as_json: AsJson = False,
) -> None:
    """List a tenant's API keys (ids and first characters; never the keys)."""
    async with Client(url, admin_token=admin_token) as client:
        keys = await client.list_keys(tenant_id)
    if as_json:
        print_json(ApiKeys(keys=keys))
        return
    table = Table("key id", "starts with", "created", "revoked")
    for key in keys:
        revoked = "-" if key.revoked_at is None else key.revoked_at.isoformat()
        table.add_row(key.key_id, key.prefix, key.created_at.isoformat(), revoked)
    stdout().print(table)


@synchronous
async def tenants_issue_key(
    tenant_id: TenantArg,
    url: Url = DEFAULT_URL,
    admin_token: AdminToken = None,
    as_json: AsJson = False,
) -> None:
    """Issue another API key for a tenant (to rotate: issue, switch clients, revoke the old)."""
    async with Client(url, admin_token=admin_token) as client:
        issued = await client.issue_key(tenant_id)
    if as_json:
        print_json(issued)
        return
    console = stdout()
    console.print(f"key {issued.key_id} of tenant {tenant_id}")
    console.print(f"API key (shown once, store it now): {issued.api_key}")


@synchronous
async def tenants_revoke_key(
    tenant_id: TenantArg,
    key_id: Annotated[str, typer.Argument(metavar="KEY_ID", help="From `moorline tenants keys`.")],
    url: Url = DEFAULT_URL,
    admin_token: AdminToken = None,
) -> None:
    """Revoke an API key: every API process refuses it within 5 seconds."""
    async with Client(url, admin_token=admin_token) as client:
        await client.revoke_key(tenant_id, key_id)
    stdout().print(f"key {key_id} of tenant {tenant_id} revoked")


@synchronous
async def workers_list(
    worker_id: Annotated[
        str | None,
        typer.Argument(
            metavar="[WORKER_ID]",
            help="Show this worker and every run it holds.",
            show_default=False,
        ),
    ] = None,
    status: Annotated[
        Literal["live", "dead"] | None,
        typer.Option(help="Only the live, or only the dead, workers.", show_default=False),
    ] = None,
    url: Url = DEFAULT_URL,
    admin_token: AdminToken = None,
    as_json: AsJson = False,
) -> None:
    """List the worker processes with their lanes and the runs they hold (admin).

    A worker is dead when it sent no heartbeat for one lease TTL (killed, partitioned); one
    that stops cleanly leaves the list. With a WORKER_ID: that worker and every run it holds.
    """
    async with Client(url, admin_token=admin_token) as client:
        if worker_id is not None:
            detail = await client.worker(worker_id)
        else:
            rows = await client.workers(status=status)
    if worker_id is not None:
        if as_json:
            print_json(detail)
            return
        print_worker(detail)
        return
    if as_json:
        print_json(Workers(workers=rows))
        return
    stdout().print(workers_table(rows))


def workers_table(rows: list[Worker]) -> Table:
    """One line per worker; ids are never cut (``moorline workers WORKER_ID`` needs them)."""
    table = Table(box=None)
    width = max((len(row.worker_id) for row in rows), default=6)
    table.add_column("worker", no_wrap=True, min_width=width)
    for name in ("status", "host", "pid", "version", "lanes", "workflows", "runs", "last seen"):
        table.add_column(name, no_wrap=name != "workflows")
    for row in rows:
        lanes = ", ".join(f"{lane}={slots}" for lane, slots in sorted(row.lanes.items()))
        workflows = "all" if row.workflows is None else ", ".join(row.workflows)
        table.add_row(
            row.worker_id,
            row.status,
            row.host,
            str(row.pid),
            row.version or "-",
            lanes,
            workflows,
            str(row.runs),
            f"{row.last_seen_age_s:.1f}s ago",
        )
    return table


def print_worker(detail: WorkerDetail) -> None:
    """A worker's facts, then one line per run it holds."""
    console = stdout()
    lanes = ", ".join(f"{lane}={slots}" for lane, slots in sorted(detail.lanes.items()))
    console.print(
        f"worker {detail.worker_id} ({detail.status}) on {detail.host} pid {detail.pid}, "
        f"version {detail.version or '-'}; lanes {lanes}; "
        f"last seen {detail.last_seen_age_s:.1f}s ago; holds {detail.runs} runs"
    )
    if not detail.held:
        return
    table = Table(box=None)
    table.add_column("run", no_wrap=True, min_width=max(len(run.run_id) for run in detail.held))
    for name in ("workflow", "lane", "tenant", "attempt", "lease expires"):
        table.add_column(name, no_wrap=True)
    for run in detail.held:
        expires = "-" if run.lease_expires_at is None else run.lease_expires_at.isoformat()
        table.add_row(run.run_id, run.workflow, run.queue, run.tenant_id, str(run.attempt), expires)
    console.print(table)


@synchronous
async def webhooks_list(
    url: Url = DEFAULT_URL, api_key: ApiKey = None, as_json: AsJson = False
) -> None:
    """List your webhooks: id, workflow and the URL to deliver to."""
    async with Client(url, api_key) as client:
        hooks = await client.list_webhooks()
    if as_json:
        print_json(Webhooks(webhooks=hooks))
        return
    table = Table("webhook", "workflow", "url")
    for hook in hooks:
        table.add_row(hook.webhook_id, hook.workflow, hook.url)
    stdout().print(table)


@synchronous
async def webhooks_delete(
    webhook_id: Annotated[str, typer.Argument(metavar="WEBHOOK_ID", help="The webhook's id.")],
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
) -> None:
    """Delete a webhook: deliveries to it are refused from then on."""
    async with Client(url, api_key) as client:
        await client.delete_webhook(webhook_id)
    stdout().print(f"webhook {webhook_id} deleted")
