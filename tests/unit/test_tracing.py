"""Tracing off is a no-op; the ``OTEL_*`` variables decide when it is on; spans nest in-process."""

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from moorline.errors import ConfigError
from moorline.observability import tracing


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, False),
    ],
)
def test_the_otel_variables_decide_whether_traces_are_wanted(
    environ: dict[str, str], on: bool
) -> None:
    assert tracing.wanted(environ) is on


def test_off_every_hook_is_the_shared_no_op() -> None:
    tracing.disable()
    assert not tracing.enabled()
    hooks = [
        tracing.trigger_span("echo", {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}),
        tracing.attempt_span(run_id="r", workflow="echo", attempt=1, lane="l", trace_context={}),
        tracing.step_span(key="k", function="f", run_id="r", attempt=1),
        tracing.model_span(model="m", simulated=True),
    ]
    assert all(hook is tracing._OFF for hook in hooks)
    with hooks[0]:
        assert tracing.carrier() is None
        tracing.record(run_id="r")  # nothing to record on, nothing raised


def test_an_exporter_that_is_not_installed_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no exporter 'zipkin_json' is installed"):
        tracing._exporter("zipkin_json")
    assert tracing._exporter("otlp") is not None  # the OTLP/HTTP one, through the fallback


def test_on_the_stored_context_makes_the_attempt_a_child_of_the_trigger() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable(provider)
    try:
        with tracing.trigger_span("echo", {}):
            stored = tracing.carrier()
        assert stored is not None and set(stored) == {"traceparent"}
        with tracing.attempt_span(
            run_id="r", workflow="echo", attempt=2, lane="l", trace_context=stored
        ):
            with tracing.model_span(model="m", simulated=False):
                tracing.record_usage(input_tokens=3, output_tokens=None)
    finally:
        tracing.disable()
    trigger, model, attempt = exporter.get_finished_spans()
    assert attempt.parent is not None and trigger.context is not None
    assert attempt.parent.span_id == trigger.context.span_id
    assert model.parent is not None and attempt.context is not None
    assert model.parent.span_id == attempt.context.span_id
    assert model.attributes is not None
    assert model.attributes["gen_ai.provider.name"] == "openai"
    assert model.attributes["gen_ai.usage.input_tokens"] == 3
    assert "gen_ai.usage.output_tokens" not in model.attributes
