"""End to end: real ``moorline serve`` and ``moorline worker`` processes, driven only through
``moorline.Client`` and the ``moorline`` CLI (see ``conftest.py``).

On SQLite without Redis: tenant creation, a run followed to its end (client and CLI), a
permission approved with ``moorline approve``, a cancel with ``moorline cancel``, and the
exit codes and one-line errors of failures. On PostgreSQL with Redis: the same paths through
the client, and messages injected into a chat run with ``moorline inject``. (Without Redis
the API process cannot see that another process's workflow is executing, so it refuses
messages with ``run_not_interactive``: injection needs Redis once the worker is separate.)

A CLI process costs seconds of CPU to start on a loaded machine, so each path runs the CLI
where it is the subject and the client elsewhere.
"""

import json
import subprocess
import uuid
from collections.abc import AsyncIterator

from moorline import Client
from moorline.client import Event, Run
from moorline.errors import RunFinished, RunNotFound, Unauthorized, WorkflowNotFound
from moorline.types import RunStatus
from tests.api.conftest import ADMIN_TOKEN
from tests.e2e.conftest import Cluster
from tests.helpers import wait_for
from tests.integration.test_cli import assert_one_line_error

TIMEOUT_S = 20.0


async def new_tenant(cluster: Cluster) -> str:
    """A new tenant's API key, created through the admin API."""
    async with Client(cluster.url, admin_token=ADMIN_TOKEN) as admin:
        tenant = await admin.create_tenant(f"e2e-{uuid.uuid4().hex[:8]}", "team")
    assert tenant.api_key and tenant.plan == "team"
    return tenant.api_key


async def follow(client: Client, run_id: str) -> list[Event]:
    """Every event of the run, to its terminal one."""
    return [event async for event in client.events(run_id)]


async def wait_until(client: Client, run_id: str, status: RunStatus) -> Run:
    async def reached() -> Run | None:
        run = await client.get_run(run_id)
        return run if run.status == status else None

    found = await wait_for(reached, timeout_s=TIMEOUT_S, message=f"run {run_id} {status}")
    assert found is not None
    return found


async def wait_for_interrupt(client: Client, run_id: str) -> Run:
    async def paused() -> Run | None:
        run = await client.get_run(run_id)
        return run if run.pending_interrupt is not None else None

    found = await wait_for(paused, timeout_s=TIMEOUT_S, message=f"run {run_id} to ask")
    assert found is not None
    return found


def cli_as(cluster: Cluster, key: str, *args: str) -> subprocess.CompletedProcess[str]:
    return cluster.cli(*args, MOORLINE_API_KEY=key)


# --- SQLite, no Redis ----------------------------------------------------------------------


async def test_admin_and_service_routes_answer_through_the_client(cluster: Cluster) -> None:
    async with Client(cluster.url, admin_token=ADMIN_TOKEN) as admin:
        tenant = await admin.create_tenant(f"e2e-{uuid.uuid4().hex[:8]}", "sandbox")
        moved = await admin.change_plan(tenant.tenant_id, "team")
        lanes = {lane.lane for lane in await admin.queues()}
        assert await admin.healthz()
        ready = await admin.readyz()
    assert (moved.tenant_id, moved.plan) == (tenant.tenant_id, "team")
    assert "workflow_team" in lanes
    assert ready.ready and ready.checks == {"database": "ok"}
    async with Client(cluster.url, tenant.api_key) as client:
        hook = await client.create_webhook("greet")
        usage = await client.usage()
    assert hook.url.endswith(hook.webhook_id) and len(hook.secret) >= 16
    assert (usage.plan, usage.used_today, usage.remaining) == ("team", 0, usage.daily_quota)


async def test_a_run_is_followed_to_its_end_through_the_client(cluster: Cluster) -> None:
    key = await new_tenant(cluster)
    async with Client(cluster.url, key) as client:
        accepted = await client.trigger("greet", {"name": "ada"}, idempotency_key="greet-1")
        again = await client.trigger("greet", {"name": "ada"}, idempotency_key="greet-1")
        assert again.run_id == accepted.run_id
        events = await follow(client, accepted.run_id)
        # Resuming after the third event replays exactly the rest.
        tail = [event async for event in client.events(accepted.run_id, after=events[2].seq)]
        run = await client.get_run(accepted.run_id)
        listed = [summary.run_id async for summary in client.iter_runs(page_size=1)]
        usage = await client.usage()
    types = [event.type for event in events]
    assert types[-1] == "succeeded" and "started" in types, types
    deltas = [event.data["text"] for event in events if event.type == "delta"]  # type: ignore[index,call-overload]
    assert deltas == ["hello, ", "ada"]
    assert [event.seq for event in events] == sorted({event.seq for event in events})
    assert tail == events[3:]
    assert run.status == RunStatus.SUCCEEDED
    assert run.output == {"greeting": "hello, ada"}
    assert [step.key for step in run.steps] == ["say"]
    assert listed == [accepted.run_id]
    assert usage.used_today == 1


async def test_cli_creates_a_tenant_and_submit_follow_prints_the_output(cluster: Cluster) -> None:
    created = cluster.cli(
        "tenants", "create", "cli-tenant", "--plan", "team", "--json",
        MOORLINE_ADMIN_TOKEN=ADMIN_TOKEN,
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    key = json.loads(created.stdout)["api_key"]

    followed = cli_as(cluster, key, "submit", "greet", "--input", '{"name": "cli"}', "--follow")
    assert followed.returncode == 0, followed.stderr
    assert "hello, cli" in followed.stdout
    assert '"greeting": "hello, cli"' in followed.stdout

    listed = cli_as(cluster, key, "runs", "--workflow", "greet", "--json")
    assert listed.returncode == 0, listed.stderr
    [run] = json.loads(listed.stdout)["runs"]
    assert run["status"] == "succeeded"


async def test_a_permission_is_approved_with_the_cli(cluster: Cluster) -> None:
    key = await new_tenant(cluster)
    async with Client(cluster.url, key) as client:
        accepted = await client.trigger("deploy", {"target": "prod"})
        paused = await wait_for_interrupt(client, accepted.run_id)
        assert paused.pending_interrupt is not None
        assert paused.pending_interrupt.data == {"target": "prod"}
        approved = cli_as(cluster, key, "approve", accepted.run_id)
        assert approved.returncode == 0, approved.stderr
        events = await follow(client, accepted.run_id)
        run = await client.get_run(accepted.run_id)
    assert events[-1].type == "succeeded"
    assert run.output == {"deployed": True, "reason": "approved"}


async def test_a_running_run_is_cancelled_with_the_cli(cluster: Cluster) -> None:
    key = await new_tenant(cluster)
    async with Client(cluster.url, key) as client:
        accepted = await client.trigger("wait")
        await wait_until(client, accepted.run_id, RunStatus.RUNNING)
        cancelled = cli_as(cluster, key, "cancel", accepted.run_id, "--json")
        assert cancelled.returncode == 0, cancelled.stderr
        assert json.loads(cancelled.stdout)["run_id"] == accepted.run_id
        events = await follow(client, accepted.run_id)
        assert events[-1].type == "cancelled"
        try:
            await client.cancel(accepted.run_id)
        except RunFinished as exc:
            assert exc.status == 409 and exc.code == "run_finished"
        else:
            raise AssertionError("a second cancel of a finished run was accepted")


async def _until(stream: AsyncIterator[Event], event_type: str) -> AsyncIterator[Event]:
    """The stream's events up to the first of ``event_type``; the stream stays open."""
    async for event in stream:
        yield event
        if event.type == event_type:
            return


async def test_failures_are_one_line_errors_with_a_non_zero_exit(cluster: Cluster) -> None:
    key = await new_tenant(cluster)
    assert_one_line_error(
        cli_as(cluster, key, "submit", "no_such_workflow"), "error: workflow_not_found:"
    )
    failed = cli_as(cluster, key, "submit", "explode", "--follow")
    assert failed.returncode == 2, failed.stdout + failed.stderr
    assert "failed" in failed.stdout
    async with Client(cluster.url, key) as client:
        try:
            await client.trigger("no_such_workflow")
        except WorkflowNotFound as exc:
            assert exc.status == 404 and "no_such_workflow" in exc.message
        else:
            raise AssertionError("an unknown workflow was accepted")
    async with Client(cluster.url, "wrong-key") as stranger:
        try:
            await stranger.get_run("whatever")
        except Unauthorized:
            pass
        else:
            raise AssertionError("a wrong key was accepted")


# --- PostgreSQL and Redis ------------------------------------------------------------------


async def test_the_client_drives_every_path_on_postgres_and_redis(pg_cluster: Cluster) -> None:
    key = await new_tenant(pg_cluster)
    async with Client(pg_cluster.url, key) as client:
        greeted = await client.trigger("greet", {"name": "pg"})
        events = await follow(client, greeted.run_id)
        assert events[-1].type == "succeeded"
        assert (await client.get_run(greeted.run_id)).output == {"greeting": "hello, pg"}

        deploy = await client.trigger("deploy", {"target": "staging"})
        await wait_for_interrupt(client, deploy.run_id)
        await client.deny(deploy.run_id)
        await follow(client, deploy.run_id)
        assert (await client.get_run(deploy.run_id)).output == {
            "deployed": False,
            "reason": "denied",
        }

        waiting = await client.trigger("wait")
        await wait_until(client, waiting.run_id, RunStatus.RUNNING)
        await client.cancel(waiting.run_id)
        assert (await follow(client, waiting.run_id))[-1].type == "cancelled"

        try:
            await client.get_run("no-such-run")
        except RunNotFound as exc:
            assert exc.code == "run_not_found"
        else:
            raise AssertionError("an unknown run was found")


async def test_messages_are_injected_into_a_chat_with_the_cli_and_the_client(
    pg_cluster: Cluster,
) -> None:
    key = await new_tenant(pg_cluster)
    async with Client(pg_cluster.url, key) as client:
        accepted = await client.trigger("chat", conversation_id="c-1")
        stream = client.events(accepted.run_id)
        seen = [event async for event in _until(stream, "ready")]
        injected = cli_as(pg_cluster, key, "inject", accepted.run_id, "hi there")
        assert injected.returncode == 0, injected.stderr
        await client.post_message(accepted.run_id, "bye")
        seen += [event async for event in stream]
        run = await client.get_run(accepted.run_id)
    assert run.output == {"transcript": ["hi there", "bye"]}
    assert [event.type for event in seen].count("message_received") == 2
    assert seen[-1].type == "succeeded"
