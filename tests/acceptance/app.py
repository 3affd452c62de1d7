"""The workflow the dashboard test runs in a real ``moorline serve`` (``--app``)."""

from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.types import JSONObject

app = Moorline()


def write_draft(topic: str) -> str:
    """A step's stand-in for an LLM call."""
    return f"Release notes for {topic}: faster claims, live dashboard."


def publish(topic: str) -> str:
    """A step's stand-in for the tool call that needs a human's permission."""
    return f"published {topic}"


@app.workflow("publish_notes", max_attempts=2, timeout=120)
async def publish_notes(ctx: Context, topic: str = "v1.0") -> JSONObject:
    """Draft (streamed as deltas), ask permission to publish, then publish."""

    def drafted(topic: str) -> str:
        # The stand-in model's bill, as a workflow calling a model by other means reports it.
        ctx.record_usage("draft-model", 120, 30)
        return write_draft(topic)

    draft = await ctx.step("draft", drafted, topic)
    for word in str(draft).split(" "):
        await ctx.emit("delta", {"text": word + " "})
    decision = await ctx.request_permission("publish", {"topic": topic}, timeout=120)
    if not decision.approved:
        return {"published": False, "reason": decision.reason}
    receipt = await ctx.step("publish", publish, topic)
    return {"published": True, "receipt": receipt}


@app.workflow("fail_loudly", max_attempts=1)
async def fail_loudly(ctx: Context) -> JSONObject:
    """Fail at once, for the dashboard's traceback."""
    raise RuntimeError("the model answered nonsense")
