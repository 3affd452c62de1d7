"""``moorline retry``, ``moorline rerun`` and ``moorline bulk cancel|retry|status``.

Client commands like those of :mod:`moorline.cli.client_commands` (same options, same one-line
errors). With ``--admin-token`` they use the admin routes (any tenant's runs) instead of the
tenant's key.

``bulk cancel`` and ``bulk retry`` start a job and follow it with a progress bar until every
run has its outcome (``--no-wait`` prints the job and returns). Each invocation sends one
idempotency key (``--idempotency-key``, else a fresh one): run again with the same key, a
command whose answer was lost finds the job its first request started instead of a second.
"""

import asyncio
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from moorline.cli.client_commands import (
    DEFAULT_URL,
    AdminToken,
    ApiKey,
    AsJson,
    RunIdArg,
    Url,
    print_json,
    stdout,
    synchronous,
)
from moorline.cli.run_filters import CreatedAfter, CreatedBefore, Ids, aware
from moorline.client import BulkJob, Client

POLL_INTERVAL_S = 0.5
"""How often a followed bulk job's progress is read."""

Status = Annotated[
    str | None,
    typer.Option(
        "--status",
        help="Only runs in this status (retry: failed or timed_out, default both; cancel: one "
        "that has not ended, default all).",
        show_default=False,
    ),
]
Workflow = Annotated[
    str | None, typer.Option("--workflow", help="Only this workflow's runs.", show_default=False)
]
Conversation = Annotated[
    str | None,
    typer.Option("--conversation", help="Only this conversation's runs.", show_default=False),
]
Tenant = Annotated[
    str | None,
    typer.Option(
        "--tenant", help="With --admin-token: only this tenant's runs.", show_default=False
    ),
]
Key = Annotated[
    str | None,
    typer.Option(
        "--idempotency-key",
        help="Idempotency key: the same key and filters again return the first job.",
        show_default=False,
    ),
]
NoWait = Annotated[
    bool, typer.Option("--no-wait", help="Print the job and return instead of following it.")
]


def register(cli: typer.Typer) -> None:
    """Add ``retry``, ``rerun`` and the ``bulk`` group to the ``moorline`` command tree."""
    cli.command("retry")(retry)
    cli.command("rerun")(rerun)
    bulk = typer.Typer(
        help="Cancel or retry many runs at once, as a job with its progress.",
        no_args_is_help=True,
        rich_markup_mode="markdown",
    )
    bulk.command("cancel")(bulk_cancel)
    bulk.command("retry")(bulk_retry)
    bulk.command("status")(bulk_status)
    cli.add_typer(bulk, name="bulk")


def _client(url: str, api_key: str | None, admin_token: str | None) -> Client:
    return Client(url, api_key, admin_token=admin_token)


@synchronous
async def retry(
    run_id: RunIdArg,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
    admin_token: AdminToken = None,
    as_json: AsJson = False,
) -> None:
    """Put a failed or timed-out run back to queued; it resumes at the step that failed."""
    async with _client(url, api_key, admin_token) as client:
        result = await client.retry(run_id, admin=admin_token is not None)
    if as_json:
        print_json(result)
    else:
        stdout().print(f"run {result.run_id}: retried, status {result.status}")


@synchronous
async def rerun(
    run_id: RunIdArg,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
    admin_token: AdminToken = None,
    as_json: AsJson = False,
    key: Annotated[
        str | None,
        typer.Option(
            "--idempotency-key",
            help="The same key again returns the first re-run instead of starting another.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Start a new run with a run's workflow and input; the new run names it in `rerun_of`."""
    async with _client(url, api_key, admin_token) as client:
        result = await client.rerun(run_id, idempotency_key=key, admin=admin_token is not None)
    if as_json:
        print_json(result)
    else:
        stdout().print(f"run {result.run_id}: re-run of {result.rerun_of}, status {result.status}")


async def _bulk(
    action: str,
    *,
    url: str,
    api_key: str | None,
    admin_token: str | None,
    key: str | None,
    no_wait: bool,
    as_json: bool,
    filters: dict[str, object],
) -> None:
    admin = admin_token is not None
    async with _client(url, api_key, admin_token) as client:
        start = client.bulk_retry if action == "retry" else client.bulk_cancel
        job = await start(idempotency_key=key or uuid.uuid4().hex, admin=admin, **filters)
        if not no_wait:
            job = await follow(client, job, admin=admin, quiet=as_json)
    if as_json:
        print_json(job)
    else:
        print_job(job)


async def follow(client: Client, job: BulkJob, *, admin: bool, quiet: bool) -> BulkJob:
    """Poll ``job`` until it has finished, with a progress bar unless ``quiet``."""
    columns = (
        TextColumn(f"bulk {job.action}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[failed]} failed"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=stdout(), disable=quiet, transient=False) as bar:
        task = bar.add_task(job.action, total=job.total, failed=job.failed)
        while True:
            bar.update(task, completed=job.done + job.failed, failed=job.failed)
            if job.is_finished:
                return job
            await asyncio.sleep(POLL_INTERVAL_S)  # a poll of the job's row, nothing to wake
            job = await client.bulk_job(job.job_id, admin=admin)


def print_job(job: BulkJob) -> None:
    """One line about the job and its progress."""
    stdout().print(
        f"bulk {job.action} {job.job_id}: {job.state}, {job.done} done, {job.failed} failed "
        f"of {job.total}"
    )


def bulk_command(action: str, summary: str) -> Callable[..., None]:
    """The ``moorline bulk ACTION`` command: ``summary`` is its help's first line.

    ``cancel`` and ``retry`` take the same filters and options and differ only in the action
    the job carries out.
    """

    async def command(
        status: Status = None,
        workflow: Workflow = None,
        conversation: Conversation = None,
        created_after: CreatedAfter = None,
        created_before: CreatedBefore = None,
        ids: Ids = None,
        tenant: Tenant = None,
        key: Key = None,
        no_wait: NoWait = False,
        url: Url = DEFAULT_URL,
        api_key: ApiKey = None,
        admin_token: AdminToken = None,
        as_json: AsJson = False,
    ) -> None:
        await _bulk(
            action,
            url=url,
            api_key=api_key,
            admin_token=admin_token,
            key=key,
            no_wait=no_wait,
            as_json=as_json,
            filters=_filters(
                status, workflow, conversation, created_after, created_before, ids, tenant
            ),
        )

    command.__doc__ = summary
    command.__name__ = command.__qualname__ = f"bulk_{action}"
    return synchronous(command)


bulk_cancel = bulk_command(
    "cancel", "Cancel every run the filters match (at least one filter), with a progress bar."
)
bulk_retry = bulk_command(
    "retry", "Retry every failed or timed-out run the filters match, with a progress bar."
)


@synchronous
async def bulk_status(
    job_id: Annotated[str, typer.Argument(metavar="JOB_ID", help="The bulk job's id.")],
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
    admin_token: AdminToken = None,
    as_json: AsJson = False,
) -> None:
    """A bulk job's progress."""
    async with _client(url, api_key, admin_token) as client:
        job = await client.bulk_job(job_id, admin=admin_token is not None)
    if as_json:
        print_json(job)
    else:
        print_job(job)


def _filters(
    status: str | None,
    workflow: str | None,
    conversation: str | None,
    created_after: datetime | None,
    created_before: datetime | None,
    ids: list[str] | None,
    tenant: str | None,
) -> dict[str, object]:
    return {
        "status": status,
        "workflow": workflow,
        "conversation_id": conversation,
        "created_after": aware(created_after),
        "created_before": aware(created_before),
        "ids": ids or None,
        "tenant_id": tenant,
    }
