"""Test helpers: poll-with-deadline instead of sleeps."""

import asyncio
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from prometheus_client.registry import Collector

from moorline.runtime.base import RuntimeStore
from moorline.types import RunId

T = TypeVar("T")

FULL_SIZE = os.environ.get("MOORLINE_FULL") == "1"
"""``make test-full``: fault and property tests at the issues' full size instead of CI size."""


async def wait_for(
    predicate: Callable[[], Awaitable[T]],
    *,
    timeout_s: float = 10.0,
    interval_s: float = 0.02,
    message: str = "condition",
) -> T:
    """Poll ``predicate`` until it returns a truthy value, or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {message}")
        await asyncio.sleep(interval_s)


async def until_interactive(store: RuntimeStore, key: str, run_id: str) -> None:
    """Wait until ``run_id``'s interactive window under ``key`` is open.

    A workflow starts before its window's open reaches the store (a round trip later, or by
    the run's first write): a test that learns of the start out of band, through an
    ``asyncio.Event``, waits here before posting a message, as a client retries its 409.
    """

    async def is_open() -> bool:
        return await store.is_interactive(key, RunId(run_id))

    await wait_for(is_open, message=f"the interactive window of run {run_id}")


def sampled(metric: Collector, sample: str, **labels: str) -> float:
    """The sum of ``metric``'s samples named ``sample`` whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(
        found.value
        for family in metric.collect()
        for found in family.samples
        if found.name == sample and wanted <= set(found.labels.items())
    )


class FakeClock:
    """A monotonic clock that moves only when a test sets :attr:`now` (TTL caches' tests)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def port_is_free(port: int) -> bool:
    """Whether nothing listens on ``port`` of 127.0.0.1 (a bind to it succeeds)."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
