"""``moorline.SyncClient``: :class:`moorline.Client`'s synchronous twin, on ``httpx.Client``.

The same methods, arguments and results, for scripts and frameworks without an event loop.
It sends the requests :mod:`moorline.client.calls` describes with httpx's synchronous client
(not a thread running the async one: no loop, no thread, and it can be used from inside a
running event loop's thread without nesting loops). Waiting between reconnects of an event
stream blocks the calling thread, as any synchronous client does.

Example::

    with SyncClient() as client:  # MOORLINE_URL, MOORLINE_API_KEY
        run = client.trigger("echo", {"message": "hi"}, wait=True, timeout=60)
        print(run.status, run.output)
"""

import time
from collections.abc import Iterable, Iterator, Mapping
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
from moorline.client.errors import ServerUnreachable, error_from_response
from moorline.client.results import (
    ApiKey,
    ApiKeyIssued,
    BatchItem,
    BulkJob,
    CancelAccepted,
    Event,
    Lane,
    MessageAccepted,
    Readiness,
    RerunAccepted,
    Resumed,
    Run,
    RunAccepted,
    RunPage,
    RunSummary,
    Schedule,
    Tenant,
    TenantCreated,
    TenantPage,
    Usage,
    Webhook,
    WebhookListed,
    Worker,
    WorkerDetail,
    WorkflowInfo,
)
from moorline.client.sse import parse_sse_sync
from moorline.types import JSONObject, JSONValue


class SyncClient:
    """A synchronous client of one Moorline server (see :class:`moorline.Client`).

    Args:
        url: The server's base URL; default ``MOORLINE_URL``, else ``http://127.0.0.1:8000``.
        api_key: A tenant's API key, for the tenant routes; default ``MOORLINE_API_KEY``.
        admin_token: ``MOORLINE_ADMIN_TOKEN`` of the server, for the admin routes.
        timeout_s: Timeout of each request (connect, read, write), in seconds.
        transport: An httpx transport (tests may pass ``httpx.MockTransport``).

    Use it as a context manager, or call :meth:`close` when done.
    """

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        admin_token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = calls.resolve_url(url)
        self._api_key = calls.resolve_api_key(api_key)
        self._admin_token = calls.checked_secret(admin_token, "admin token")
        # httpx's pool, sized as the async client's; requests go straight to it (see _call),
        # unless a proxy from the environment is httpx's to honour.
        if transport is None and not calls.has_environment_proxy():
            transport = httpx.HTTPTransport(limits=calls.POOL_LIMITS)
        self._transport = transport
        self._http = httpx.Client(
            base_url=self.url,
            timeout=httpx.Timeout(timeout_s),
            transport=transport,
            headers={"Accept": "application/json"},
            limits=calls.POOL_LIMITS,
        )
        self._requests = calls.RequestBuilder(self.url, timeout_s)

    def __enter__(self) -> "SyncClient":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections."""
        self._http.close()

    # --- admin --------------------------------------------------------------------------------

    def create_tenant(self, name: str, plan: str) -> TenantCreated:
        """Create a tenant (admin); its API key is in the result, shown this once."""
        return self._call(calls.create_tenant(name, plan))

    def change_plan(self, tenant_id: str, plan: str) -> Tenant:
        """Move a tenant to another plan (admin)."""
        return self._call(calls.change_plan(tenant_id, plan))

    def list_tenants(self, *, limit: int | None = None, cursor: str | None = None) -> TenantPage:
        """One page of tenants with their plan's limits and use, oldest first (admin)."""
        return self._call(calls.list_tenants(limit=limit, cursor=cursor))

    def list_keys(self, tenant_id: str) -> list[ApiKey]:
        """A tenant's API keys, revoked ones too, never the keys themselves (admin)."""
        return (self._call(calls.list_keys(tenant_id))).keys

    def issue_key(self, tenant_id: str) -> ApiKeyIssued:
        """Issue another API key for a tenant, shown this once (admin)."""
        return self._call(calls.issue_key(tenant_id))

    def revoke_key(self, tenant_id: str, key_id: str) -> None:
        """Revoke one of a tenant's API keys; every API process refuses it within 5 s (admin)."""
        self._call(calls.revoke_key(tenant_id, key_id))

    def queues(self) -> list[Lane]:
        """Every lane's load (admin)."""
        return self._call(calls.queues()).lanes

    def workers(self, *, status: Literal["live", "dead"] | None = None) -> list[Worker]:
        """Every worker with a heartbeat row, live ones first, with the runs each holds (admin).

        Args:
            status: Only the ``live`` or only the ``dead`` ones (no heartbeat for a lease TTL).
        """
        return (self._call(calls.workers(status))).workers

    def worker(self, worker_id: str) -> WorkerDetail:
        """One worker with every run it holds (admin); ``WorkerNotFound`` when it has no row."""
        return self._call(calls.worker(worker_id))

    # --- runs ---------------------------------------------------------------------------------

    def workflows(self) -> list[WorkflowInfo]:
        """The workflows the server runs, by name, with their inputs as JSON Schema."""
        return self._call(calls.workflows()).workflows

    @overload
    def trigger(
        self,
        workflow: str,
        input: JSONObject | None = None,
        *,
        idempotency_key: str | None = None,
        conversation_id: str | None = None,
        delay_seconds: float | None = None,
        wait: Literal[False] = False,
        timeout: float | None = None,
    ) -> RunAccepted: ...

    @overload
    def trigger(
        self,
        workflow: str,
        input: JSONObject | None = None,
        *,
        idempotency_key: str | None = None,
        conversation_id: str | None = None,
        delay_seconds: float | None = None,
        wait: Literal[True],
        timeout: float | None = None,
    ) -> Run: ...

    def trigger(
        self,
        workflow: str,
        input: JSONObject | None = None,
        *,
        idempotency_key: str | None = None,
        conversation_id: str | None = None,
        delay_seconds: float | None = None,
        wait: bool = False,
        timeout: float | None = None,
    ) -> RunAccepted | Run:
        """Start a run of ``workflow``; with ``wait=True``, return it once it has ended."""
        call = calls.trigger(
            workflow,
            input,
            idempotency_key=idempotency_key,
            conversation_id=conversation_id,
            delay_seconds=delay_seconds,
        )
        accepted = self._call(call)
        if not wait:
            return accepted
        return self.wait(accepted.run_id, timeout=timeout)

    def trigger_many(self, workflow: str, items: Iterable[Mapping[str, Any]]) -> list[BatchItem]:
        """Start many runs of ``workflow``, each answered on its own (see ``Client``'s)."""
        bodies = [calls.batch_item(item) for item in items]
        answers: list[BatchItem] = []
        for chunk in calls.chunks(bodies, calls.MAX_BATCH):
            answers += self._call(calls.trigger_batch(workflow, chunk)).results
        return answers

    def wait(self, run_id: str, *, timeout: float | None = None) -> Run:
        """The run once it has ended (a terminal status), following its event stream.

        Raises:
            TimeoutError: it had not ended after ``timeout`` seconds (None: no limit).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        last_seq = 0
        while True:
            run = self.get_run(run_id)  # a server that does not answer raises here
            if run.status.is_terminal:
                return run
            left = STREAM_READ_TIMEOUT_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"run {run_id} had not ended after {timeout} s")
            # One connection, its read timeout the time left (at most the usual silence
            # bound): a silent stream ends this wait on time, where events() would reconnect.
            try:
                for event in self._stream_once(run_id, last_seq, min(left, STREAM_READ_TIMEOUT_S)):
                    last_seq = event.seq
                    if event.is_terminal:
                        break
            except (httpx.TransportError, ServerUnreachable):
                pass  # timed out or dropped: read the run again (and the clock)

    def get_run(self, run_id: str) -> Run:
        """A run with its steps and the decision it waits for, if any."""
        return self._call(calls.get_run(run_id))

    def list_runs(
        self, *, limit: int | None = None, cursor: str | None = None, **filters: Any
    ) -> RunPage:
        """One page of the tenant's runs matching the filters, newest first.

        Filters: ``status``, ``workflow``, ``conversation_id``, ``created_after``,
        ``created_before`` (aware datetimes), ``ids`` (at most 100), ``run_id`` (an id's start,
        or its last 8 characters) and ``input_contains`` (see :func:`calls.run_filters`).
        """
        call = calls.list_runs(calls.run_filters(**filters), limit=limit, cursor=cursor)
        return self._call(call)

    def iter_runs(
        self,
        *,
        page_size: int | None = None,
        **filters: Any,
    ) -> Iterator[RunSummary]:
        """Every run matching the filters, newest first, fetching page after page."""
        cursor: str | None = None
        while True:
            page = self.list_runs(limit=page_size, cursor=cursor, **filters)
            yield from page.runs
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    def cancel(self, run_id: str) -> CancelAccepted:
        """Cancel a run: a queued one ends at once, a running one at its next check."""
        return self._call(calls.cancel(run_id))

    def retry(self, run_id: str, *, admin: bool = False) -> RunAccepted:
        """Put a failed or timed-out run back to ``queued``; it resumes at its failed step.

        With ``admin``, through the admin route (any tenant's run; needs ``admin_token``).
        """
        return self._call(calls.retry(run_id, admin=admin))

    def rerun(
        self, run_id: str, *, idempotency_key: str | None = None, admin: bool = False
    ) -> RerunAccepted:
        """Start a new run with the run's workflow and input, linked to it (``rerun_of``).

        The same ``idempotency_key`` again returns the first re-run instead of a second one.
        """
        return self._call(calls.rerun(run_id, idempotency_key=idempotency_key, admin=admin))

    def bulk_cancel(
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
        return self._call(call)

    def bulk_retry(
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
        return self._call(call)

    def bulk_job(self, job_id: str, *, admin: bool = False) -> BulkJob:
        """A bulk job's progress: ``total``, ``done``, ``failed``, ``state``."""
        return self._call(calls.bulk_job(job_id, admin=admin))

    def resume(
        self,
        run_id: str,
        *,
        approved: bool,
        interrupt_id: str | None = None,
        data: JSONObject | None = None,
    ) -> Resumed:
        """Decide the run's pending interrupt (default: its oldest one)."""
        return self._call(
            calls.resume(run_id, approved=approved, interrupt_id=interrupt_id, data=data)
        )

    def approve(
        self, run_id: str, *, interrupt_id: str | None = None, data: JSONObject | None = None
    ) -> Resumed:
        """Approve the run's pending interrupt; ``data`` reaches the workflow's decision."""
        return self.resume(run_id, approved=True, interrupt_id=interrupt_id, data=data)

    def deny(
        self, run_id: str, *, interrupt_id: str | None = None, data: JSONObject | None = None
    ) -> Resumed:
        """Deny the run's pending interrupt."""
        return self.resume(run_id, approved=False, interrupt_id=interrupt_id, data=data)

    def post_message(self, run_id: str, content: str) -> MessageAccepted:
        """Hand a message to a running run's workflow."""
        return self._call(calls.post_message(run_id, content))

    def events(
        self, run_id: str, *, after: int = 0, read_timeout_s: float = STREAM_READ_TIMEOUT_S
    ) -> Iterator[Event]:
        """The run's events after ``after`` until its terminal event (see ``Client.events``)."""
        last_seq = after
        failures = 0
        while True:
            try:
                for event in self._stream_once(run_id, last_seq, read_timeout_s):
                    failures = 0
                    last_seq = event.seq
                    yield event
                    if event.is_terminal:
                        return
            except (httpx.TransportError, ServerUnreachable) as exc:
                failures += 1
                if failures > MAX_RECONNECTS:
                    raise calls.unreachable(self.url, exc) from exc
                time.sleep(calls.backoff_s(failures))
                continue
            if self.get_run(run_id).status.is_terminal:
                yield from self._stream_once(run_id, last_seq, read_timeout_s)
                return
            failures += 1  # a stream that keeps closing empty must not spin
            time.sleep(calls.backoff_s(failures) if failures > 1 else 0.0)

    def _stream_once(self, run_id: str, after: int, read_timeout_s: float) -> Iterator[Event]:
        timeout = httpx.Timeout(self._http.timeout.connect, read=read_timeout_s)
        request = self._http.build_request(
            "GET",
            calls.events_path(run_id),
            headers={**self._auth(admin=False), **calls.events_headers(after)},
            timeout=timeout,
        )
        response = self._send(request, stream=True)
        try:
            if response.status_code >= 400:
                response.read()
                raise error_from_response(response)
            yield from parse_sse_sync(response.iter_lines())
        finally:
            response.close()

    # --- schedules -------------------------------------------------------------------------------

    def create_schedule(
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
        return self._call(calls.create_schedule(body))

    def list_schedules(self) -> list[Schedule]:
        """The tenant's schedules, oldest first."""
        return (self._call(calls.list_schedules())).schedules

    def get_schedule(self, schedule_id: str) -> Schedule:
        """One of the tenant's schedules."""
        return self._call(calls.schedule_call("GET", schedule_id))

    def update_schedule(self, schedule_id: str, **changes: JSONValue) -> Schedule:
        """Change a schedule's fields (``cron=``, ``every_seconds=``, ``input=``, ``paused=``…)."""
        return self._call(calls.edit_schedule(schedule_id, changes))

    def pause_schedule(self, schedule_id: str) -> Schedule:
        """Stop the schedule's ticks until it is resumed."""
        return self._call(calls.schedule_call("POST", schedule_id, "/pause"))

    def resume_schedule(self, schedule_id: str) -> Schedule:
        """Fire the schedule again from its next tick after now."""
        return self._call(calls.schedule_call("POST", schedule_id, "/resume"))

    def delete_schedule(self, schedule_id: str) -> None:
        """Delete one of the tenant's schedules (the runs it started are kept)."""
        self._call(calls.delete_schedule(schedule_id))

    # --- webhooks, usage, health ----------------------------------------------------------------

    def create_webhook(self, workflow: str, *, secret: str | None = None) -> Webhook:
        """A webhook that triggers ``workflow`` for GitHub-signed deliveries."""
        return self._call(calls.create_webhook(workflow, secret))

    def list_webhooks(self) -> list[WebhookListed]:
        """The tenant's webhooks, oldest first (without their secrets)."""
        return (self._call(calls.list_webhooks())).webhooks

    def delete_webhook(self, webhook_id: str) -> None:
        """Delete one of the tenant's webhooks; deliveries to it are refused from then on."""
        self._call(calls.delete_webhook(webhook_id))

    def usage(self) -> Usage:
        """The tenant's daily quota and what is used of it."""
        return self._call(calls.usage())

    def healthz(self) -> bool:
        """Whether the server process answers ``/healthz``."""
        return self._send(self._http.build_request("GET", "/healthz")).status_code == 200

    def readyz(self) -> Readiness:
        """Whether every backend of the server accepts work (503 is an answer, not an error)."""
        return calls.readiness(self._send(self._http.build_request("GET", "/readyz")))

    # --- plumbing -------------------------------------------------------------------------------

    def _auth(self, *, admin: bool) -> dict[str, str]:
        return calls.authorization(self._admin_token if admin else self._api_key, admin=admin)

    def _call(self, call: Call[M]) -> M:
        # Straight to the transport, as the async client does (see Client._call).
        request = self._requests.build(call, self._auth(admin=call.admin))
        if self._transport is None:  # through a proxy
            return calls.result(call, self._send(request))
        try:
            response = self._transport.handle_request(request)
            try:
                response.read()
            finally:
                response.close()
        except httpx.TransportError as exc:
            raise calls.unreachable(self.url, exc) from exc
        return calls.result(call, response)

    def _send(self, request: httpx.Request, *, stream: bool = False) -> httpx.Response:
        try:
            return self._http.send(request, stream=stream)
        except httpx.TransportError as exc:
            raise calls.unreachable(self.url, exc) from exc
