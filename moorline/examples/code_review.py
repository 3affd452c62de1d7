"""``code_review``: a GitHub pull request, reviewed by a model, commented on with permission.

Seed 003's scenario. A webhook (``POST /v1/hooks/{id}``, see docs/api.md) starts the run with the
input ``{"payload": <pull_request event body>, "event": <X-GitHub-Event>}``; the payload is
validated at the trigger against :class:`PullRequestEvent` (or a webhook's ``ping``), so a
delivery this workflow cannot use is refused with 422 and nothing is stored.

The run then:

1. skips what needs no review (a ping, another event, a PR closed or labelled) and returns;
2. asks the model for a review in the checkpointed step ``llm_review``, streaming its text as
   ``delta`` events — a run that resumes after a crash gets the stored review, not a second
   model bill;
3. asks permission ``post_comment`` with the comment to be posted;
4. if approved, posts the comment in the step ``post_comment``. The post is simulated (an
   event ``comment_posted`` and a log line), but it does what a real one must: it carries
   ``ctx.idempotency_key()``, the same on every attempt, as a hidden marker in the comment,
   so a poster that died after posting and before the checkpoint can find its comment instead
   of posting a second one.

The diff comes from the payload: GitHub's ``pull_request`` event carries the PR's description
and sizes but no diff, so a sender may add a top-level ``diff`` field (as seed 003's example
does); without one the model reviews what the description says. Nothing is fetched.
"""

import hashlib
import logging

from pydantic import BaseModel

from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.llm import LLM, Message, Reply, complete
from moorline.types import JSONObject

logger = logging.getLogger(__name__)

REVIEWED_ACTIONS = frozenset({"opened", "reopened", "synchronize", "ready_for_review"})
"""``pull_request`` actions that bring new code to review; the others are skipped."""

MAX_DIFF_CHARS = 60_000
"""Characters of the diff put into the prompt; the rest is cut off, and the prompt says so."""

SYSTEM_PROMPT = (
    "You review GitHub pull requests as a careful senior engineer. List the problems that "
    "matter most first: bugs, risky changes, missing tests, unclear names. Cite the file and "
    "line where you can. Use at most ten short bullet points. If the change looks good, say so "
    "in one sentence."
)


class GitHubUser(BaseModel):
    """A GitHub account, by its login."""

    login: str


class GitRef(BaseModel):
    """A branch of a pull request (``head`` or ``base``)."""

    ref: str
    sha: str | None = None


class PullRequest(BaseModel):
    """The fields of GitHub's ``pull_request`` object that a review uses (others are dropped)."""

    number: int
    title: str
    body: str | None = None
    html_url: str | None = None
    user: GitHubUser | None = None
    head: GitRef | None = None
    base: GitRef | None = None
    additions: int | None = None
    deletions: int | None = None
    changed_files: int | None = None


class Repository(BaseModel):
    """The repository of the pull request, as ``owner/name``."""

    full_name: str


class PullRequestEvent(BaseModel):
    """The body of GitHub's ``pull_request`` webhook event, as far as a review needs it.

    Attributes:
        diff: Not GitHub's: the PR's unified diff, for senders that include it.
    """

    action: str
    pull_request: PullRequest
    repository: Repository
    diff: str | None = None


class Ping(BaseModel):
    """The ``ping`` GitHub sends when a webhook is created."""

    zen: str
    hook_id: int


def review_prompt(event: PullRequestEvent) -> str:
    """What the model is told about the pull request: who, what, how big, and the diff."""
    pr = event.pull_request
    lines = [
        f"Repository: {event.repository.full_name}",
        f"Pull request #{pr.number}: {pr.title}",
    ]
    if pr.user is not None:
        lines.append(f"Author: {pr.user.login}")
    if pr.head is not None and pr.base is not None:
        lines.append(f"Branch: {pr.head.ref} into {pr.base.ref}")
    if pr.additions is not None and pr.deletions is not None:
        lines.append(f"Size: +{pr.additions} -{pr.deletions} in {pr.changed_files or '?'} files")
    lines += ["", "Description:", (pr.body or "").strip() or "(none)", ""]
    if event.diff:
        diff = event.diff[:MAX_DIFF_CHARS]
        cut = len(event.diff) - len(diff)
        lines += ["Diff:", "```diff", diff, "```"]
        if cut:
            lines.append(f"(The diff was cut off here; {cut} more characters were left out.)")
    else:
        lines.append("The webhook carried no diff: review what the description says.")
    return "\n".join(lines)


def comment_body(review: str, model: str, simulated: bool, idempotency_key: str) -> str:
    """The comment as posted: the review, who wrote it, and the hidden idempotency marker."""
    footer = f"Reviewed by {model} through Moorline."
    if simulated:
        footer += " (Simulated model: this review was not written by a real model.)"
    return f"{review}\n\n---\n_{footer}_\n<!-- moorline-idempotency-key: {idempotency_key} -->"


def _skip_reason(payload: PullRequestEvent, event: str | None) -> str | None:
    if event is not None and event != "pull_request":
        return f"event {event!r} is not a pull_request"
    if payload.action not in REVIEWED_ACTIONS:
        return f"action {payload.action!r} brings no new code"
    return None


def register(app: Moorline, llm: LLM) -> None:
    """Register ``code_review`` on ``app``, asking ``llm``."""

    @app.workflow("code_review", timeout=1800)
    async def code_review(
        ctx: Context, payload: PullRequestEvent | Ping, event: str | None = None
    ) -> JSONObject:
        """Review a pull request from its webhook payload; comment once a person approves."""
        if isinstance(payload, Ping):
            return {"skipped": "ping"}
        skipped = _skip_reason(payload, event)
        if skipped is not None:
            return {"skipped": skipped}
        repository, number = payload.repository.full_name, payload.pull_request.number

        async def ask_review(prompt: str) -> JSONObject:
            messages = [Message.system(SYSTEM_PROMPT), Message.user(prompt)]
            reply = await complete(llm, messages, emit=ctx.emit)
            return reply.to_json()

        async def post_comment(review: str, model: str, simulated: bool) -> JSONObject:
            key = ctx.idempotency_key()
            body = comment_body(review, model, simulated, key)
            comment_id = "sim-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]
            # Simulated: a real poster would first look for a comment carrying ``key`` on the
            # PR (an earlier attempt may have posted it), and post only if there is none.
            logger.info(
                "simulated comment %s on %s#%d (idempotency key %s)",
                comment_id,
                repository,
                number,
                key,
                extra={"run_id": ctx.run_id, "attempt": ctx.attempt, "tenant_id": ctx.tenant_id},
            )
            posted: JSONObject = {
                "comment_id": comment_id,
                "repository": repository,
                "pr": number,
                "idempotency_key": key,
                "body": body,
            }
            await ctx.emit("comment_posted", posted)
            return posted

        review = Reply.from_json(await ctx.step("llm_review", ask_review, review_prompt(payload)))
        decision = await ctx.request_permission(
            "post_comment", {"repository": repository, "pr": number, "comment": review.text}
        )
        comment = None
        if decision.approved:
            comment = await ctx.step(
                "post_comment", post_comment, review.text, review.model, review.simulated
            )
        return {
            "repository": repository,
            "pr": number,
            "review": review.text,
            "model": review.model,
            "simulated": review.simulated,
            "decision": decision.reason,
            "comment": comment,
        }
