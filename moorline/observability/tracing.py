"""OpenTelemetry traces: a span per trigger, run attempt, step and model call, one trace each.

Off unless configured, and then free: every hook below first reads :data:`_tracer`, None until
:func:`configure_from_env` (``moorline serve`` and ``moorline worker`` call it at start) or
:func:`enable` sets it, and returns a shared no-op context manager. The ``otel`` extra
(``opentelemetry-api``, ``-sdk`` and the OTLP/HTTP exporter) is needed only to turn it on.

Configured through the standard variables, read by the SDK itself: tracing is on when
``OTEL_TRACES_EXPORTER`` names an exporter other than ``none``, or when an OTLP endpoint is set
(``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; the exporter is then
``otlp``), and ``OTEL_SDK_DISABLED`` is not ``true``. ``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES`` and the ``OTEL_TRACES_SAMPLER*`` and ``OTEL_BSP_*`` variables apply
as the SDK reads them. A tracer provider someone installed already (``opentelemetry-instrument``)
is used as it is.

One trace per trigger, across processes: the trigger's span is current while admission builds
the run, which stores it as a W3C ``traceparent`` (:func:`carrier`, the run's
``trace_context``); the worker that claims the run starts the attempt's span as its child
(:func:`attempt_span`), and the steps' and model calls' spans nest under that. An incoming
``traceparent`` header makes the trigger's span a child of the caller's. A run submitted from
a workflow (a child run) carries the submitting attempt's context, so it joins that trace.

Model calls follow OpenTelemetry's GenAI semantic conventions (``gen_ai.*``): operation, provider,
requested and answering model, and the tokens when the model reports them
(:func:`record_usage`).
"""

import contextlib
import importlib.metadata
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from moorline.errors import ConfigError
from moorline.types import JSONObject

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer, TracerProvider

logger = logging.getLogger(__name__)

TRACER_NAME = "moorline"

_tracer: "Tracer | None" = None
"""The tracer of this process; None while tracing is off (every hook is then a no-op)."""

_provider: "TracerProvider | None" = None

_OFF: contextlib.nullcontext[None] = contextlib.nullcontext()

Hook = contextlib.AbstractContextManager[Any]
"""What a span hook returns: the span, current while entered, or :data:`_OFF`."""


def enabled() -> bool:
    """Whether this process records spans."""
    return _tracer is not None


def enable(provider: "TracerProvider | None" = None) -> None:
    """Record spans through ``provider`` (the global provider when None).

    Raises:
        ConfigError: the ``otel`` extra is not installed.
    """
    global _tracer, _provider
    trace = _api()
    _provider = provider or trace.get_tracer_provider()
    _tracer = _provider.get_tracer(TRACER_NAME)


def disable() -> None:
    """Stop recording spans (the hooks become no-ops again)."""
    global _tracer, _provider
    _tracer = _provider = None


def fastapi_telemetry() -> dict[str, Any]:
    """FastAPI's own OpenTelemetry options: its HTTP server span per request when tracing is on.

    Off otherwise: FastAPI would ask the providers on every request whether they are set up.
    Its metrics and logs stay off (Moorline's metrics are Prometheus, ``/metrics``).
    """
    off = {"metrics": False, "logs": False}
    if _tracer is None:
        return {"tracing": False, **off}
    return {"tracing": True, "tracer_provider": _provider, "operation_spans": False, **off}


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the ``OTEL_*`` variables ask for traces (see the module docstring)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def configure_from_env(service_name: str) -> bool:
    """Turn tracing on when the ``OTEL_*`` variables ask for it; whether it is on.

    Builds the SDK's tracer provider (resource and sampler from the variables, a batch span
    processor per exporter named in ``OTEL_TRACES_EXPORTER``) and installs it as the global
    one, unless a provider was installed already.

    Args:
        service_name: ``service.name`` when ``OTEL_SERVICE_NAME`` does not set one.

    Raises:
        ConfigError: traces are asked for but the ``otel`` extra is missing, or an exporter
            named is not installed.
    """
    environ = os.environ
    if not wanted(environ):
        return False
    trace = _api()
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        enable()  # someone installed a provider already (opentelemetry-instrument)
        return True
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise ConfigError(_MISSING) from None
    attributes = {} if environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    names = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() or "otlp"
    for name in (part.strip() for part in names.split(",")):
        if name and name != "none":
            provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
    trace.set_tracer_provider(provider)
    enable(provider)
    logger.info("OpenTelemetry traces on (exporter %s)", names)
    return True


def shutdown() -> None:
    """Export the spans still buffered (a process's last act); a no-op when tracing is off."""
    if _tracer is None:
        return
    provider = _api().get_tracer_provider()
    closing = getattr(provider, "shutdown", None)
    if closing is not None:
        closing()


_MISSING = (
    "OpenTelemetry traces are asked for (OTEL_* variables) but the otel extra is not "
    "installed: pip install 'moorline[otel]'"
)

# The exporters' entry points (opentelemetry_traces_exporter); ``otlp`` is the OTLP/HTTP one
# when the gRPC package (which registers ``otlp`` itself) is absent.
_FALLBACKS = {"otlp": "otlp_proto_http"}


def _exporter(name: str) -> Any:
    points = importlib.metadata.entry_points(group="opentelemetry_traces_exporter")
    found = {point.name: point for point in points}
    point = found.get(name) or found.get(_FALLBACKS.get(name, ""))
    if point is None:
        raise ConfigError(
            f"OTEL_TRACES_EXPORTER: no exporter {name!r} is installed "
            f"(installed: {', '.join(sorted(found)) or 'none'})"
        )
    return point.load()()


def _api() -> Any:
    try:
        from opentelemetry import trace
    except ImportError:
        raise ConfigError(_MISSING) from None
    return trace


# --- the hooks ------------------------------------------------------------------------------


def trigger_span(workflow: str, headers: Mapping[str, str]) -> Hook:
    """The span of one trigger: a child of the request's span, else of the caller's.

    The request's span is FastAPI's (itself a child of the caller's ``traceparent``); without
    one, the caller's ``traceparent`` is read here. The run stored while it is current
    carries it (:func:`carrier`).
    """
    if _tracer is None:
        return _OFF
    from opentelemetry.propagate import extract
    from opentelemetry.trace import get_current_span

    parent = None if get_current_span().is_recording() else extract(headers)
    return _tracer.start_as_current_span(
        f"trigger {workflow}", context=parent, attributes={"moorline.workflow": workflow}
    )


def carrier() -> JSONObject | None:
    """The current span's context as W3C headers (``traceparent``, ``tracestate``), to store.

    None when tracing is off or no span is current.
    """
    if _tracer is None:
        return None
    from opentelemetry.propagate import inject

    headers: dict[str, str] = {}
    inject(headers)
    return dict(headers) if headers else None


def attempt_span(
    *, run_id: str, workflow: str, attempt: int, lane: str, trace_context: object
) -> Hook:
    """The span of one attempt of a run, a child of the span stored with the run."""
    if _tracer is None:
        return _OFF
    from opentelemetry.propagate import extract
    from opentelemetry.trace import SpanKind

    stored = trace_context if isinstance(trace_context, dict) else {}
    return _tracer.start_as_current_span(
        f"run {workflow}",
        # An empty Context, not the current one: a worker's task must not parent it.
        context=extract({str(k): str(v) for k, v in stored.items()}, context=_empty()),
        kind=SpanKind.CONSUMER,
        attributes={
            "moorline.run_id": run_id,
            "moorline.workflow": workflow,
            "moorline.attempt": attempt,
            "moorline.lane": lane,
        },
    )


def step_span(*, key: str, function: str, run_id: str, attempt: int) -> Hook:
    """The span of one try of a step (a step replayed from its checkpoint has none)."""
    if _tracer is None:
        return _OFF
    return _tracer.start_as_current_span(
        f"step {key}",
        attributes={
            "moorline.step": key,
            "moorline.step.function": function,
            "moorline.run_id": run_id,
            "moorline.step.try": attempt,
        },
    )


def model_span(*, model: str, simulated: bool) -> Hook:
    """The span of one model call (GenAI semantic conventions: ``chat {model}``)."""
    if _tracer is None:
        return _OFF
    from opentelemetry.trace import SpanKind

    return _tracer.start_as_current_span(
        f"chat {model}",
        kind=SpanKind.CLIENT,
        attributes={
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "moorline.simulated" if simulated else "openai",
            "gen_ai.request.model": model,
        },
    )


def record_reply(*, model: str) -> None:
    """Note the model that answered on the current model call's span."""
    span = _current()
    if span is not None:
        span.set_attribute("gen_ai.response.model", model)


def record_usage(*, input_tokens: int | None, output_tokens: int | None) -> None:
    """Note the tokens a model reports on the current model call's span (None: not reported)."""
    span = _current()
    if span is None:
        return
    if input_tokens is not None:
        span.set_attribute("gen_ai.usage.input_tokens", input_tokens)
    if output_tokens is not None:
        span.set_attribute("gen_ai.usage.output_tokens", output_tokens)


def record(**attributes: str | int | float | bool) -> None:
    """Set ``moorline.<name>`` attributes on the current span (the run id a trigger stored)."""
    span = _current()
    if span is not None:
        for name, value in attributes.items():
            span.set_attribute(f"moorline.{name}", value)


def _current() -> "Span | None":
    if _tracer is None:
        return None
    from opentelemetry.trace import get_current_span

    span: Span = get_current_span()
    return span if span.is_recording() else None


def _empty() -> Any:
    from opentelemetry.context import Context

    return Context()
