"""``moorline.Client`` and ``moorline.SyncClient`` pass the same contract tests against a live
deployment (the ``cluster`` of ``conftest.py``: ``moorline serve`` and ``moorline worker``).

Each test runs once per client through :class:`Driver`, which awaits the async client's
methods and runs the sync client's in a thread (so the test's event loop stays free, not
because the sync client needs one).
"""

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from moorline import Client, SyncClient
from moorline.client import Event, Run, ServerUnreachable
from moorline.errors import RunNotRetryable, Unauthorized, WorkflowNotFound
from moorline.types import RunStatus
from tests.api.conftest import ADMIN_TOKEN
from tests.e2e.conftest import Cluster
from tests.e2e.test_e2e import TIMEOUT_S
from tests.helpers import wait_for

AnyClient = Client | SyncClient


class Driver:
    """The same call on either client, awaited."""

    def __init__(self, client: AnyClient) -> None:
        self.client = client

    async def __call__(self, name: str, *args: Any, **kwargs: Any) -> Any:
        method = getattr(self.client, name)
        if isinstance(self.client, SyncClient):
            return await asyncio.to_thread(method, *args, **kwargs)
        return await method(*args, **kwargs)

    async def events(self, run_id: str, after: int = 0) -> list[Event]:
        client = self.client
        if isinstance(client, SyncClient):
            return await asyncio.to_thread(lambda: list(client.events(run_id, after=after)))
        return [event async for event in client.events(run_id, after=after)]

    async def close(self) -> None:
        if isinstance(self.client, SyncClient):
            self.client.close()
        else:
            await self.client.aclose()


@pytest.fixture(params=["async", "sync"])
def kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


@pytest.fixture
async def make(kind: str) -> AsyncIterator[Any]:
    """Build drivers of the parametrized kind; all closed after the test."""
    built: list[Driver] = []

    def build(*args: Any, **kwargs: Any) -> Driver:
        cls = SyncClient if kind == "sync" else Client
        driver = Driver(cls(*args, **kwargs))
        built.append(driver)
        return driver

    yield build
    for driver in built:
        await driver.close()


async def tenant_key(make: Any, cluster: Cluster) -> str:
    admin = make(cluster.url, admin_token=ADMIN_TOKEN)
    created = await admin("create_tenant", f"clients-{uuid.uuid4().hex[:8]}", "team")
    key: str = created.api_key
    return key


async def test_url_and_key_come_from_the_environment(
    cluster: Cluster, make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = await tenant_key(make, cluster)
    monkeypatch.setenv("MOORLINE_URL", cluster.url)
    monkeypatch.setenv("MOORLINE_API_KEY", key)
    client = make()
    assert client.client.url == cluster.url
    usage = await client("usage")
    assert usage.plan == "team"
    # An explicit argument wins over the environment.
    monkeypatch.setenv("MOORLINE_API_KEY", "ml_not-a-key")
    with pytest.raises(Unauthorized):
        await make()("usage")
    assert (await make(cluster.url, key)("usage")).plan == "team"


async def test_trigger_with_wait_returns_the_finished_run(cluster: Cluster, make: Any) -> None:
    client = make(cluster.url, await tenant_key(make, cluster))
    run: Run = await client("trigger", "greet", {"name": "ada"}, wait=True, timeout=TIMEOUT_S)
    assert run.status == RunStatus.SUCCEEDED
    assert run.output == {"greeting": "hello, ada"}
    events = await client.events(run.run_id)
    assert [event.type for event in events][-1] == "succeeded"
    listed = await client("list_runs", workflow="greet")
    assert [summary.run_id for summary in listed.runs] == [run.run_id]
    # Search: by the id's first characters, by a word of the input in any case.
    for found in (
        await client("list_runs", run_id=run.run_id[:8]),
        await client("list_runs", input_contains="ADA"),
    ):
        assert [summary.run_id for summary in found.runs] == [run.run_id]
    assert (await client("list_runs", input_contains="grace")).runs == []
    assert (await client("usage")).tenant_name is not None
    assert {item.name for item in await client("workflows")} >= {"greet", "publish"}


async def test_wait_times_out_then_sees_the_end(cluster: Cluster, make: Any) -> None:
    client = make(cluster.url, await tenant_key(make, cluster))
    accepted = await client("trigger", "wait", {})
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await client("wait", accepted.run_id, timeout=0.5)
    assert time.monotonic() - started < 3.0  # the bound, not a reconnect loop after it
    await client("cancel", accepted.run_id)
    run = await client("wait", accepted.run_id, timeout=TIMEOUT_S)
    assert run.status == RunStatus.CANCELLED


async def test_approve_sends_data_to_the_workflow(cluster: Cluster, make: Any) -> None:
    client = make(cluster.url, await tenant_key(make, cluster))
    accepted = await client("trigger", "publish", {"draft": "v1"})

    async def asked() -> Run | None:
        run: Run = await client("get_run", accepted.run_id)
        return run if run.pending_interrupt is not None else None

    paused = await wait_for(asked, timeout_s=TIMEOUT_S, message="the permission request")
    assert paused is not None and paused.pending_interrupt is not None
    assert paused.pending_interrupt.data == {"draft": "v1"}
    await client("approve", accepted.run_id, data={"draft": "v2, edited"})
    run = await client("wait", accepted.run_id, timeout=TIMEOUT_S)
    assert run.output == {"approved": True, "data": {"draft": "v2, edited"}}


async def test_errors_are_the_same_classes(cluster: Cluster, make: Any) -> None:
    client = make(cluster.url, await tenant_key(make, cluster))
    with pytest.raises(WorkflowNotFound):
        await client("trigger", "no-such-workflow", {})
    with pytest.raises(ServerUnreachable):
        await make("http://127.0.0.1:1", "ml_x")("usage")
    assert await client("healthz") is True
    assert (await client("readyz")).ready


async def test_keys_are_rotated_and_webhooks_managed(cluster: Cluster, make: Any) -> None:
    admin = make(cluster.url, admin_token=ADMIN_TOKEN)
    created = await admin("create_tenant", f"rotate-{uuid.uuid4().hex[:8]}", "team")
    issued = await admin("issue_key", created.tenant_id)
    keys = await admin("list_keys", created.tenant_id)
    assert [key.key_id for key in keys][-1] == issued.key_id
    await admin("revoke_key", created.tenant_id, keys[0].key_id)
    # The serving process revoked it: refused at once there.
    with pytest.raises(Unauthorized):
        await make(cluster.url, created.api_key)("usage")
    client = make(cluster.url, issued.api_key)
    assert (await client("usage")).plan == "team"
    page = await admin("list_tenants")
    assert created.tenant_id in {tenant.tenant_id for tenant in page.tenants}

    hook = await client("create_webhook", "greet")
    assert [listed.webhook_id for listed in await client("list_webhooks")] == [hook.webhook_id]
    await client("delete_webhook", hook.webhook_id)
    assert await client("list_webhooks") == []


# --- retry, re-run and bulk retry (both clients, then the CLI) ------------------------------


async def failed(client: Any) -> Run:
    run: Run = await client("trigger", "explode", {}, wait=True, timeout=TIMEOUT_S)
    assert run.status == RunStatus.FAILED
    return run


async def test_retry_rerun_and_bulk_retry_through_the_clients(cluster: Cluster, make: Any) -> None:
    client = make(cluster.url, await tenant_key(make, cluster))
    run = await failed(client)

    retried = await client("retry", run.run_id)
    assert retried.run_id == run.run_id
    again: Run = await client("wait", run.run_id, timeout=TIMEOUT_S)
    assert (again.status, again.attempt) == (RunStatus.FAILED, 2)  # one more: a fresh budget
    try:
        await client("retry", (await client("trigger", "greet", {"name": "x"})).run_id)
    except RunNotRetryable as exc:
        assert exc.code == "run_not_retryable"
    else:  # pragma: no cover - the assertion's message
        raise AssertionError("a queued run was retried")
    rerun = await client("rerun", run.run_id, idempotency_key="again")
    assert rerun.rerun_of == run.run_id
    assert (await client("get_run", rerun.run_id)).rerun_of == run.run_id
    repeated = await client("rerun", run.run_id, idempotency_key="again")
    assert repeated.run_id == rerun.run_id
    only = await client("list_runs", ids=[rerun.run_id, run.run_id])
    assert {summary.run_id for summary in only.runs} == {rerun.run_id, run.run_id}

    others = list(await asyncio.gather(*(failed(client) for _ in range(2))))
    key = uuid.uuid4().hex
    job = await client("bulk_retry", idempotency_key=key, ids=[r.run_id for r in others])
    twice = await client("bulk_retry", idempotency_key=key, ids=[r.run_id for r in others])
    assert twice.job_id == job.job_id and job.total == 2

    async def finished() -> Any:
        found = await client("bulk_job", job.job_id)
        return found if found.is_finished else None

    done = await wait_for(finished, timeout_s=TIMEOUT_S, message="the bulk job")
    assert (done.done, done.failed) == (2, 0)
    for other in others:
        ended: Run = await client("wait", other.run_id, timeout=TIMEOUT_S)
        assert ended.attempt == 2  # retried once, though asked twice


async def test_the_cli_retries_reruns_and_follows_a_bulk_retry(cluster: Cluster) -> None:
    async with Client(cluster.url, admin_token=ADMIN_TOKEN) as admin:
        key = (await admin.create_tenant(f"cli-{uuid.uuid4().hex[:8]}", "team")).api_key
    client = Driver(Client(cluster.url, key))
    try:
        await cli_retry_rerun_and_bulk(cluster, client, key)
    finally:
        await client.close()


async def cli_retry_rerun_and_bulk(cluster: Cluster, client: Driver, key: str) -> None:
    run = await failed(client)

    retried = cluster.cli("retry", run.run_id, "--json", MOORLINE_API_KEY=key)
    assert retried.returncode == 0, retried.stderr
    assert json.loads(retried.stdout)["status"] == "queued"
    rerun = cluster.cli(
        "rerun", run.run_id, "--json", "--idempotency-key", "k", MOORLINE_API_KEY=key
    )
    assert rerun.returncode == 0 and json.loads(rerun.stdout)["rerun_of"] == run.run_id
    again = cluster.cli("rerun", run.run_id, "--idempotency-key", "k", MOORLINE_API_KEY=key)
    assert again.returncode == 0 and f"re-run of {run.run_id}" in again.stdout
    assert json.loads(rerun.stdout)["run_id"] in again.stdout
    listed = cluster.cli(
        "runs", "--id", run.run_id, "--created-after", "2020-01-01", MOORLINE_API_KEY=key
    )
    assert listed.returncode == 0 and run.run_id in listed.stdout
    assert json.loads(rerun.stdout)["run_id"] not in listed.stdout
    await client("wait", run.run_id, timeout=TIMEOUT_S)
    bulk = cluster.cli("bulk", "retry", "--id", run.run_id, MOORLINE_API_KEY=key)
    assert bulk.returncode == 0, bulk.stderr
    assert "finished, 1 done, 0 failed of 1" in bulk.stdout  # after the progress bar
    refused = cluster.cli("bulk", "cancel", MOORLINE_API_KEY=key)
    assert refused.returncode == 1 and refused.stderr.startswith("error: invalid_request:")
    assert len(refused.stderr.strip().splitlines()) == 1
