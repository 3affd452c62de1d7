"""``moorline.Client``: the async Python client of HTTP API v1 (docs/api.md).

It speaks only the HTTP contract: it imports nothing from ``moorline.api`` (an import-linter
contract holds it to that), so it works against any server of the same API version and
shows what a client in another language would have to do.

- :mod:`moorline.client.results`: the typed results (pydantic models of the response bodies);
- :mod:`moorline.client.errors`: error answers raised as the
  :class:`~moorline.errors.MoorlineError` class of their ``code``;
- :mod:`moorline.client.sse`: the event stream's parser;
- :mod:`moorline.client.calls`: each operation as a request description, shared with
  :class:`~moorline.client.sync.SyncClient`, the synchronous twin (``moorline.SyncClient``).

Without ``url`` or ``api_key``, a client reads ``MOORLINE_URL`` and ``MOORLINE_API_KEY``, as
the CLI's client commands do.

Example::

    async with Client() as client:  # MOORLINE_URL, MOORLINE_API_KEY
        run = await client.trigger("echo", {"message": "hi"})
        async for event in client.events(run.run_id):
            print(event.type, event.data)
        done = await client.wait(run.run_id, timeout=60)
"""

import asyncio
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any, Literal, overload

import httpx

from moorline.client import calls
from moorline.client.calls import (
    DEFAULT_TIMEOUT_S,
    MAX_RECONNECTS,
    STREAM_READ_TIMEOUT_S,
    Call,
    M,
)
from moorline.client.errors import ApiError, ServerUnreachable, error_from_response
from moorline.client.results import (
    ApiKey,
    ApiKeyIssued,
    BatchAnswer,
    BatchItem,
    BulkJob,
    CancelAccepted,
    Event,
    Lane,
    MessageAccepted,
    ModelUsage,
    PendingInterrupt,
    Readiness,
    RerunAccepted,
    Resumed,
    Run,
    RunAccepted,
    RunPage,
    RunSummary,
    RunUsage,
    Schedule,
    Step,
    Tenant,
    TenantCreated,
    TenantPage,
    Usage,
    UsageTotals,
    WaitingFor,
    Webhook,
    WebhookListed,
    Worker,
    WorkerDetail,
    WorkflowInfo,
    WorkflowLimits,
)
from moorline.client.sse import parse_sse
from moorline.client.sync import SyncClient
from moorline.client.transport import KeepAliveTransport
from moorline.types import JSONObject, JSONValue


class Client:
    """An async client of one Moorline server.

    Args:
        url: The server's base URL, e.g. ``http://127.0.0.1:8000``; default
            ``MOORLINE_URL``, else ``http://127.0.0.1:8000``.
        api_key: A tenant's API key, for the tenant routes; default ``MOORLINE_API_KEY``.
        admin_token: ``MOORLINE_ADMIN_TOKEN`` of the server, for the admin routes.
        timeout_s: Timeout of each request (connect, read, write), in seconds.
        transport: An httpx transport (tests pass ``httpx.ASGITransport``).

    Use it as an async context manager, or call :meth:`aclose` when done.
    """

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        admin_token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = calls.resolve_url(url)
        self._api_key = calls.resolve_api_key(api_key)
        self._admin_token = calls.checked_secret(admin_token, "admin token")
        # A proxy from the environment (HTTP_PROXY, ...) is httpx's to honour: the kept-alive
        # transport speaks only straight to the server.
        if transport is None and not calls.has_environment_proxy():
            transport = KeepAliveTransport()
        self._transport = transport
        self._http = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(timeout_s),
            transport=transport,
            headers={"Accept": "application/json"},
            limits=calls.POOL_LIMITS,
        )
        self._requests = calls.RequestBuilder(self.url, timeout_s)

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections."""
        await self._http.aclose()

    # --- admin --------------------------------------------------------------------------------

    async def create_tenant(self, name: str, plan: str) -> TenantCreated:
        """Create a tenant (admin); its API key is in the result, shown this once."""
        return await self._call(calls.create_tenant(name, plan))

    async def change_plan(self, tenant_id: str, plan: str) -> Tenant:
        """Move a tenant to another plan (admin)."""
        return await self._call(calls.change_plan(tenant_id, plan))

    async def list_tenants(
        self, *, limit: int | None = None, cursor: str | None = None
    ) -> TenantPage:
        """One page of tenants with their plan's limits and use, oldest first (admin)."""
        return await self._call(calls.list_tenants(limit=limit, cursor=cursor))

    async def list_keys(self, tenant_id: str) -> list[ApiKey]:
        """A tenant's API keys, revoked ones too, never the keys themselves (admin)."""
        return (await self._call(calls.list_keys(tenant_id))).keys

    async def issue_key(self, tenant_id: str) -> ApiKeyIssued:
        """Issue another API key for a tenant, shown this once (admin)."""
        return await self._call(calls.issue_key(tenant_id))

    async def revoke_key(self, tenant_id: str, key_id: str) -> None:
        """Revoke one of a tenant's API keys; every API process refuses it within 5 s (admin)."""
        await self._call(calls.revoke_key(tenant_id, key_id))

    async def queues(self) -> list[Lane]:
        """Every lane's load (admin)."""
        return (await self._call(calls.queues())).lanes

    async def workers(self, *, status: Literal["live", "dead"] | None = None) -> list[Worker]:
        """Every worker with a heartbeat row, live ones first, with the runs each holds (admin).

        Args:
            status: Only the ``live`` or only the ``dead`` ones (no heartbeat for a lease TTL).
        """
        return (await self._call(calls.workers(status))).workers

    async def worker(self, worker_id: str) -> WorkerDetail:
        """One worker with every run it holds (admin); ``WorkerNotFound`` when it has no row."""
        return await self._call(calls.worker(worker_id))

    # --- runs ---------------------------------------------------------------------------------

    async def workflows(self) -> list[WorkflowInfo]:
        """The workflows the server runs, by name, with their inputs as JSON Schema."""
        return (await self._call(calls.workflows())).workflows

    @overload
    async def trigger(
        self,
        workflow: str,
        input: JSONObject | None = None,
        *,
        idempotency_key: str | None = None,
        conversation_id: str | None = None,
        delay_seconds: float | None = None,
        wait: Literal[False] = False,
        timeout: float | None = None,  # noqa: ASYNC109 - the wait's bound, as in wait()
    ) -> RunAccepted: ...

    @overload
    async def trigger(
        self,
        workflow: str,
        input: JSONObject | None = None,
        *,
        idempotency_key: str | None = None,
        conversation_id: str | None = None,
        delay_seconds: float | None = None,
        wait: Literal[True],
        timeout: float | None = None,  # noqa: ASYNC109 - the wait's bound, as in wait()
    ) -> Run: ...

    async def trigger(
        self,
        workflow: str,
        input: JSONObject | None = None,
        *,
        idempotency_key: str | None = None,
        conversation_id: str | None = None,
        delay_seconds: float | None = None,
        wait: bool = False,
        timeout: float | None = None,  # noqa: ASYNC109 - the wait's bound, as in wait()
    ) -> RunAccepted | Run:
        """Start a run of ``workflow`` (or get the earlier run of a repeated idempotency key).

        With ``wait=True``, return the run once it has ended instead (see :meth:`wait`;
        ``timeout`` bounds that wait, in seconds).
        """
        call = calls.trigger(
            workflow,
            input,
            idempotency_key=idempotency_key,
            conversation_id=conversation_id,
            delay_seconds=delay_seconds,
        )
        accepted = await self._call(call)
        if not wait:
            return accepted
        return await self.wait(accepted.run_id, timeout=timeout)

    async def trigger_many(
        self, workflow: str, items: Iterable[Mapping[str, Any]]
    ) -> list[BatchItem]:
        """Start many runs of ``workflow``: each item admitted on its own, answered in order.

        Each item is a trigger's body: ``{"input": {...}, "idempotency_key"?,
        "conversation_id"?, "delay_seconds"?}``. Sent :data:`~moorline.client.calls.MAX_BATCH`
        items a request (``POST /v1/workflows/{workflow}/runs/batch``), one request after
        another; an item refused (a 409, 422 or 429 of its own) is an answer with ``error``,
        not an exception. A request refused as a whole (unknown workflow, bad key) raises,
        and the items of earlier requests stay admitted.
        """
        bodies = [calls.batch_item(item) for item in items]
        answers: list[BatchItem] = []
        for chunk in calls.chunks(bodies, calls.MAX_BATCH):
            answers += (await self._call(calls.trigger_batch(workflow, chunk))).results
        return answers

    async def wait(
        self,
        run_id: str,
        *,
        # A parameter, not the caller's asyncio.timeout: the same call as SyncClient.wait.
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> Run:
        """The run once it has ended (a terminal status), following its event stream.

        Raises:
            TimeoutError: it had not ended after ``timeout`` seconds (None: no limit).
        """
        async with asyncio.timeout(timeout):
            last_seq = 0
            while True:
                run = await self.get_run(run_id)
                if run.status.is_terminal:
                    return run
                # The stream ends after the terminal event (or when the run is over without
                # one); the run is read again either way, for its final fields.
                async for event in self.events(run_id, after=last_seq):
                    last_seq = event.seq

    async def get_run(self, run_id: str) -> Run:
        """A run with its steps and the decision it waits for, if any."""
        return await self._call(calls.get_run(run_id))

    async def list_runs(
        self, *, limit: int | None = None, cursor: str | None = None, **filters: Any
    ) -> RunPage:
        """One page of the tenant's runs matching the filters, newest first.

        Filters: ``status``, ``workflow``, ``conversation_id``, ``created_after``,
        ``created_before`` (aware datetimes), ``ids`` (at most 100), ``run_id`` (an id's start,
        or its last 8 characters) and ``input_contains`` (see :func:`calls.run_filters`).
        """
        call = calls.list_runs(calls.run_filters(**filters), limit=limit, cursor=cursor)
        return await self._call(call)

    async def iter_runs(
        self,
        *,
        page_size: int | None = None,
        **filters: Any,
    ) -> AsyncIterator[RunSummary]:
        """Every run matching the filters, newest first, fetching page after page."""
        cursor: str | None = None
        while True:
            page = await self.list_runs(limit=page_size, cursor=cursor, **filters)
            for run in page.runs:
                yield run
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def cancel(self, run_id: str) -> CancelAccepted:
        """Cancel a run: a queued one ends at once, a running one at its next check."""
        return await self._call(calls.cancel(run_id))

    async def retry(self, run_id: str, *, admin: bool = False) -> RunAccepted:
        """Put a failed or timed-out run back to ``queued``; it resumes at its failed step.

        With ``admin``, through the admin route (any tenant's run; needs ``admin_token``).
        """
        return await self._call(calls.retry(run_id, admin=admin))

    async def rerun(
        self, run_id: str, *, idempotency_key: str | None = None, admin: bool = False
    ) -> RerunAccepted:
        """Start a new run with the run's workflow and input, linked to it (``rerun_of``).

        The same ``idempotency_key`` again returns the first re-run instead of a second one.
        """
        call = calls.rerun(run_id, idempotency_key=idempotency_key, admin=admin)
        return await self._call(call)

    async def bulk_cancel(
        self,
        *,
        idempotency_key: str | None = None,
        admin: bool = False,
        **filters: Any,
    ) -> BulkJob:
        """Cancel every run the filters match, as a job (see :func:`calls.run_filters`).

        Filters: ``status``, ``workflow``, ``conversation_id``, ``created_after``,
        ``created_before``, ``ids``, and ``tenant_id`` with ``admin``. The same
        ``idempotency_key`` again returns the first request's job.
        """
        call = calls.start_bulk(
            "cancel", calls.run_filters(**filters), idempotency_key=idempotency_key, admin=admin
        )
        return await self._call(call)

    async def bulk_retry(
        self,
        *,
        idempotency_key: str | None = None,
        admin: bool = False,
        **filters: Any,
    ) -> BulkJob:
        """Retry every failed or timed-out run the filters match (as :meth:`bulk_cancel`)."""
        call = calls.start_bulk(
            "retry", calls.run_filters(**filters), idempotency_key=idempotency_key, admin=admin
        )
        return await self._call(call)

    async def bulk_job(self, job_id: str, *, admin: bool = False) -> BulkJob:
        """A bulk job's progress: ``total``, ``done``, ``failed``, ``state``."""
        return await self._call(calls.bulk_job(job_id, admin=admin))

    async def resume(
        self,
        run_id: str,
        *,
        approved: bool,
        interrupt_id: str | None = None,
        data: JSONObject | None = None,
    ) -> Resumed:
        """Decide the run's pending interrupt (default: its oldest one)."""
        call = calls.resume(run_id, approved=approved, interrupt_id=interrupt_id, data=data)
        return await self._call(call)

    async def approve(
        self, run_id: str, *, interrupt_id: str | None = None, data: JSONObject | None = None
    ) -> Resumed:
        """Approve the run's pending interrupt; ``data`` reaches the workflow's decision."""
        return await self.resume(run_id, approved=True, interrupt_id=interrupt_id, data=data)

    async def deny(
        self, run_id: str, *, interrupt_id: str | None = None, data: JSONObject | None = None
    ) -> Resumed:
        """Deny the run's pending interrupt."""
        return await self.resume(run_id, approved=False, interrupt_id=interrupt_id, data=data)

    async def post_message(self, run_id: str, content: str) -> MessageAccepted:
        """Hand a message to a running run's workflow."""
        return await self._call(calls.post_message(run_id, content))

    async def events(
        self, run_id: str, *, after: int = 0, read_timeout_s: float = STREAM_READ_TIMEOUT_S
    ) -> AsyncIterator[Event]:
        """The run's events, from the one after ``after`` until its terminal event.

        When the connection drops (or the server ends the stream at its lifetime cap) the
        stream is opened again with ``Last-Event-ID`` of the last event seen, so no event is
        lost or repeated. After :data:`MAX_RECONNECTS` failed tries in a row the last error
        is raised. A run that ended without a terminal event on its stream (refused by the
        quota, say) ends the iteration when the stream closes.
        """
        last_seq = after
        failures = 0
        while True:
            try:
                async for event in self._stream_once(run_id, last_seq, read_timeout_s):
                    failures = 0
                    last_seq = event.seq
                    yield event
                    if event.is_terminal:
                        return
            except (httpx.TransportError, ServerUnreachable) as exc:
                failures += 1
                if failures > MAX_RECONNECTS:
                    raise calls.unreachable(self.url, exc) from exc
                await asyncio.sleep(calls.backoff_s(failures))
                continue
            # A clean close without a terminal event: the lifetime cap, or a run that is over.
            if (await self.get_run(run_id)).status.is_terminal:
                # Its terminal event may have been written after the stream closed: one more
                # replay picks it up (it closes at once when there is nothing after last_seq).
                async for event in self._stream_once(run_id, last_seq, read_timeout_s):
                    yield event
                return
            failures += 1  # a stream that keeps closing empty must not spin
            await asyncio.sleep(calls.backoff_s(failures) if failures > 1 else 0.0)

    async def _stream_once(
        self, run_id: str, after: int, read_timeout_s: float
    ) -> AsyncIterator[Event]:
        """One connection's worth of the run's events after ``after``."""
        timeout = httpx.Timeout(self._http.timeout.connect, read=read_timeout_s)
        request = self._http.build_request(
            "GET",
            calls.events_path(run_id),
            headers={**self._auth(admin=False), **calls.events_headers(after)},
            timeout=timeout,
        )
        response = await self._send(request, stream=True)
        try:
            if response.status_code >= 400:
                await response.aread()
                raise error_from_response(response)
            async for event in parse_sse(response.aiter_lines()):
                yield event
        finally:
            await response.aclose()

    # --- schedules -------------------------------------------------------------------------------

    async def create_schedule(
        self,
        workflow: str,
        input: JSONObject | None = None,
        *,
        cron: str | None = None,
        every_seconds: int | None = None,
        timezone: str | None = None,
        catch_up: str | None = None,
        paused: bool | None = None,
    ) -> Schedule:
        """A schedule that triggers ``workflow`` at every tick of ``cron`` or ``every_seconds``."""
        body = {
            "workflow": workflow,
            "input": input,
            "cron": cron,
            "every_seconds": every_seconds,
            "timezone": timezone,
            "catch_up": catch_up,
            "paused": paused,
        }
        return await self._call(calls.create_schedule(body))

    async def list_schedules(self) -> list[Schedule]:
        """The tenant's schedules, oldest first."""
        return (await self._call(calls.list_schedules())).schedules

    async def get_schedule(self, schedule_id: str) -> Schedule:
        """One of the tenant's schedules."""
        return await self._call(calls.schedule_call("GET", schedule_id))

    async def update_schedule(self, schedule_id: str, **changes: JSONValue) -> Schedule:
        """Change a schedule's fields (``cron=``, ``every_seconds=``, ``input=``, ``paused=``…)."""
        return await self._call(calls.edit_schedule(schedule_id, changes))

    async def pause_schedule(self, schedule_id: str) -> Schedule:
        """Stop the schedule's ticks until it is resumed."""
        return await self._call(calls.schedule_call("POST", schedule_id, "/pause"))

    async def resume_schedule(self, schedule_id: str) -> Schedule:
        """Fire the schedule again from its next tick after now."""
        return await self._call(calls.schedule_call("POST", schedule_id, "/resume"))

    async def delete_schedule(self, schedule_id: str) -> None:
        """Delete one of the tenant's schedules (the runs it started are kept)."""
        await self._call(calls.delete_schedule(schedule_id))

    # --- webhooks, usage, health ----------------------------------------------------------------

    async def create_webhook(self, workflow: str, *, secret: str | None = None) -> Webhook:
        """A webhook that triggers ``workflow`` for GitHub-signed deliveries."""
        return await self._call(calls.create_webhook(workflow, secret))

    async def list_webhooks(self) -> list[WebhookListed]:
        """The tenant's webhooks, oldest first (without their secrets)."""
        return (await self._call(calls.list_webhooks())).webhooks

    async def delete_webhook(self, webhook_id: str) -> None:
        """Delete one of the tenant's webhooks; deliveries to it are refused from then on."""
        await self._call(calls.delete_webhook(webhook_id))

    async def usage(self) -> Usage:
        """The tenant's daily quota and what is used of it."""
        return await self._call(calls.usage())

    async def healthz(self) -> bool:
        """Whether the server process answers ``/healthz``."""
        response = await self._send(self._http.build_request("GET", "/healthz"))
        return response.status_code == 200

    async def readyz(self) -> Readiness:
        """Whether every backend of the server accepts work (503 is an answer, not an error)."""
        return calls.readiness(await self._send(self._http.build_request("GET", "/readyz")))

    # --- plumbing -------------------------------------------------------------------------------

    def _auth(self, *, admin: bool) -> dict[str, str]:
        return calls.authorization(self._admin_token if admin else self._api_key, admin=admin)

    async def _call(self, call: Call[M]) -> M:
        # Straight to the transport: httpx.AsyncClient.send would add its cookie jar, redirect,
        # auth and event-hook machinery, none of which API v1 uses, at about 80 µs of CPU per
        # request (bench/client_cpu.py). Event streams still go through ``self._http``.
        auth = self._auth(admin=call.admin)
        if isinstance(self._transport, KeepAliveTransport):
            return await self._call_directly(self._transport, call, auth)
        request = self._requests.build(call, auth)
        if self._transport is None:  # through a proxy
            return calls.result(call, await self._send(request))
        try:
            response = await self._transport.handle_async_request(request)
            try:
                await response.aread()
            finally:
                await response.aclose()
        except httpx.TransportError as exc:
            raise calls.unreachable(self.url, exc) from exc
        return calls.result(call, response)

    async def _call_directly(
        self, transport: KeepAliveTransport, call: Call[M], auth: dict[str, str]
    ) -> M:
        """The call as bytes on the kept-alive transport; an ``httpx.Response`` only for errors."""
        requests = self._requests
        data = requests.encode(call, auth)
        try:
            status, headers, body = await transport.send(
                requests.origin, call.method, data, requests.timeouts
            )
        except httpx.TransportError as exc:
            raise calls.unreachable(self.url, exc) from exc
        if status >= 400:
            raise error_from_response(httpx.Response(status, headers=headers, content=body))
        return calls.result_of(call, status, body)

    async def _send(self, request: httpx.Request, *, stream: bool = False) -> httpx.Response:
        try:
            return await self._http.send(request, stream=stream)
        except httpx.TransportError as exc:
            raise calls.unreachable(self.url, exc) from exc


__all__ = [
    "ApiError",
    "BatchAnswer",
    "BatchItem",
    "BulkJob",
    "CancelAccepted",
    "Client",
    "Event",
    "Lane",
    "MessageAccepted",
    "ModelUsage",
    "PendingInterrupt",
    "Readiness",
    "RerunAccepted",
    "Resumed",
    "Run",
    "RunAccepted",
    "RunPage",
    "RunSummary",
    "RunUsage",
    "Schedule",
    "ServerUnreachable",
    "Step",
    "SyncClient",
    "Tenant",
    "TenantCreated",
    "Usage",
    "UsageTotals",
    "WaitingFor",
    "Webhook",
    "Worker",
    "WorkerDetail",
    "WorkflowInfo",
    "WorkflowLimits",
    "error_from_response",
    "parse_sse",
]
