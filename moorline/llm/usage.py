"""Collecting what model calls used, for the step that made them.

Every call through :mod:`moorline.llm` reports one :class:`~moorline.usage.Usage` when it ends
(the provider's ``usage``, or the simulated model's deterministic count) with :func:`report`.
The engine opens a :func:`metering` scope around each step's function; the usage reported
inside it (in the step's task, or the thread a sync step runs in: the context is copied there)
is stored with the step's checkpoint, in the same transaction, so a step's tokens are counted
exactly once. Usage reported outside any step has nowhere durable to go and is dropped: a call
outside ``ctx.step`` would be made again by every replay anyway.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from moorline.usage import Usage

__all__ = ["Usage", "metering", "report"]

_METER: ContextVar[list[Usage] | None] = ContextVar("moorline_usage_meter", default=None)


@contextmanager
def metering() -> Iterator[list[Usage]]:
    """Collect the usage reported until the scope ends (nested scopes collect apart)."""
    collected: list[Usage] = []
    token = _METER.set(collected)
    try:
        yield collected
    finally:
        _METER.reset(token)


def report(usage: Usage) -> bool:
    """Add ``usage`` to the open :func:`metering` scope; False when none is open."""
    meter = _METER.get()
    if meter is None:
        return False
    meter.append(usage)
    return True
