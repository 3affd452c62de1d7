"""What model calls report (``moorline.llm.usage``), and a step's usage stored with it.

The simulated model reports a deterministic count; the OpenAI-compatible client asks the test
server for the usage in the stream's final chunk and reports what the server counted (cached
tokens included). A call that fails is reported as failed. ``ctx.record_usage`` counts a call
made by other means, inside a step only; a replayed step's usage counts as saved.
"""

import math
from contextlib import aclosing

import httpx
import pytest

from moorline.db.manager import DatabaseManager
from moorline.db.repos.runs import RunsRepo
from moorline.engine.context import Context, NotInStep
from moorline.llm import SIMULATED_MODEL, LLMRejected, LLMUnavailable, Message, complete
from moorline.llm.openai_compat import OpenAICompatibleLLM
from moorline.llm.simulated import SimulatedLLM, simulated_usage
from moorline.llm.usage import Usage, metering, report
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.settings import Settings
from moorline.types import RunStatus, TenantId
from tests.examples.conftest import Deployment, fast_model
from tests.examples.openai_server import Answer, Limits, OpenAIServer
from tests.helpers import wait_for

FAST = SimulatedLLM(first_token_s=0, word_interval_s=0)
CHAT = [Message.system("You review code."), Message.user("Is this diff safe to merge?")]


def test_usage_outside_a_metering_scope_goes_nowhere() -> None:
    assert report(Usage(model="m", prompt_tokens=1)) is False
    with metering() as calls:
        assert report(Usage(model="m", prompt_tokens=1)) is True
        with metering() as inner:
            report(Usage(model="n"))
    assert [call.model for call in calls] == ["m"] and [call.model for call in inner] == ["n"]


async def test_the_simulated_model_reports_a_deterministic_usage() -> None:
    with metering() as calls:
        reply = await complete(FAST, CHAT, min_interval_s=0)
    [usage] = calls
    assert usage == simulated_usage(CHAT)
    assert usage.model == SIMULATED_MODEL and usage.ok
    expected_prompt = sum(max(1, math.ceil(len(m.content) / 4)) for m in CHAT)
    assert usage.prompt_tokens == expected_prompt
    assert usage.completion_tokens == len(reply.text.split())
    # A stream left early is reported as a failed call.
    with metering() as calls:
        async with aclosing(FAST.stream(CHAT)) as stream:
            async for _ in stream:
                break
    assert [call.ok for call in calls] == [False]


async def test_the_client_reports_the_usage_the_server_counted() -> None:
    async with OpenAIServer(Answer(chunks=["Fine ", "to ", "merge."])) as server:
        llm = OpenAICompatibleLLM(base_url=server.base_url, model="m1", max_retries=0)
        try:
            with metering() as calls:
                await complete(llm, CHAT, min_interval_s=0)
                await complete(llm, CHAT, min_interval_s=0)  # the system prompt is cached now
        finally:
            await llm.close()
    assert all(r["stream_options"] == {"include_usage": True} for r in server.requests)
    served = server.served["m1"]
    assert served.requests == 2 and [call.ok for call in calls] == [True, True]
    assert sum(call.prompt_tokens for call in calls) == served.prompt_tokens
    assert sum(call.completion_tokens for call in calls) == served.completion_tokens == 6
    assert [call.cached_tokens for call in calls] == [0, math.ceil(len(CHAT[0].content) / 4)]
    assert served.cached_tokens == calls[1].cached_tokens


async def test_a_failed_call_is_reported_failed() -> None:
    async with OpenAIServer(Answer(status=400)) as server:
        llm = OpenAICompatibleLLM(base_url=server.base_url, model="m1", max_retries=0)
        try:
            with metering() as calls, pytest.raises(LLMRejected):
                await complete(llm, CHAT)
        finally:
            await llm.close()
    assert calls == [Usage(model="m1", ok=False)]


async def test_the_server_enforces_its_per_minute_limits_with_retry_after() -> None:
    async with OpenAIServer(Answer(chunks=["ok"])) as server:
        server.limits["m1"] = Limits(rpm=2)
        llm = OpenAICompatibleLLM(base_url=server.base_url, model="m1", max_retries=0)
        try:
            await complete(llm, CHAT)
            await complete(llm, CHAT)
            with pytest.raises(LLMUnavailable, match="429"):
                await complete(llm, CHAT)
        finally:
            await llm.close()
    assert (server.served["m1"].requests, server.served["m1"].rejected) == (2, 1)
    assert int(server.last_retry_after or 0) >= 1


async def test_a_non_streaming_request_gets_one_completion_with_usage() -> None:
    async with OpenAIServer(Answer(chunks=["a", "b"])) as server:
        async with httpx.AsyncClient() as client:
            response = await client.post(
                f"{server.base_url}/chat/completions",
                json={"model": "m2", "messages": [{"role": "user", "content": "hi"}]},
            )
    body = response.json()
    assert body["choices"][0]["message"]["content"] == "ab"
    assert body["usage"]["completion_tokens"] == 2 == server.served["m2"].completion_tokens


async def test_record_usage_counts_inside_a_step_and_replays_count_as_saved(
    db: DatabaseManager, store: InMemoryRuntimeStore, settings: Settings, tenant: TenantId
) -> None:
    deployment = Deployment(db, store, settings, tenant, fast_model())
    outside: list[str] = []

    @deployment.app.workflow("counted", max_attempts=2)
    async def counted(ctx: Context) -> int:
        def call_other_client() -> str:
            ctx.record_usage("other-model", 100, 10, cached_tokens=40)
            return "answer"

        await ctx.step("call", call_other_client)
        try:
            ctx.record_usage("other-model", 1, 1)
        except NotInStep as exc:
            outside.append(str(exc))
        if ctx.attempt == 1:
            raise RuntimeError("fail once, after the step")
        return ctx.attempt

    run_id = await deployment.submit("counted")
    async with deployment.serving():
        run = await deployment.finished(run_id)
    assert run.status is RunStatus.SUCCEEDED, run.error
    stored = await RunsRepo(db).get(run_id)
    assert stored is not None
    assert (stored.prompt_tokens, stored.completion_tokens, stored.cached_tokens) == (100, 10, 40)
    # The second attempt replayed the step: its 110 tokens were saved, not spent again.
    assert stored.saved_tokens == 110
    assert outside and "inside a step" in outside[0]
    [step] = [s for s in await deployment.steps.list(run_id) if s.key == "call"]
    assert step.usage["other-model"].requests == 1


async def test_an_attempt_that_replays_then_parks_writes_its_savings_before_parking(
    db: DatabaseManager, store: InMemoryRuntimeStore, settings: Settings, tenant: TenantId
) -> None:
    quick = settings.model_copy(update={"park_after": 0.2})
    deployment = Deployment(db, store, quick, tenant, fast_model())

    @deployment.app.workflow("turns", max_attempts=1)
    async def turns(ctx: Context) -> list[str | None]:
        def call() -> str:
            ctx.record_usage("chat-model", 10, 5)
            return "answer"

        await ctx.step("call", call)
        return [await ctx.wait_for_message(), await ctx.wait_for_message()]

    run_id = await deployment.submit("turns")
    runs = RunsRepo(db)

    async def parked_in(attempt: int) -> bool:
        run = await runs.get(run_id)
        return run is not None and run.status is RunStatus.WAITING and run.attempt == attempt

    async with deployment.serving():
        await wait_for(lambda: parked_in(1), message="the first park")
        await deployment.post(run_id, "one")
        # The second attempt replays the call (15 tokens saved), then parks again.
        await wait_for(lambda: parked_in(2), message="the second park")
        parked = await runs.get(run_id)
        assert parked is not None and parked.saved_tokens == 15
        await deployment.post(run_id, "two")
        run = await deployment.finished(run_id)
    assert run.status is RunStatus.SUCCEEDED, run.error
    assert run.output == ["one", "two"]
    assert (run.prompt_tokens, run.completion_tokens, run.saved_tokens) == (10, 5, 30)
