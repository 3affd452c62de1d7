"""Pure helpers of ``ctx.step``: how a call is identified, and what a step may return.

A step's call is recorded as the function's qualified name and a SHA-256 of the canonical JSON
of its arguments; a replay whose call differs fails the run instead of returning an output
recorded for another call (docs/reliability.md E3).
"""

import functools
import hashlib
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from moorline.concurrency import run_in_thread
from moorline.engine.streaming import StepStream, is_generator_function, is_stream
from moorline.types import JSONValue

STEP_BACKOFF_CAP_S = 60.0
"""Longest pause between two tries of one step, in seconds."""


def function_name(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of ``fn`` (of the wrapped function for a ``functools.partial``)."""
    target: Any = fn
    while isinstance(target, functools.partial):
        target = target.func
    module = getattr(target, "__module__", None) or type(target).__module__
    qualname = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"{module}.{qualname}"


def canonical_json(value: object, what: str) -> str:
    """Sorted-key, compact JSON of ``value``.

    Raises:
        TypeError: ``value`` is not JSON (an object, NaN or infinity, a non-string key);
            the message says which ``what`` it was.
    """
    try:
        return json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} must be JSON-serialisable: {exc}") from None


def call_hash(function: str, args: Sequence[object], kwargs: Mapping[str, object]) -> str:
    """SHA-256 hex of the function name and the canonical JSON of its arguments."""
    text = canonical_json(
        {"function": function, "args": list(args), "kwargs": dict(kwargs)},
        f"the arguments of step function {function}",
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def to_json(value: object, what: str) -> JSONValue:
    """``value`` as the JSON it is stored as, so a first run and a replay return the same."""
    decoded: JSONValue = json.loads(canonical_json(value, what))
    return decoded


def check_retry_policy(key: str, retries: int, backoff: float) -> None:
    """Raise ValueError when step ``key``'s ``retries`` or ``backoff`` is negative."""
    if retries < 0 or backoff < 0:
        raise ValueError(f"step {key!r}: retries and backoff must not be negative")


def backoff_delay_s(base_s: float, failures: int) -> float:
    """Seconds before the next try after ``failures`` failed tries: ``base · 2^(n-1)``, capped."""
    return min(STEP_BACKOFF_CAP_S, base_s * 2.0 ** min(failures - 1, 62))


async def call_step_function(
    fn: Callable[..., Any],
    args: Sequence[object],
    kwargs: Mapping[str, object],
    stream: Callable[[], StepStream] | None = None,
) -> object:
    """Await an async ``fn``; run a sync one in a thread so it never blocks the event loop.

    A sync step gets a thread of its own (:func:`~moorline.concurrency.run_in_thread`), not one
    of the loop's few default-executor threads, so every slot of a worker can be in a blocking
    SDK call at once. The thread sees the caller's context variables, so
    ``ctx.idempotency_key()`` works inside a sync step too.

    With ``stream`` (which makes the step's :class:`StepStream` when one is needed), a
    generator function (sync or async), or a function returning a generator, has its items
    streamed and joined (:mod:`moorline.engine.streaming`). Calling a generator function only
    makes the generator: its body runs as the stream is consumed (a sync one in the bridge's
    thread).
    """
    if inspect.iscoroutinefunction(fn):
        result: object = await fn(*args, **kwargs)
        return result
    if stream is not None and is_generator_function(fn):
        return await stream().consume(fn(*args, **kwargs))
    result = await run_in_thread(fn, *args, **kwargs)
    if inspect.isawaitable(result):
        # A sync callable returning an awaitable (a partial of an async def, a lambda).
        result = await result
    if stream is not None and is_stream(result):
        return await stream().consume(result)
    return result
