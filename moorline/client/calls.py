"""API v1's operations as request descriptions, shared by the async and the sync client.

Each function returns a :class:`Call`: the method, path, body, query and result model of one
request, so the async and the sync client differ only in how they send it (httpx's
``AsyncClient`` or ``Client``), as httpx's own two clients do. Nothing here does I/O.
"""

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar
from urllib.parse import quote
from urllib.request import getproxies

import httpx
from pydantic import BaseModel

from moorline.client.errors import ServerUnreachable, error_from_response
from moorline.client.results import (
    ApiKeyIssued,
    ApiKeys,
    BatchAnswer,
    BulkJob,
    CancelAccepted,
    MessageAccepted,
    Queues,
    Readiness,
    RerunAccepted,
    Resumed,
    Run,
    RunAccepted,
    RunPage,
    Schedule,
    Schedules,
    Tenant,
    TenantCreated,
    TenantPage,
    Usage,
    Webhook,
    Webhooks,
    WorkerDetail,
    Workers,
    Workflows,
)
from moorline.client.transport import IDLE_EXPIRY_S, MAX_CONNECTIONS, origin_of
from moorline.errors import InvalidInput, Unauthorized
from moorline.types import JSONObject, RunStatus

DEFAULT_URL = "http://127.0.0.1:8000"
URL_VARIABLE = "MOORLINE_URL"
API_KEY_VARIABLE = "MOORLINE_API_KEY"
DEFAULT_TIMEOUT_S = 10.0
STREAM_READ_TIMEOUT_S = 60.0
"""Longest silence on an event stream before it counts as dropped (the server pings every
``SSE_PING_INTERVAL``, 15 s by default)."""

MAX_RECONNECTS = 8
"""Reconnects of an event stream in a row, without an event in between, before giving up."""

M = TypeVar("M", bound=BaseModel)

POOL_LIMITS = httpx.Limits(
    max_connections=MAX_CONNECTIONS,
    max_keepalive_connections=MAX_CONNECTIONS,
    keepalive_expiry=IDLE_EXPIRY_S,
)
"""httpx's pool where httpx's pool is used (the sync client, a proxy): sized as the async
client's own transport, every connection kept alive, none reused past the server's timeout."""


def has_environment_proxy() -> bool:
    """Whether ``HTTP_PROXY``, ``HTTPS_PROXY`` or ``ALL_PROXY`` (any case) names a proxy."""
    return any(scheme in getproxies() for scheme in ("http", "https", "all"))


class NoContent(BaseModel):
    """The answer of a 204: nothing."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Call(Generic[M]):
    """One request of API v1 and the model of its answer."""

    model: type[M]
    method: str
    path: str
    json: Mapping[str, Any] | None = None
    params: Mapping[str, Any] | None = None
    admin: bool = False


def resolve_url(url: str | None) -> str:
    """``url``, else ``MOORLINE_URL``, else the local default; without a trailing slash.

    The clients read the two variables the CLI's client commands read, so code run beside
    them needs no configuration of its own (a client is often built where ``Settings`` is
    not, and a bad unrelated ``MOORLINE_*`` variable must not stop it).
    """
    return (url or os.environ.get(URL_VARIABLE) or DEFAULT_URL).rstrip("/")


def resolve_api_key(api_key: str | None) -> str | None:
    """``api_key``, else ``MOORLINE_API_KEY``, else None (admin-only clients need none).

    Raises:
        InvalidInput: the key cannot go in a header (see :func:`checked_secret`).
    """
    key = api_key if api_key is not None else os.environ.get(API_KEY_VARIABLE) or None
    return checked_secret(key, "API key")


def checked_secret(secret: str | None, what: str) -> str | None:
    """``secret``, if an ``Authorization`` header can carry it.

    A line break (a key read from a file with its newline, say) would end the header early
    and corrupt the request; other control or non-ASCII characters fail deep in the transport.

    Raises:
        InvalidInput: the secret holds such a character.
    """
    if secret is not None and not (secret.isascii() and secret.isprintable()):
        raise InvalidInput(
            f"the {what} holds a line break, a control or a non-ASCII character, which an "
            "HTTP header cannot carry; check how it was read"
        )
    return secret


def authorization(secret: str | None, *, admin: bool) -> dict[str, str]:
    """The ``Authorization`` header of a request, or ``Unauthorized`` when there is no key."""
    if secret is None:
        needed = "an admin token" if admin else "an API key"
        raise Unauthorized(f"this request needs {needed}, and the client has none")
    return {"Authorization": f"Bearer {secret}"}


BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
"""Methods whose requests say ``Content-Length: 0`` when they carry no body, as httpx's do."""


class RequestBuilder:
    """Builds the requests of :class:`Call` objects against one server.

    :meth:`build` makes the ``httpx.Request`` (what ``httpx.AsyncClient.build_request`` does
    for API v1's requests, without merging every path into the base URL through a full parse:
    the base's path is split off once here). :meth:`encode` writes the same request straight
    as HTTP/1.1 bytes for the kept-alive transport: an ``httpx.Request`` parses its URL,
    normalises its headers and wraps its body, a few hundred microseconds of a client that
    triggers now and then (code not run for a while runs several times slower than in a loop).
    """

    def __init__(self, url: str, timeout_s: float) -> None:
        base = httpx.URL(url)
        self._base = base
        # httpx joins a relative path to the base's path as if it ended in "/"; so do we.
        self._prefix = base.raw_path.rstrip(b"/")
        self.timeouts: dict[str, float | None] = httpx.Timeout(timeout_s).as_dict()
        """The transport's timeouts of every request (``connect``, ``read``, ...)."""
        self.origin = origin_of(base)
        """The server, as the kept-alive transport keys its connections."""
        self._host = httpx.Request("GET", base).headers["Host"].encode("ascii")

    def encode(self, call: Call[Any], headers: dict[str, str]) -> bytes:
        """The HTTP/1.1 request of ``call`` with ``headers``, as bytes.

        The bytes :meth:`build`'s request is sent as (``tests/unit/test_client_transport.py``
        compares the two).
        """
        target = self._prefix + call.path.encode("ascii")
        if call.params:
            target += b"?" + str(httpx.QueryParams(call.params)).encode("ascii")
        head = [call.method.encode("ascii"), b" ", target, b" HTTP/1.1\r\nHost: ", self._host]
        head.append(b"\r\n")
        body = b""
        if call.json is not None:
            # httpx's own encoding of a ``json=`` body.
            text = json.dumps(call.json, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
            body = text.encode()
        elif call.method in BODY_METHODS:
            head.append(b"Content-Length: 0\r\n")  # where httpx puts it
        head.append(b"Accept: application/json\r\n")
        for name, value in headers.items():
            head += (name.encode("ascii"), b": ", value.encode("ascii"), b"\r\n")
        if body:
            head += (b"Content-Length: ", b"%d" % len(body), b"\r\n")
            head.append(b"Content-Type: application/json\r\n")
        head.append(b"\r\n")
        return b"".join(head) + body

    def build(self, call: Call[Any], headers: dict[str, str]) -> httpx.Request:
        """The request of ``call`` with ``headers`` (its authorization)."""
        url = self._base.copy_with(raw_path=self._prefix + call.path.encode("ascii"))
        return httpx.Request(
            call.method,
            url,
            params=call.params or None,
            json=call.json,
            headers={"Accept": "application/json", **headers},
            extensions={"timeout": self.timeouts},
        )


def result(call: Call[M], response: httpx.Response) -> M:
    """The answer of ``call`` as its model, or the error the answer carries, raised."""
    if response.status_code >= 400:
        raise error_from_response(response)
    return result_of(call, response.status_code, response.content)


def result_of(call: Call[M], status: int, body: bytes) -> M:
    """The model of a successful answer (``status`` below 400) to ``call``."""
    if status == 204:
        return call.model.model_validate({})
    # From the bytes: pydantic-core parses and validates in one pass, with no dicts between.
    return call.model.model_validate_json(body)


def readiness(response: httpx.Response) -> Readiness:
    """``/readyz``'s answer: 503 is an answer (not ready), not an error."""
    body = response.json()
    if response.status_code == 200:
        return Readiness(ready=True, checks=body.get("checks", {}))
    if response.status_code == 503 and isinstance(body.get("error"), dict):
        error = body["error"]
        return Readiness(ready=False, checks=error.get("checks", {}), message=error.get("message"))
    raise error_from_response(response)


def events_path(run_id: str) -> str:
    """The path of the run's event stream."""
    return f"/v1/runs/{segment(run_id)}/events"


def events_headers(after: int) -> dict[str, str]:
    """The headers that resume a run's event stream after event ``after``."""
    return {"Accept": "text/event-stream", "Last-Event-ID": str(after)}


def backoff_s(failures: int) -> float:
    """Seconds to wait before reconnect number ``failures`` (0.2, 0.4, … up to 2)."""
    return float(min(2.0, 0.1 * 2**failures))


def unreachable(url: str, exc: BaseException) -> ServerUnreachable:
    """The error of a request the server did not answer."""
    reason = str(exc) or type(exc).__name__
    return ServerUnreachable(f"could not reach the Moorline server at {url}: {reason}")


def segment(value: str) -> str:
    """``value`` as one path segment: a ``/`` or ``?`` in an id must not change the route."""
    return quote(value, safe="")


# --- the operations ---------------------------------------------------------------------------


def create_tenant(name: str, plan: str) -> Call[TenantCreated]:
    """``POST /v1/admin/tenants``."""
    body = {"name": name, "plan": plan}
    return Call(model=TenantCreated, method="POST", path="/v1/admin/tenants", json=body, admin=True)


def change_plan(tenant_id: str, plan: str) -> Call[Tenant]:
    """``PATCH /v1/admin/tenants/{tenant_id}``."""
    path = f"/v1/admin/tenants/{segment(tenant_id)}"
    return Call(model=Tenant, method="PATCH", path=path, json={"plan": plan}, admin=True)


def list_tenants(*, limit: int | None, cursor: str | None) -> Call[TenantPage]:
    """``GET /v1/admin/tenants``."""
    params = {key: v for key, v in (("limit", limit), ("cursor", cursor)) if v is not None}
    return Call(model=TenantPage, method="GET", path="/v1/admin/tenants", params=params, admin=True)


def list_keys(tenant_id: str) -> Call[ApiKeys]:
    """``GET /v1/admin/tenants/{tenant_id}/keys``."""
    path = f"/v1/admin/tenants/{segment(tenant_id)}/keys"
    return Call(model=ApiKeys, method="GET", path=path, admin=True)


def issue_key(tenant_id: str) -> Call[ApiKeyIssued]:
    """``POST /v1/admin/tenants/{tenant_id}/keys``."""
    path = f"/v1/admin/tenants/{segment(tenant_id)}/keys"
    return Call(model=ApiKeyIssued, method="POST", path=path, admin=True)


def revoke_key(tenant_id: str, key_id: str) -> Call[NoContent]:
    """``DELETE /v1/admin/tenants/{tenant_id}/keys/{key_id}``."""
    path = f"/v1/admin/tenants/{segment(tenant_id)}/keys/{segment(key_id)}"
    return Call(model=NoContent, method="DELETE", path=path, admin=True)


def list_webhooks() -> Call[Webhooks]:
    """``GET /v1/webhooks``."""
    return Call(model=Webhooks, method="GET", path="/v1/webhooks")


def delete_webhook(webhook_id: str) -> Call[NoContent]:
    """``DELETE /v1/webhooks/{webhook_id}``."""
    return Call(model=NoContent, method="DELETE", path=f"/v1/webhooks/{segment(webhook_id)}")


def queues() -> Call[Queues]:
    """``GET /v1/admin/queues``."""
    return Call(model=Queues, method="GET", path="/v1/admin/queues", admin=True)


def workers(status: str | None) -> Call[Workers]:
    """``GET /v1/admin/workers``."""
    params = {} if status is None else {"status": status}
    return Call(model=Workers, method="GET", path="/v1/admin/workers", params=params, admin=True)


def worker(worker_id: str) -> Call[WorkerDetail]:
    """``GET /v1/admin/workers/{worker_id}``."""
    path = f"/v1/admin/workers/{segment(worker_id)}"
    return Call(model=WorkerDetail, method="GET", path=path, admin=True)


def workflows() -> Call[Workflows]:
    """``GET /v1/workflows``."""
    return Call(model=Workflows, method="GET", path="/v1/workflows")


def trigger(
    workflow: str,
    input: JSONObject | None,
    *,
    idempotency_key: str | None,
    conversation_id: str | None,
    delay_seconds: float | None,
) -> Call[RunAccepted]:
    """``POST /v1/workflows/{workflow}/runs``; unset options are left out of the body."""
    body: dict[str, Any] = {"input": input or {}}
    optional = {
        "idempotency_key": idempotency_key,
        "conversation_id": conversation_id,
        "delay_seconds": delay_seconds,
    }
    body.update({key: value for key, value in optional.items() if value is not None})
    path = f"/v1/workflows/{segment(workflow)}/runs"
    return Call(model=RunAccepted, method="POST", path=path, json=body)


MAX_BATCH = 1_000
"""Most items the server takes in one batch trigger; ``trigger_many`` sends this many a call."""

BATCH_FIELDS = frozenset({"input", "idempotency_key", "conversation_id", "delay_seconds"})


def trigger_batch(workflow: str, items: list[dict[str, Any]]) -> Call[BatchAnswer]:
    """``POST /v1/workflows/{workflow}/runs/batch``: ``items`` as the single trigger's bodies."""
    path = f"/v1/workflows/{segment(workflow)}/runs/batch"
    return Call(model=BatchAnswer, method="POST", path=path, json={"runs": items})


def batch_item(item: Mapping[str, Any]) -> dict[str, Any]:
    """A batch item's body: a trigger's body (``input`` and options), unset options left out.

    Raises:
        InvalidInput: a field the trigger's body does not have (caught here, not as a 422
            for the whole batch).
    """
    unknown = set(item) - BATCH_FIELDS
    if unknown:
        known = ", ".join(sorted(BATCH_FIELDS))
        raise InvalidInput(f"batch item: unknown field {sorted(unknown)[0]!r}; fields: {known}")
    body = {key: value for key, value in item.items() if value is not None}
    body.setdefault("input", {})
    return body


def chunks(items: list[dict[str, Any]], size: int) -> list[list[dict[str, Any]]]:
    """``items`` in consecutive slices of ``size`` (the last one shorter)."""
    return [items[start : start + size] for start in range(0, len(items), size)]


def get_run(run_id: str) -> Call[Run]:
    """``GET /v1/runs/{run_id}``."""
    return Call(model=Run, method="GET", path=f"/v1/runs/{segment(run_id)}")


def list_runs(
    filters: Mapping[str, Any], *, limit: int | None, cursor: str | None
) -> Call[RunPage]:
    """``GET /v1/runs`` with :func:`run_filters`' ``filters``; unset ones are left out."""
    params = {**filters, "limit": limit, "cursor": cursor}
    query = {key: value for key, value in params.items() if value is not None}
    return Call(model=RunPage, method="GET", path="/v1/runs", params=query)


def cancel(run_id: str) -> Call[CancelAccepted]:
    """``POST /v1/runs/{run_id}/cancel``."""
    return Call(model=CancelAccepted, method="POST", path=f"/v1/runs/{segment(run_id)}/cancel")


def retry(run_id: str, *, admin: bool = False) -> Call[RunAccepted]:
    """``POST /v1[/admin]/runs/{run_id}/retry``."""
    return Call(
        model=RunAccepted,
        method="POST",
        path=f"{_runs(admin)}/{segment(run_id)}/retry",
        admin=admin,
    )


def rerun(
    run_id: str, *, idempotency_key: str | None = None, admin: bool = False
) -> Call[RerunAccepted]:
    """``POST /v1[/admin]/runs/{run_id}/rerun``, with a body only when a key is given."""
    return Call(
        model=RerunAccepted,
        method="POST",
        path=f"{_runs(admin)}/{segment(run_id)}/rerun",
        json=None if idempotency_key is None else {"idempotency_key": idempotency_key},
        admin=admin,
    )


def start_bulk(
    action: str, filters: Mapping[str, Any], *, idempotency_key: str | None, admin: bool
) -> Call[BulkJob]:
    """``POST /v1[/admin]/runs/bulk/{cancel|retry}`` with the filters that are set."""
    body = {name: value for name, value in filters.items() if value is not None}
    if idempotency_key is not None:
        body["idempotency_key"] = idempotency_key
    return Call(
        model=BulkJob,
        method="POST",
        path=f"{_runs(admin)}/bulk/{segment(action)}",
        json=body,
        admin=admin,
    )


def run_filters(
    *,
    status: RunStatus | str | None = None,
    workflow: str | None = None,
    conversation_id: str | None = None,
    created_after: datetime | None = None,
    created_before: datetime | None = None,
    ids: Sequence[str] | None = None,
    tenant_id: str | None = None,
    run_id: str | None = None,
    input_contains: str | None = None,
) -> dict[str, Any]:
    """The filters of a listing or a bulk request as sent (those that are None are dropped).

    ``run_id`` (an id's start; up to 12 characters, its start or its end among the newest 5,000
    runs the other filters select) and ``input_contains`` (a word of the input, in any case,
    among those newest 5,000 too) are the listing's only.
    """
    return {
        "run_id": run_id,
        "input_contains": input_contains,
        "status": None if status is None else str(status),
        "workflow": workflow,
        "conversation_id": conversation_id,
        "created_after": None if created_after is None else created_after.isoformat(),
        "created_before": None if created_before is None else created_before.isoformat(),
        "ids": None if ids is None else list(ids),
        "tenant_id": tenant_id,
    }


def bulk_job(job_id: str, *, admin: bool = False) -> Call[BulkJob]:
    """``GET /v1[/admin]/runs/bulk/{job_id}``."""
    return Call(
        model=BulkJob, method="GET", path=f"{_runs(admin)}/bulk/{segment(job_id)}", admin=admin
    )


def _runs(admin: bool) -> str:
    return "/v1/admin/runs" if admin else "/v1/runs"


def resume(
    run_id: str, *, approved: bool, interrupt_id: str | None, data: JSONObject | None
) -> Call[Resumed]:
    """``POST /v1/runs/{run_id}/resume``."""
    body: dict[str, Any] = {"approved": approved}
    if interrupt_id is not None:
        body["interrupt_id"] = interrupt_id
    if data is not None:
        body["data"] = data
    return Call(model=Resumed, method="POST", path=f"/v1/runs/{segment(run_id)}/resume", json=body)


def post_message(run_id: str, content: str) -> Call[MessageAccepted]:
    """``POST /v1/runs/{run_id}/messages``."""
    path = f"/v1/runs/{segment(run_id)}/messages"
    return Call(model=MessageAccepted, method="POST", path=path, json={"content": content})


def create_webhook(workflow: str, secret: str | None) -> Call[Webhook]:
    """``POST /v1/webhooks``."""
    body = {"workflow": workflow} if secret is None else {"workflow": workflow, "secret": secret}
    return Call(model=Webhook, method="POST", path="/v1/webhooks", json=body)


def create_schedule(body: Mapping[str, Any]) -> Call[Schedule]:
    """``POST /v1/schedules``; fields left None are not sent (the server's defaults apply)."""
    sent = {name: value for name, value in body.items() if value is not None}
    return Call(model=Schedule, method="POST", path="/v1/schedules", json=sent)


def list_schedules() -> Call[Schedules]:
    """``GET /v1/schedules``."""
    return Call(model=Schedules, method="GET", path="/v1/schedules")


def schedule_call(method: str, schedule_id: str, action: str = "") -> Call[Schedule]:
    """``GET``/``POST /v1/schedules/{schedule_id}[/pause|/resume]``."""
    path = f"/v1/schedules/{segment(schedule_id)}{action}"
    return Call(model=Schedule, method=method, path=path)


def edit_schedule(schedule_id: str, changes: Mapping[str, Any]) -> Call[Schedule]:
    """``PATCH /v1/schedules/{schedule_id}``."""
    path = f"/v1/schedules/{segment(schedule_id)}"
    return Call(model=Schedule, method="PATCH", path=path, json=dict(changes))


def delete_schedule(schedule_id: str) -> Call[NoContent]:
    """``DELETE /v1/schedules/{schedule_id}``."""
    return Call(model=NoContent, method="DELETE", path=f"/v1/schedules/{segment(schedule_id)}")


def usage() -> Call[Usage]:
    """``GET /v1/usage``."""
    return Call(model=Usage, method="GET", path="/v1/usage")
