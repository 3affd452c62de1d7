"""``moorline.Client``: the async Python client of HTTP API v1 (docs/api.md).

It speaks only the HTTP contract: it imports nothing from ``moorline.api`` (an import-linter
contract holds it to that), so it works against any server of the same API version and
shows what a client in another language would have to do.

- :mod:`moorline.client.results`: the typed results (pydantic models of the response bodies);
- :mod:`moorline.client.errors`: error answers raised as the
  :class:`~moorline.errors.MoorlineError` class of their ``code``;
- :mod:`moorline.client.sse`: the event stream's parser.

Example::

    async with Client("http://127.0.0.1:8000", api_key=key) as client:
        run = await client.trigger("echo", {"message": "hi"})
        async for event in client.events(run.run_id):
            print(event.type, event.data)
"""

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from moorline.client.errors import ApiError, ServerUnreachable, error_from_response
from moorline.client.results import (
    CancelAccepted,
    Event,
    Lane,
    MessageAccepted,
    PendingInterrupt,
    Queues,
    Readiness,
    Resumed,
    Run,
    RunAccepted,
    RunPage,
    RunSummary,
    Step,
    Tenant,
    TenantCreated,
    Usage,
    Webhook,
    WorkflowInfo,
    WorkflowLimits,
    Workflows,
)
from moorline.client.sse import parse_sse
from moorline.errors import Unauthorized
from moorline.types import JSONObject, RunStatus

DEFAULT_TIMEOUT_S = 10.0
STREAM_READ_TIMEOUT_S = 60.0
"""Longest silence on an event stream before it counts as dropped (the server pings every
``SSE_PING_INTERVAL``, 15 s by default)."""

MAX_RECONNECTS = 8
"""Reconnects of an event stream in a row, without an event in between, before giving up."""
M = TypeVar("M", bound=BaseModel)


class Client:
    """An async client of one Moorline server.

    Args:
        url: The server's base URL, e.g. ``http://127.0.0.1:8000``.
        api_key: A tenant's API key, for the tenant routes.
        admin_token: ``MOORLINE_ADMIN_TOKEN`` of the server, for the admin routes.
        timeout_s: Timeout of each request (connect, read, write), in seconds.
        transport: An httpx transport (tests pass ``httpx.ASGITransport``).

    Use it as an async context manager, or call :meth:`aclose` when done.
    """

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        admin_token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._api_key = api_key
        self._admin_token = admin_token
        self._http = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(timeout_s),
            transport=transport,
            headers={"Accept": "application/json"},
        )

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
        body = {"name": name, "plan": plan}
        return await self._call(TenantCreated, "POST", "/v1/admin/tenants", json=body, admin=True)

    async def change_plan(self, tenant_id: str, plan: str) -> Tenant:
        """Move a tenant to another plan (admin)."""
        path = f"/v1/admin/tenants/{_segment(tenant_id)}"
        return await self._call(Tenant, "PATCH", path, json={"plan": plan}, admin=True)

    async def queues(self) -> list[Lane]:
        """Every lane's load (admin)."""
        return (await self._call(Queues, "GET", "/v1/admin/queues", admin=True)).lanes

    # --- runs ---------------------------------------------------------------------------------

    async def workflows(self) -> list[WorkflowInfo]:
        """The workflows the server runs, by name, with their inputs as JSON Schema."""
        return (await self._call(Workflows, "GET", "/v1/workflows")).workflows

    async def trigger(
        self,
        workflow: str,
        input: JSONObject | None = None,
        *,
        idempotency_key: str | None = None,
        conversation_id: str | None = None,
        delay_seconds: float | None = None,
    ) -> RunAccepted:
        """Start a run of ``workflow`` (or get the earlier run of a repeated idempotency key)."""
        body: dict[str, Any] = {"input": input or {}}
        optional = {
            "idempotency_key": idempotency_key,
            "conversation_id": conversation_id,
            "delay_seconds": delay_seconds,
        }
        body.update({key: value for key, value in optional.items() if value is not None})
        path = f"/v1/workflows/{_segment(workflow)}/runs"
        return await self._call(RunAccepted, "POST", path, json=body)

    async def get_run(self, run_id: str) -> Run:
        """A run with its steps and the decision it waits for, if any."""
        return await self._call(Run, "GET", f"/v1/runs/{_segment(run_id)}")

    async def list_runs(
        self,
        *,
        status: RunStatus | str | None = None,
        workflow: str | None = None,
        conversation_id: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> RunPage:
        """One page of the tenant's runs, newest first."""
        params = {
            "status": None if status is None else str(status),
            "workflow": workflow,
            "conversation_id": conversation_id,
            "limit": limit,
            "cursor": cursor,
        }
        query = {key: value for key, value in params.items() if value is not None}
        return await self._call(RunPage, "GET", "/v1/runs", params=query)

    async def iter_runs(
        self,
        *,
        status: RunStatus | str | None = None,
        workflow: str | None = None,
        conversation_id: str | None = None,
        page_size: int | None = None,
    ) -> AsyncIterator[RunSummary]:
        """Every run matching the filters, newest first, fetching page after page."""
        cursor: str | None = None
        while True:
            page = await self.list_runs(
                status=status,
                workflow=workflow,
                conversation_id=conversation_id,
                limit=page_size,
                cursor=cursor,
            )
            for run in page.runs:
                yield run
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def cancel(self, run_id: str) -> CancelAccepted:
        """Cancel a run: a queued one ends at once, a running one at its next check."""
        return await self._call(CancelAccepted, "POST", f"/v1/runs/{_segment(run_id)}/cancel")

    async def resume(
        self,
        run_id: str,
        *,
        approved: bool,
        interrupt_id: str | None = None,
        data: JSONObject | None = None,
    ) -> Resumed:
        """Decide the run's pending interrupt (default: its oldest one)."""
        body: dict[str, Any] = {"approved": approved}
        if interrupt_id is not None:
            body["interrupt_id"] = interrupt_id
        if data is not None:
            body["data"] = data
        return await self._call(Resumed, "POST", f"/v1/runs/{_segment(run_id)}/resume", json=body)

    async def approve(self, run_id: str, *, interrupt_id: str | None = None) -> Resumed:
        """Approve the run's pending interrupt."""
        return await self.resume(run_id, approved=True, interrupt_id=interrupt_id)

    async def deny(self, run_id: str, *, interrupt_id: str | None = None) -> Resumed:
        """Deny the run's pending interrupt."""
        return await self.resume(run_id, approved=False, interrupt_id=interrupt_id)

    async def post_message(self, run_id: str, content: str) -> MessageAccepted:
        """Hand a message to a running run's workflow."""
        path = f"/v1/runs/{_segment(run_id)}/messages"
        return await self._call(MessageAccepted, "POST", path, json={"content": content})

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
                    raise _unreachable(self.url, exc) from exc
                await asyncio.sleep(_backoff_s(failures))
                continue
            # A clean close without a terminal event: the lifetime cap, or a run that is over.
            if (await self.get_run(run_id)).status.is_terminal:
                # Its terminal event may have been written after the stream closed: one more
                # replay picks it up (it closes at once when there is nothing after last_seq).
                async for event in self._stream_once(run_id, last_seq, read_timeout_s):
                    yield event
                return
            failures += 1  # a stream that keeps closing empty must not spin
            await asyncio.sleep(_backoff_s(failures) if failures > 1 else 0.0)

    async def _stream_once(
        self, run_id: str, after: int, read_timeout_s: float
    ) -> AsyncIterator[Event]:
        """One connection's worth of the run's events after ``after``."""
        headers = {"Accept": "text/event-stream", "Last-Event-ID": str(after)}
        timeout = httpx.Timeout(self._http.timeout.connect, read=read_timeout_s)
        request = self._http.build_request(
            "GET",
            f"/v1/runs/{_segment(run_id)}/events",
            headers={**self._auth(admin=False), **headers},
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

    # --- webhooks, usage, health ----------------------------------------------------------------

    async def create_webhook(self, workflow: str, *, secret: str | None = None) -> Webhook:
        """A webhook that triggers ``workflow`` for GitHub-signed deliveries."""
        body = (
            {"workflow": workflow} if secret is None else {"workflow": workflow, "secret": secret}
        )
        return await self._call(Webhook, "POST", "/v1/webhooks", json=body)

    async def usage(self) -> Usage:
        """The tenant's daily quota and what is used of it."""
        return await self._call(Usage, "GET", "/v1/usage")

    async def healthz(self) -> bool:
        """Whether the server process answers ``/healthz``."""
        response = await self._send(self._http.build_request("GET", "/healthz"))
        return response.status_code == 200

    async def readyz(self) -> Readiness:
        """Whether every backend of the server accepts work (503 is an answer, not an error)."""
        response = await self._send(self._http.build_request("GET", "/readyz"))
        body = response.json()
        if response.status_code == 200:
            return Readiness(ready=True, checks=body.get("checks", {}))
        if response.status_code == 503 and isinstance(body.get("error"), dict):
            error = body["error"]
            return Readiness(
                ready=False, checks=error.get("checks", {}), message=error.get("message")
            )
        raise error_from_response(response)

    # --- plumbing -------------------------------------------------------------------------------

    def _auth(self, *, admin: bool) -> dict[str, str]:
        secret = self._admin_token if admin else self._api_key
        if secret is None:
            needed = "an admin token" if admin else "an API key"
            raise Unauthorized(f"this request needs {needed}, and the client has none")
        return {"Authorization": f"Bearer {secret}"}

    async def _call(
        self,
        model: type[M],
        method: str,
        path: str,
        *,
        json: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        admin: bool = False,
    ) -> M:
        request = self._http.build_request(
            method, path, json=json, params=params, headers=self._auth(admin=admin)
        )
        response = await self._send(request)
        if response.status_code >= 400:
            raise error_from_response(response)
        return model.model_validate(response.json())

    async def _send(self, request: httpx.Request, *, stream: bool = False) -> httpx.Response:
        try:
            return await self._http.send(request, stream=stream)
        except httpx.TransportError as exc:
            raise _unreachable(self.url, exc) from exc


def _backoff_s(failures: int) -> float:
    """Seconds to wait before reconnect number ``failures`` (0.2, 0.4, … up to 2)."""
    return float(min(2.0, 0.1 * 2**failures))


def _unreachable(url: str, exc: BaseException) -> ServerUnreachable:
    reason = str(exc) or type(exc).__name__
    return ServerUnreachable(f"could not reach the Moorline server at {url}: {reason}")


def _segment(value: str) -> str:
    """``value`` as one path segment: a ``/`` or ``?`` in an id must not change the route."""
    return quote(value, safe="")


__all__ = [
    "ApiError",
    "CancelAccepted",
    "Client",
    "Event",
    "Lane",
    "MessageAccepted",
    "PendingInterrupt",
    "Readiness",
    "Resumed",
    "Run",
    "RunAccepted",
    "RunPage",
    "RunSummary",
    "ServerUnreachable",
    "Step",
    "Tenant",
    "TenantCreated",
    "Usage",
    "Webhook",
    "WorkflowInfo",
    "WorkflowLimits",
    "error_from_response",
    "parse_sse",
]
