"""The example workflows end to end: stored runs, a real Worker, the engine, and a model.

The simulated model (without latency) answers most tests; the OpenAI-compatible client against
the local test server answers where the model's own words matter (verdicts, the request the
endpoint sees) and for a failure in the middle of a document.
"""

from collections import deque

import pytest

from moorline.db.manager import DatabaseManager
from moorline.db.repos.children import ChildrenRepo
from moorline.errors import InvalidInput
from moorline.examples.app import app as default_app
from moorline.examples.doc_check import split_sections
from moorline.llm import SIMULATED_MODEL
from moorline.llm.openai_compat import OpenAICompatibleLLM
from moorline.llm.simulated import PREAMBLE
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.settings import Settings
from moorline.types import JSONObject, JSONValue, RunStatus, TenantId
from tests.examples.conftest import Deployment
from tests.examples.openai_server import Answer, OpenAIServer

DIFF = """\
diff --git a/moorline/reaper.py b/moorline/reaper.py
@@ -10,3 +10,4 @@ def reap(runs):
-    for run in runs:
+    for run in sorted(runs):
+        # TODO: batch this
         requeue(run)
"""


def pull_request(action: str = "opened", *, diff: str | None = DIFF) -> JSONObject:
    """A ``pull_request`` webhook body, with some of the many fields GitHub sends."""
    payload: JSONObject = {
        "action": action,
        "number": 42,
        "pull_request": {
            "number": 42,
            "title": "Reap runs in a stable order",
            "body": "Sorting makes reaper passes reproducible.",
            "html_url": "https://github.com/acme/moorline/pull/42",
            "user": {"login": "octocat", "id": 1},
            "head": {"ref": "stable-reaper", "sha": "abc123"},
            "base": {"ref": "main", "sha": "def456"},
            "additions": 2,
            "deletions": 1,
            "changed_files": 1,
            "mergeable": None,
        },
        "repository": {"full_name": "acme/moorline", "private": False},
        "sender": {"login": "octocat"},
    }
    if diff is not None:
        payload["diff"] = diff
    return payload


def output_of(run_output: JSONValue) -> JSONObject:
    assert isinstance(run_output, dict)
    return run_output


# --- code_review -----------------------------------------------------------------------------


async def test_code_review_streams_a_review_and_posts_the_comment_once_approved(
    deployment: Deployment,
) -> None:
    run_id = await deployment.submit("code_review", payload=pull_request(), event="pull_request")
    async with deployment.serving():
        interrupt = await deployment.pending(run_id)
        # Nothing is posted before the decision.
        assert await deployment.step_keys(run_id) == ["llm_review"]
        assert await deployment.events(run_id, "comment_posted") == []
        await deployment.decide(interrupt, approved=True)
        run = await deployment.finished(run_id)
    assert run.status is RunStatus.SUCCEEDED, run.error
    output = output_of(run.output)
    review = str(output["review"])
    assert review.startswith(PREAMBLE)
    assert (output["model"], output["simulated"]) == (SIMULATED_MODEL, True)
    assert (output["repository"], output["pr"], output["decision"]) == (
        "acme/moorline",
        42,
        "approved",
    )
    assert interrupt.action == "post_comment"
    assert interrupt.data == {"repository": "acme/moorline", "pr": 42, "comment": review}
    # Every word of the review streamed before the step stored it.
    assert await deployment.delta_text(run_id) == review
    assert len(await deployment.events(run_id, "delta")) > 1
    comment = output["comment"]
    assert isinstance(comment, dict)
    key = f"{run_id}:post_comment"
    assert comment["idempotency_key"] == key
    body = str(comment["body"])
    assert body.startswith(review) and f"<!-- moorline-idempotency-key: {key} -->" in body
    assert "Simulated model" in body
    [posted] = await deployment.events(run_id, "comment_posted")
    assert posted.data == comment
    assert await deployment.step_keys(run_id) == ["llm_review", "post_comment"]


async def test_a_denied_review_posts_nothing(deployment: Deployment) -> None:
    run_id = await deployment.submit("code_review", payload=pull_request(diff=None))
    async with deployment.serving():
        await deployment.decide(await deployment.pending(run_id), approved=False)
        run = await deployment.finished(run_id)
    assert run.status is RunStatus.SUCCEEDED, run.error
    output = output_of(run.output)
    assert (output["decision"], output["comment"]) == ("denied", None)
    assert await deployment.step_keys(run_id) == ["llm_review"]
    assert await deployment.events(run_id, "comment_posted") == []


async def test_code_review_skips_deliveries_without_new_code(deployment: Deployment) -> None:
    ping = await deployment.submit(
        "code_review", payload={"zen": "Keep it logically awesome.", "hook_id": 7}, event="ping"
    )
    closed = await deployment.submit(
        "code_review", payload=pull_request("closed"), event="pull_request"
    )
    review_event = await deployment.submit(
        "code_review", payload=pull_request(), event="pull_request_review"
    )
    async with deployment.serving():
        runs = [await deployment.finished(run_id) for run_id in (ping, closed, review_event)]
    assert [run.output for run in runs] == [
        {"skipped": "ping"},
        {"skipped": "action 'closed' brings no new code"},
        {"skipped": "event 'pull_request_review' is not a pull_request"},
    ]
    for run in runs:
        assert await deployment.step_keys(run.run_id) == []


async def test_code_review_through_an_openai_compatible_endpoint(
    db: DatabaseManager, store: InMemoryRuntimeStore, settings: Settings, tenant: TenantId
) -> None:
    chunks = ["- moorline/reaper.py:12 ", "leaves a TODO; ", "sorting costs O(n log n)."]
    async with OpenAIServer(Answer(chunks=chunks)) as server:
        llm = OpenAICompatibleLLM(base_url=server.base_url, model="review-model")
        deployment = Deployment(db, store, settings, tenant, llm)
        try:
            run_id = await deployment.submit(
                "code_review", payload=pull_request(), event="pull_request"
            )
            async with deployment.serving():
                await deployment.decide(await deployment.pending(run_id), approved=True)
                run = await deployment.finished(run_id)
        finally:
            await llm.close()
    assert run.status is RunStatus.SUCCEEDED, run.error
    output = output_of(run.output)
    assert output["review"] == "".join(chunks)
    assert (output["model"], output["simulated"]) == ("review-model", False)
    assert await deployment.delta_text(run_id) == "".join(chunks)
    comment = output["comment"]
    assert isinstance(comment, dict) and "Simulated" not in str(comment["body"])
    [request] = server.requests
    assert request["model"] == "review-model"
    system, user = request["messages"]
    assert system["role"] == "system" and "review" in system["content"]
    prompt = user["content"]
    for fact in ("acme/moorline", "#42: Reap runs in a stable order", "octocat", DIFF):
        assert fact in prompt


# --- doc_check -------------------------------------------------------------------------------

DOCUMENT = """\
Moorline runs workflows durably.

# Install

Run `pip install moorline`.

## Configure

TODO: write this section.

```sh
# not a heading: inside a code block
moorline serve
```
"""


async def test_doc_check_checks_each_section_in_a_child_run(deployment: Deployment) -> None:
    rules: list[JSONValue] = ["Commands are in code blocks.", "No TODO is left."]
    run_id = await deployment.submit("doc_check", document=DOCUMENT, rules=rules, title="README")
    async with deployment.serving():
        run = await deployment.finished(run_id)
    assert run.status is RunStatus.SUCCEEDED, run.error
    output = output_of(run.output)
    sections = output["sections"]
    assert isinstance(sections, list)
    headings = ["(untitled)", "Install", "Configure"]
    assert [s["heading"] for s in sections if isinstance(s, dict)] == headings
    # One child run per section, each with its one checkpointed step.
    children = await ChildrenRepo(deployment.db).list(run_id)
    assert [c.child_key for c in children] == ["section:0", "section:1", "section:2"]
    assert all(c.status is RunStatus.SUCCEEDED for c in children)
    for child in children:
        assert await deployment.step_keys(child.run_id) == ["check"]
    # The simulated model gives no verdict line: every section is reported unclear.
    assert (output["verdict"], output["passed"], output["failed"], output["unclear"]) == (
        "unclear",
        0,
        0,
        3,
    )
    assert (output["title"], output["rules"], output["simulated"]) == ("README", rules, True)
    for index, (section, child) in enumerate(zip(sections, children, strict=True)):
        assert isinstance(section, dict)
        assert await deployment.delta_text(child.run_id, section=index) == section["notes"]
        [checked] = await deployment.events(child.run_id, "section_checked")
        assert checked.data == {"section": index, "heading": headings[index], "verdict": "unclear"}


async def test_doc_check_reads_verdicts_and_rechecks_only_the_section_that_failed(
    db: DatabaseManager, store: InMemoryRuntimeStore, settings: Settings, tenant: TenantId
) -> None:
    async with OpenAIServer() as server:
        # By section: the children ask concurrently, in any order.
        server.by_prompt = {
            "Section '(untitled)'": deque([Answer(chunks=["VERDICT: PASS"])]),
            "Section 'Install'": deque(
                [Answer(chunks=["VERDICT: ", "FAIL\n", "- rule 2: a TODO is left"])]
            ),
            # The first attempt of this section's child fails; its retry passes.
            "Section 'Configure'": deque([Answer(status=400), Answer(chunks=["verdict: pass"])]),
        }
        llm = OpenAICompatibleLLM(base_url=server.base_url, model="doc-model")
        deployment = Deployment(db, store, settings, tenant, llm)
        try:
            run_id = await deployment.submit("doc_check", document=DOCUMENT)
            async with deployment.serving():
                run = await deployment.finished(run_id)
        finally:
            await llm.close()
    assert run.status is RunStatus.SUCCEEDED, run.error
    output = output_of(run.output)
    assert (output["verdict"], output["passed"], output["failed"], output["unclear"]) == (
        "fail",
        2,
        1,
        0,
    )
    sections = output["sections"]
    assert isinstance(sections, list) and isinstance(sections[1], dict)
    assert sections[1]["notes"] == "VERDICT: FAIL\n- rule 2: a TODO is left"
    # Only the section that failed was asked again, by its own child's second attempt.
    children = await ChildrenRepo(db).list(run_id)
    assert [c.attempt for c in children] == [1, 1, 2]
    asked = sorted(request["messages"][1]["content"].split("'")[1] for request in server.requests)
    assert asked == sorted(["(untitled)", "Install", "Configure", "Configure"])


def test_sections_split_at_headings_outside_code_blocks() -> None:
    sections = split_sections(DOCUMENT)
    assert [(s.heading, s.text.splitlines()[0]) for s in sections] == [
        ("(untitled)", "Moorline runs workflows durably."),
        ("Install", "Run `pip install moorline`."),
        ("Configure", "TODO: write this section."),
    ]
    assert "# not a heading" in sections[2].text
    assert [s.heading for s in split_sections("# Title #\n\n#not-a-heading")] == ["Title"]


# --- chat_agent ------------------------------------------------------------------------------


async def test_chat_agent_takes_injected_messages_asks_before_a_tool_and_ends_on_bye(
    deployment: Deployment,
) -> None:
    run_id = await deployment.submit("chat_agent", message="hello", idle_timeout=20)
    ask = "please create a ticket for the flaky login test"
    async with deployment.serving():
        await deployment.step_done(run_id, "llm:1")
        await deployment.post(run_id, ask)
        interrupt = await deployment.pending(run_id)
        assert await deployment.events(run_id, "ticket_created") == []
        await deployment.decide(interrupt, approved=True)
        await deployment.step_done(run_id, "llm:2.1")
        await deployment.post(run_id, "thanks, bye")
        run = await deployment.finished(run_id)
    assert run.status is RunStatus.SUCCEEDED, run.error
    output = output_of(run.output)
    assert (output["ended"], output["turns"]) == ("bye", 2)
    assert interrupt.action == "create_ticket"
    assert interrupt.data == {"tool": "create_ticket", "arguments": {"title": ask}}
    calls = output["tool_calls"]
    assert isinstance(calls, list) and len(calls) == 1
    call = calls[0]
    assert isinstance(call, dict) and call["approved"] is True and call["decision"] == "approved"
    result = call["result"]
    assert isinstance(result, dict) and str(result["ticket"]).startswith("TICKET-")
    assert result["idempotency_key"] == f"{run_id}:tool:2.0.0"
    [created] = await deployment.events(run_id, "ticket_created")
    assert created.data == result
    transcript = output["transcript"]
    assert isinstance(transcript, list)
    roles = [entry["role"] for entry in transcript if isinstance(entry, dict)]
    assert roles == ["user", "assistant", "user", "assistant", "user"]
    assert await deployment.step_keys(run_id) == ["llm:1", "llm:2", "tool:2.0.0", "llm:2.1"]
    # Each reply streamed under its turn; the one after the tool reports its result.
    first_reply = transcript[1]
    assert isinstance(first_reply, dict)
    assert await deployment.delta_text(run_id, turn=1) == first_reply["content"]
    assert str(result["ticket"]) in await deployment.delta_text(run_id, turn=2)


async def test_a_denied_tool_call_runs_nothing_and_the_model_hears_why(
    deployment: Deployment,
) -> None:
    run_id = await deployment.submit(
        "chat_agent", message="Create a ticket: the printer is on fire", max_turns=1
    )
    async with deployment.serving():
        await deployment.decide(await deployment.pending(run_id), approved=False)
        run = await deployment.finished(run_id)
    assert run.status is RunStatus.SUCCEEDED, run.error
    output = output_of(run.output)
    assert (output["ended"], output["turns"]) == ("max_turns", 1)
    calls = output["tool_calls"]
    assert isinstance(calls, list) and len(calls) == 1
    call = calls[0]
    assert isinstance(call, dict) and (call["approved"], call["decision"]) == (False, "denied")
    assert call["result"] == {"error": "the user did not allow this call (denied)"}
    assert await deployment.events(run_id, "ticket_created") == []
    assert await deployment.step_keys(run_id) == ["llm:1", "llm:1.1"]
    assert "did not allow" in await deployment.delta_text(run_id, turn=1)


async def test_chat_agent_ends_when_nobody_writes_or_someone_says_goodbye(
    deployment: Deployment,
) -> None:
    idle = await deployment.submit("chat_agent", message="hi", idle_timeout=0.3)
    early = await deployment.submit("chat_agent", message="Goodbye!")
    async with deployment.serving():
        idle_run, early_run = [await deployment.finished(run_id) for run_id in (idle, early)]
    assert output_of(idle_run.output)["ended"] == "idle_timeout"
    assert output_of(idle_run.output)["turns"] == 1
    assert await deployment.step_keys(idle) == ["llm:1"]
    assert (output_of(early_run.output)["ended"], output_of(early_run.output)["turns"]) == (
        "bye",
        0,
    )
    assert await deployment.step_keys(early) == []


# --- inputs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("workflow", "arguments", "problem"),
    [
        ("code_review", {"payload": {"ref": "refs/heads/main"}, "event": "push"}, "action"),
        ("code_review", {"event": "pull_request"}, "payload: Field required"),
        ("doc_check", {"document": " \n "}, "the document has no text"),
        ("doc_check", {"document": "x", "rules": []}, "rules"),
        ("doc_check", {"document": "x", "rules": ["  "]}, "rules.0"),
        ("doc_check", {"document": "\n".join(f"# {n}" for n in range(51))}, "51 sections"),
        ("chat_agent", {"message": ""}, "message"),
        ("chat_agent", {"message": "hi", "max_turns": 0}, "max_turns"),
        ("chat_agent", {"message": "hi", "idle_timeout": -1}, "idle_timeout"),
        ("chat_agent", {"message": "hi", "tools": []}, "tools"),
    ],
)
def test_bad_inputs_are_refused_before_a_run_is_stored(
    workflow: str, arguments: JSONObject, problem: str
) -> None:
    with pytest.raises(InvalidInput, match=problem):
        default_app.get(workflow).validate_input(arguments)


def test_the_default_app_has_every_example() -> None:
    assert {definition.name for definition in default_app} == {
        "echo",
        "sleep",
        "code_review",
        "doc_check",
        "doc_check_section",
        "chat_agent",
    }
