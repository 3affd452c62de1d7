"""``moorline tenants …`` and ``moorline webhooks …``: tenants, their plans and keys, webhooks.

``tenants`` commands are the operator's (``--admin-token``, ``MOORLINE_ADMIN_TOKEN``): create,
list, change a plan, list a tenant's keys, issue another key, revoke one. ``webhooks`` commands
are a tenant's (``--api-key``): list and delete its webhooks. Like the other client commands
they speak only the HTTP API, print for people or ``--json``, and fail with one line.
"""

from typing import Annotated

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
from moorline.client.results import ApiKeys, TenantLoad, TenantPage, Webhooks

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
