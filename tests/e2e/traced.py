"""``moorline`` with traces kept in memory, for the trace test: ``python -m tests.e2e.traced``.

The SDK's tracer provider with its in-memory exporter is installed before the CLI starts (as
``opentelemetry-instrument`` would install one), so the process records real spans; at exit
they are written as JSON lines to ``$TRACE_SPANS_FILE`` for the test to read. Also the app the
test triggers: ``traced``, two steps, the second asking the simulated model.
"""

import atexit
import json
import os
import sys
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.llm.base import Message
from moorline.llm.simulated import SimulatedLLM
from moorline.llm.streaming import complete
from moorline.observability import tracing
from moorline.settings import Settings
from moorline.types import JSONObject

app = Moorline(Settings())


@app.workflow("traced")
async def traced(ctx: Context, topic: str) -> JSONObject:
    """A step, then a step that asks the (simulated, instant) model."""

    def prepare() -> str:
        return f"Say something about {topic}."

    async def ask(prompt: str) -> str:
        llm = SimulatedLLM(first_token_s=0, word_interval_s=0)
        return (await complete(llm, [Message.user(prompt)])).text

    prompt = await ctx.step("prepare", prepare)
    return {"answer": await ctx.step("ask", ask, prompt)}


def span_record(span: ReadableSpan) -> dict[str, object]:
    """The fields the test checks of one finished span."""
    context, parent = span.context, span.parent
    assert context is not None
    return {
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_id": None if parent is None else f"{parent.span_id:016x}",
        "attributes": dict(span.attributes or {}),
        "status": span.status.status_code.name,
    }


def main() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable(provider)
    target = Path(os.environ["TRACE_SPANS_FILE"])

    def write() -> None:
        lines = [json.dumps(span_record(s)) for s in exporter.get_finished_spans()]
        target.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")

    atexit.register(write)
    from moorline.cli.main import main as cli

    sys.argv[0] = "moorline"
    cli()


if __name__ == "__main__":
    main()
